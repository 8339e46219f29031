"""A tiny seeded MoE model and what its experts do, measured on every forward pass.

:func:`build_demo_moe_model` is the Mixtral architecture (transformers' ``MixtralConfig``:
Llama attention, a top-k routed sparse MLP per layer) at the demo model's shape, with
weights drawn from our own generator exactly as :func:`~topkv.engine.models.build_demo_model`
draws the Llama demo's (the router's weights included), so (config, experts, seed) gives
the same model in any process.

:class:`ExpertRecorder` hooks every layer's router and expert block of any Mixtral-style
model (``mlp.gate`` returning ``(logits, scores, indices)``, ``mlp.experts``):

* activations: the router's top-k indices, counted per ``(layer, expert)``;
* compute latency: the expert block's wall time per routed token, per layer (transformers
  runs a layer's experts one after another inside one module, so the block is what can be
  timed: every expert of the layer that has been routed to carries the layer's figure; one
  that never was reports 0, no measurement). The first pass of each layer is left out
  (it warms the model up: allocations, first-touch pages);
* both as EMAs (``alpha`` 0.3: a step change shows 66% after 3 passes, 97% after 10), the
  rate as activations per second between two :meth:`ExpertRecorder.stats` calls.

``delay_s`` makes this model's experts slow on purpose (a sleep inside every expert block):
the injected straggler of the live tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import MixtralConfig, MixtralForCausalLM

from topkv.engine.errors import UnsupportedModelError
from topkv.engine.models import LoadedModel, demo_config_kwargs, seed_parameters
from topkv.engine.spec import DemoModelConfig

ALPHA = 0.3


def build_demo_moe_model(
    config: DemoModelConfig, seed: int, experts: int = 8, top_k: int = 2
) -> LoadedModel:
    """A Mixtral-architecture model of ``config``'s shape with ``experts`` routed experts
    (``top_k`` per token), seeded weights (module docstring)."""
    if not 1 <= top_k <= experts:
        raise UnsupportedModelError(f"MoE demo: top_k {top_k} must be in [1, {experts}]")
    mixtral = MixtralConfig(
        **demo_config_kwargs(config),
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        sliding_window=None,
    )
    with torch.random.fork_rng(devices=[]):
        model = MixtralForCausalLM(mixtral)
    model.train(False)
    seed_parameters(model, config.init_std, seed)
    model_id = (
        f"topkv-demo-mixtral-{config.layers}L-{config.hidden_size}h-{experts}x{top_k}e-seed{seed}"
    )
    return LoadedModel(
        model=model, model_id=model_id, source="demo MoE (seeded random weights)", seed=seed
    )


def moe_shape(loaded: LoadedModel) -> tuple[int, int] | None:
    """``(experts, experts_per_token)`` of a Mixtral-style model, None for a dense one."""
    experts = getattr(loaded.config, "num_local_experts", None)
    top_k = getattr(loaded.config, "num_experts_per_tok", None)
    if isinstance(experts, int) and isinstance(top_k, int) and experts > 0:
        return experts, top_k
    return None


@dataclass(frozen=True)
class ExpertFigures:
    """One expert of one layer as measured: activations/s, seconds per routed token."""

    layer: int
    expert: int
    rate: float
    compute_s: float
    activations: int


class ExpertRecorder:
    """Per-expert activation rate and compute latency of a model's passes (module doc)."""

    def __init__(
        self,
        loaded: LoadedModel,
        clock: Callable[[], float] = time.monotonic,
        alpha: float = ALPHA,
    ) -> None:
        shape = moe_shape(loaded)
        if shape is None:
            raise UnsupportedModelError(f"{loaded.model_id} has no routed experts")
        self.experts, self.top_k = shape
        self.layers = len(loaded.decoder_layers)
        self.hidden_size = int(loaded.config.hidden_size)
        self.alpha = alpha
        self.delay_s = 0.0
        self._clock = clock
        self._lock = threading.Lock()
        self._pending = torch.zeros((self.layers, self.experts), dtype=torch.long)
        self._total = torch.zeros((self.layers, self.experts), dtype=torch.long)
        self._rate = torch.zeros((self.layers, self.experts), dtype=torch.float64)
        self._compute = [0.0] * self.layers
        self._passes = [0] * self.layers
        self._since = clock()
        self._reports = 0
        self._block_start: dict[int, float] = {}
        self._pass_counts: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(loaded.decoder_layers):
            mlp = getattr(layer, "mlp", None)
            if mlp is None or not hasattr(mlp, "gate") or not hasattr(mlp, "experts"):
                raise UnsupportedModelError(f"layer {index} has no routed MLP (mlp.gate/experts)")
            mlp.gate.register_forward_hook(self._on_gate(index))
            mlp.experts.register_forward_pre_hook(self._on_experts_start(index))
            mlp.experts.register_forward_hook(self._on_experts_end(index))

    def _on_gate(self, index: int) -> Callable[..., None]:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            indices = output[2] if isinstance(output, tuple) else output
            counts = torch.bincount(indices.reshape(-1).cpu(), minlength=self.experts)
            self._pass_counts[index] = counts[: self.experts]

        return hook

    def _on_experts_start(self, index: int) -> Callable[..., None]:
        def hook(_module: Any, _args: Any) -> None:
            self._block_start[index] = time.perf_counter()

        return hook

    def _on_experts_end(self, index: int) -> Callable[..., None]:
        def hook(_module: Any, _args: Any, _output: Any) -> None:
            if self.delay_s > 0:
                time.sleep(self.delay_s)
            elapsed = time.perf_counter() - self._block_start.pop(index, time.perf_counter())
            counts = self._pass_counts.pop(index, None)
            if counts is None:
                return
            routed = int(counts.sum())
            with self._lock:
                self._pending[index] += counts
                self._total[index] += counts
                self._passes[index] += 1
                if routed and self._passes[index] > 1:  # the first pass warms the model up
                    per_token = elapsed / routed
                    old = self._compute[index]
                    self._compute[index] = (
                        per_token if old <= 0 else (1 - self.alpha) * old + self.alpha * per_token
                    )

        return hook

    def stats(self) -> tuple[int, list[ExpertFigures]]:
        """A report number (one more per call) and every expert's figures now."""
        now = self._clock()
        with self._lock:
            window = max(now - self._since, 1e-9)
            current = self._pending.to(torch.float64) / window
            self._rate = (1 - self.alpha) * self._rate + self.alpha * current
            self._pending.zero_()
            self._since = now
            self._reports += 1
            figures = [
                ExpertFigures(
                    layer,
                    expert,
                    float(self._rate[layer, expert]),
                    self._compute[layer] if self._total[layer, expert] > 0 else 0.0,
                    int(self._total[layer, expert]),
                )
                for layer in range(self.layers)
                for expert in range(self.experts)
            ]
            return self._reports, figures
