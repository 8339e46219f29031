"""Prefill with layer-by-layer K/V publication: one forward pass, one callback per layer.

Forward hooks on the decoder layers read each layer's freshly written cache entry the moment
the layer returns, convert it to the wire layout and hand it to ``on_layer`` before the next
layer starts. The caller (the prefill worker) can ship the layer while later layers compute.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from topkv.engine.deps import require_model_extra
from topkv.engine.errors import KVLayoutError

require_model_extra()

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402
from transformers.cache_utils import DynamicLayer  # noqa: E402

from topkv.engine.layout import hf_to_wire  # noqa: E402
from topkv.engine.models import LoadedModel  # noqa: E402

#: ``on_layer(layer_index, k, v)``; K and V are contiguous ``[seq_len, kv_heads, head_dim]``.
LayerCallback = Callable[[int, torch.Tensor, torch.Tensor], None]
#: ``turn()``: held around each forward pass over the model (a chunk, a decode step), so
#: the engine serializes passes while letting others run between a request's passes.
Turn = Callable[[], AbstractContextManager[object]]


@dataclass(frozen=True)
class LayerTiming:
    """``time.perf_counter`` stamps for one decoder layer of one prefill."""

    layer: int
    start_s: float  # the layer's forward began
    end_s: float  # the layer's forward returned (its K/V are final)
    published_s: float  # on_layer returned

    @property
    def compute_s(self) -> float:
        """Seconds the layer itself computed (excludes the callback)."""
        return self.end_s - self.start_s

    @property
    def callback_s(self) -> float:
        """Seconds spent converting K/V and inside ``on_layer``."""
        return self.published_s - self.end_s


@dataclass(frozen=True)
class PrefillResult:
    """Outcome of one prefill: the first generated token and where the time went."""

    first_token: int
    prompt_len: int
    forward_start_s: float
    forward_end_s: float
    layers: list[LayerTiming] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        """Wall time of the forward pass, callbacks included."""
        return self.forward_end_s - self.forward_start_s

    @property
    def compute_s(self) -> float:
        """Wall time minus the time spent in callbacks."""
        return self.total_s - sum(t.callback_s for t in self.layers)

    @property
    def layer_compute_s(self) -> list[float]:
        """Per-layer compute seconds, in layer order."""
        return [t.compute_s for t in self.layers]


def as_input_ids(input_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Token ids as a ``[1, seq_len]`` int64 tensor (batch of one)."""
    ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor(list(input_ids))
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
        raise KVLayoutError(
            f"expected one non-empty prompt of token ids, got shape {tuple(ids.shape)}"
        )
    return ids.to(dtype=torch.long)


def check_token_ids(loaded: LoadedModel, ids: torch.Tensor) -> None:
    """Raise :class:`KVLayoutError` for ids outside the vocabulary or beyond the context."""
    vocab = int(loaded.config.vocab_size)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
        raise KVLayoutError(f"token ids must be in [0, {vocab}), got range [{low}, {high}]")
    limit = getattr(loaded.config, "max_position_embeddings", None)
    if isinstance(limit, int) and ids.shape[1] > limit:
        raise KVLayoutError(f"prompt has {ids.shape[1]} tokens, the model's context is {limit}")


def greedy_token(logits: torch.Tensor) -> int:
    """Argmax of the last position's logits (ties go to the lowest id)."""
    return int(torch.argmax(logits[0, -1]).item())


class PrefillRunner:
    """Runs prefill for one request at a time on a loaded model."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded

    def run(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        on_layer: LayerCallback,
        chunk_tokens: int | None = None,
        turn: Turn = nullcontext,
    ) -> PrefillResult:
        """One forward pass over the prompt; ``on_layer`` fires once per layer, in order.

        Each call happens as soon as that layer has finished, before the next layer starts
        and before this method returns. The tensors passed are fresh copies the callee may
        keep. Returns the greedy first token and per-layer timings.

        ``chunk_tokens``: chunked prefill (a converted decode worker, policy.adp): the
        prompt goes through the model ``chunk_tokens`` at a time, each chunk attending to
        the cache the earlier ones filled; a layer's K/V is whole, and published, in the
        last chunk's pass (its timings are the last chunk's).

        ``turn``: held around each chunk's pass, and released between chunks, so a worker's
        decode steps can run between them (the engine's turns, service.engines). The layer
        hooks are on the model only during the last chunk's pass: another request's pass
        between chunks fires none of them.
        """
        ids = as_input_ids(input_ids)
        check_token_ids(self.loaded, ids)
        model = self.loaded.model
        cache = DynamicCache(config=model.config)
        starts: dict[int, float] = {}
        timings: list[LayerTiming] = []
        handles = []
        step = ids.shape[1] if chunk_tokens is None else max(1, chunk_tokens)
        chunks = [ids[:, i : i + step] for i in range(0, ids.shape[1], step)]
        publishing = [len(chunks) == 1]

        def make_hooks(index: int) -> tuple[Callable[..., None], Callable[..., None]]:
            def before(_module: Any, _args: Any) -> None:
                starts[index] = time.perf_counter()

            def after(_module: Any, _args: Any, _output: Any) -> None:
                if not publishing[0]:
                    return  # an earlier chunk: this layer's K/V is not whole yet
                end = time.perf_counter()
                layer = cache.layers[index]
                if (
                    not isinstance(layer, DynamicLayer)
                    or layer.keys is None
                    or layer.values is None
                ):
                    raise KVLayoutError(
                        f"decoder layer {index} left no full-attention K/V in the cache"
                    )
                on_layer(index, hf_to_wire(layer.keys), hf_to_wire(layer.values))
                timings.append(LayerTiming(index, starts[index], end, time.perf_counter()))

            return before, after

        with torch.inference_mode():
            forward_start = time.perf_counter()
            for number, chunk in enumerate(chunks):
                last = number == len(chunks) - 1
                publishing[0] = last
                with turn():
                    if last:
                        for index, decoder_layer in enumerate(self.loaded.decoder_layers):
                            before, after = make_hooks(index)
                            handles.append(decoder_layer.register_forward_pre_hook(before))
                            handles.append(decoder_layer.register_forward_hook(after))
                    try:
                        output = model(
                            input_ids=chunk.to(self.loaded.device),
                            cache=cache,
                            use_cache=True,
                            logits_to_keep=1,
                        )
                    finally:
                        for handle in handles:
                            handle.remove()
                        handles.clear()
            first_token = greedy_token(output.logits)
            forward_end = time.perf_counter()
        return PrefillResult(
            first_token=first_token,
            prompt_len=int(ids.shape[1]),
            forward_start_s=forward_start,
            forward_end_s=forward_end,
            layers=timings,
        )
