"""What a worker computes: the engine behind ``topkv worker --engine synthetic|hf``.

:class:`WorkerEngine` is what :class:`~topkv.service.worker.service.WorkerService` calls
(``plan``; ``prefill``, publishing the KV layer by layer; ``decode``). :class:`SyntheticEngine`
(deterministic bytes, never torch) and :class:`HfEngine` (a transformers model through
:mod:`topkv.engine`) implement it; :func:`build_engine` makes one from an :class:`EngineSpec`.
:class:`EngineTurns` gives a model one forward pass at a time, paced with ``--compute-pace``
(:mod:`topkv.service.compute.pace`). How: docs/services.md ("What a worker is").
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from topkv.engine.spec import KVModelSpec
from topkv.errors import ConfigError
from topkv.service.compute.pace import (
    ComputePacer,
    PaceCollector,
    PaceMark,
    check_pace,
    check_torch_threads,
)
from topkv.service.errors import ServiceError
from topkv.service.kvstore import HeldKV, synthetic_layers
from topkv.service.messages import PrefillRequest
from topkv.transport.base import KVLayout, LayerTensors
from topkv.wire import crc64

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from topkv.engine import DemoModelConfig

#: ``publish(layer_index, tensors, crcs)``: one finished layer.
Publish = Callable[[int, LayerTensors, tuple[int, ...]], None]

EngineKind = Literal["synthetic", "hf"]

#: numpy dtype of a model's KV -> the wire's dtype name.
WIRE_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def wire_layout(spec: KVModelSpec, prompt_len: int) -> KVLayout:
    """The wire layout of a ``prompt_len``-token prompt's KV under the model's ``spec``."""
    return KVLayout(
        num_layers=spec["layers"],
        seq_len=prompt_len,
        kv_heads=spec["kv_heads"],
        head_dim=spec["head_dim"],
        dtype=WIRE_DTYPES[spec["dtype"]],
    )


class EngineRequestError(ServiceError):
    """This worker's engine cannot serve the request as asked (answered as 400)."""


@dataclass(frozen=True)
class PrefillPlan:
    """What one prefill will produce: the KV's model id and layout, and the prompt."""

    request_id: int
    model_id: str
    layout: KVLayout
    prompt: tuple[int, ...] = ()
    #: Chunked prefill (a converted decode worker): the model takes the prompt this many
    #: tokens at a time; None: one pass. The synthetic engine computes nothing to chunk.
    chunk_tokens: int | None = None


#: Threads a serial engine's worker runs engine calls on: calls past the first wait for
#: their turn on the model (:class:`EngineTurns`); a call past these waits for a thread.
ENGINE_THREADS = 16


class EngineTurns:
    """One forward pass at a time on a model, in the order the passes were asked for.

    ``turn(kind)`` holds the model for one pass or a run of them; a holder that can pause
    (a decode between steps) calls ``yield_to(kind, own)``: when a ``kind`` call waits, it
    and whoever asked before it go first, then the holder continues. ``started_s`` is the
    time the calling thread's current call first got the model (None before; ``begin()``
    starts a call), so an engine call's time excludes its wait for the model.

    ``pacer`` (paced compute, :mod:`topkv.service.compute.pace`): each span the model is
    held, from a take to the next give (a pass, a chunk, a decode's steps between yields),
    is one paced turn, held before the model is given back; :meth:`pace_layer` holds a
    layer inside one. None: no hold (the default).
    """

    def __init__(self, pacer: ComputePacer | None = None) -> None:
        self._cond = threading.Condition()
        self._queue: deque[tuple[object, str]] = deque()
        self._busy = False
        self._local = threading.local()
        self.pacer = pacer

    def _take(self, kind: str) -> None:
        me = object()
        with self._cond:
            self._queue.append((me, kind))
            self._cond.wait_for(lambda: not self._busy and self._queue[0][0] is me)
            self._queue.popleft()
            self._busy = True
        if getattr(self._local, "started_s", None) is None:
            self._local.started_s = time.perf_counter()
        if self.pacer is not None:
            self._local.mark = self.pacer.start()

    def begin(self) -> None:
        """A new engine call on this thread: its start is its first turn's."""
        self._local.started_s = None

    def _give(self) -> None:
        mark: PaceMark | None = getattr(self._local, "mark", None)
        if self.pacer is not None and mark is not None:
            self._local.mark = None
            self.pacer.end(mark)  # still holding the model: the emulated device is busy
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    @contextmanager
    def turn(self, kind: str) -> Iterator[None]:
        self._take(kind)
        try:
            yield
        finally:
            self._give()

    def pace_layer(self) -> None:
        """Inside a turn: with a pacer, wait until C times the turn's CPU time so far passed
        (a layer is published when the emulated device would have made it)."""
        mark: PaceMark | None = getattr(self._local, "mark", None)
        if self.pacer is not None and mark is not None:
            self.pacer.hold(mark)

    def waiting(self, kind: str) -> int:
        """Calls of ``kind`` waiting for a turn."""
        with self._cond:
            return sum(1 for _, k in self._queue if k == kind)

    def yield_to(self, kind: str, own: str) -> None:
        """Inside a turn: let a waiting ``kind`` call (and those ahead of it) run first."""
        if self.waiting(kind):
            self._give()
            self._take(own)

    def started_s(self) -> float | None:
        """When the calling thread's current engine call first got the model."""
        started = getattr(self._local, "started_s", None)
        return None if started is None else float(started)

    def span(self, asked_s: float) -> tuple[float, float]:
        """(The current call's start, not before ``asked_s``; now.)"""
        started = self.started_s()
        return (asked_s if started is None else max(asked_s, started)), time.perf_counter()


class WorkerEngine(Protocol):
    name: EngineKind
    serial: bool
    threads: int

    def describe(self) -> dict[str, object]: ...

    def plan(self, request_id: int, body: PrefillRequest) -> PrefillPlan: ...

    def prefill(self, plan: PrefillPlan, publish: Publish) -> int | None: ...

    def decode(self, kv: HeldKV, first_token: int, max_new_tokens: int) -> list[int]: ...

    def call_span(self, asked_s: float) -> tuple[float, float]:
        """On the thread of an engine call that just ended: (when it began computing, not
        before ``asked_s``, when it was asked; now)."""
        ...

    def generate(self, plan: PrefillPlan, max_new_tokens: int) -> list[int]:
        """Prefill and decode ``plan``'s prompt here alone (the single-process reference)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class EngineSpec:
    """Which engine a worker hosts (``topkv worker --engine ...``).

    ``hf`` needs exactly one of ``model_path`` (a local Hugging Face directory) or
    ``demo_seed`` (the seeded demo model, :func:`topkv.engine.build_demo_model`, shaped by
    ``demo_config``, default :class:`~topkv.engine.DemoModelConfig`). ``torch_threads``:
    torch's intra-op threads (0 leaves torch's default; workers sharing cores want 1).
    """

    kind: EngineKind = "synthetic"
    model_path: Path | None = None
    demo_seed: int | None = None
    demo_config: DemoModelConfig | None = None
    torch_threads: int = 0
    #: With ``demo_seed``: 0 builds the Llama demo; N >= 2 the Mixtral-architecture MoE demo
    #: with N experts, top-2 (:func:`topkv.engine.moe.build_demo_moe_model`), whose workers
    #: report expert statistics in their heartbeats.
    demo_experts: int = 0
    #: Paced compute (``--compute-pace C``, :mod:`topkv.service.compute.pace`): every engine
    #: turn lasts C times its own CPU time; None: off. Needs ``torch_threads`` 1.
    compute_pace: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("synthetic", "hf"):
            raise ConfigError(f"--engine must be synthetic or hf, not {self.kind!r}")
        model_given = self.model_path is not None or self.demo_seed is not None
        if self.kind == "synthetic" and model_given:
            raise ConfigError("--model-path and --demo-model need --engine hf")
        if self.kind == "hf" and (self.model_path is None) == (self.demo_seed is None):
            raise ConfigError(
                "--engine hf needs exactly one of --model-path DIR or --demo-model SEED"
            )
        if self.torch_threads < 0:
            raise ConfigError(f"--torch-threads must be >= 0, got {self.torch_threads}")
        if self.demo_experts and (self.demo_seed is None or self.demo_experts < 2):
            raise ConfigError("an MoE demo needs --demo-model SEED and at least 2 experts")
        check_pace(self.compute_pace)
        if self.compute_pace is not None and self.kind != "hf":
            raise ConfigError("--compute-pace paces a model's compute: it needs --engine hf")
        if self.compute_pace is not None and self.torch_threads != 1:
            raise ConfigError(
                "--compute-pace counts the engine thread's CPU time, so torch must compute on "
                f"that thread alone: give --torch-threads 1 (got {self.torch_threads})"
            )

    def cli_args(self) -> list[str]:
        """The ``topkv worker`` flags that select this engine."""
        args = ["--engine", self.kind]
        if self.model_path is not None:
            args += ["--model-path", str(self.model_path)]
        if self.demo_seed is not None:
            args += ["--demo-model", str(self.demo_seed)]
        if self.demo_experts:
            args += ["--demo-moe-experts", str(self.demo_experts)]
        if self.torch_threads:
            args += ["--torch-threads", str(self.torch_threads)]
        if self.compute_pace is not None:
            args += ["--compute-pace", repr(self.compute_pace)]
        return args


def build_engine(spec: EngineSpec) -> WorkerEngine:
    """The engine ``spec`` names, ready to serve (loading a model takes seconds)."""
    if spec.kind == "synthetic":
        return SyntheticEngine()
    return HfEngine.build(spec)


class SyntheticEngine:
    """Deterministic pseudo-random KV of any layout (a stand-in for a model's prefill)."""

    name: EngineKind = "synthetic"
    serial = False
    threads = 1

    def describe(self) -> dict[str, object]:
        return {"engine": self.name, "model_id": None}

    def plan(self, request_id: int, body: PrefillRequest) -> PrefillPlan:
        if body.has_prompt or body.layout is None:
            raise EngineRequestError(
                "this worker runs the synthetic engine: give 'model_id' and 'layout' "
                "(prompts need a worker started with --engine hf)"
            )
        return PrefillPlan(request_id, body.model_id, body.layout.to_layout())

    def prefill(self, plan: PrefillPlan, publish: Publish) -> int | None:
        for index, (tensors, crcs) in enumerate(
            synthetic_layers(plan.request_id, plan.model_id, plan.layout)
        ):
            publish(index, tensors, crcs)
        return None

    def decode(self, kv: HeldKV, first_token: int, max_new_tokens: int) -> list[int]:
        raise EngineRequestError(
            "this worker runs the synthetic engine, which cannot decode; start it with "
            "--engine hf --model-path DIR | --demo-model SEED"
        )

    def generate(self, plan: PrefillPlan, max_new_tokens: int) -> list[int]:
        return self.decode(HeldKV.producing(-1, plan.model_id, plan.layout), 0, max_new_tokens)

    def call_span(self, asked_s: float) -> tuple[float, float]:
        return asked_s, time.perf_counter()

    def close(self) -> None:
        return None


def _bytes_of(array: np.ndarray) -> memoryview:
    """A flat byte view of a C-contiguous array (no copy)."""
    flat: Any = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return memoryview(flat)


class HfEngine:
    """A transformers model (demo or local directory) through :mod:`topkv.engine`."""

    name: EngineKind = "hf"
    serial = True
    threads = ENGINE_THREADS

    def __init__(
        self, loaded: Any, torch_threads: int = 0, compute_pace: float | None = None
    ) -> None:
        from topkv import engine

        self.loaded = loaded
        self.spec = engine.kv_model_spec(loaded)
        if self.spec["dtype"] not in WIRE_DTYPES:
            raise ConfigError(
                f"model {self.spec['model_id']}: KV dtype {self.spec['dtype']} cannot go on "
                f"the wire (supported: {', '.join(WIRE_DTYPES)})"
            )
        self.model_id = str(self.spec["model_id"])
        self.vocab_size = int(loaded.config.vocab_size)
        limit = getattr(loaded.config, "max_position_embeddings", None)
        self.max_prompt = int(limit) if isinstance(limit, int) else None
        self.torch_threads = torch_threads
        self._prefill = engine.PrefillRunner(loaded)
        self._decode = engine.DecodeRunner(loaded)
        pacer = ComputePacer(compute_pace) if compute_pace is not None else None
        self.turns = EngineTurns(pacer)  # one forward pass at a time (hooks are per model)
        from topkv.engine.moe import ExpertRecorder, moe_shape

        #: An MoE model's per-expert statistics (service.worker.experts reports them).
        self.experts = ExpertRecorder(loaded) if moe_shape(loaded) is not None else None

    @classmethod
    def build(cls, spec: EngineSpec) -> HfEngine:
        from topkv import engine  # raises EngineUnavailable (with the install hint) lazily

        engine.require_model_extra()
        if spec.torch_threads:
            import torch

            torch.set_num_threads(spec.torch_threads)
        if spec.compute_pace is not None:  # the turn's CPU time must be all its compute
            import torch

            check_torch_threads(torch.get_num_threads())
        if spec.model_path is not None:
            loaded = engine.load_model(spec.model_path)
        else:
            assert spec.demo_seed is not None
            config = spec.demo_config if spec.demo_config is not None else engine.DemoModelConfig()
            if spec.demo_experts:
                from topkv.engine.moe import build_demo_moe_model

                loaded = build_demo_moe_model(config, spec.demo_seed, spec.demo_experts)
            else:
                loaded = engine.build_demo_model(config, spec.demo_seed)
        return cls(loaded, spec.torch_threads, spec.compute_pace)

    def describe(self) -> dict[str, object]:
        described: dict[str, object] = {
            "engine": self.name,
            "model_id": self.model_id,
            "source": self.loaded.source,
            "layers": self.spec["layers"],
            "kv_heads": self.spec["kv_heads"],
            "head_dim": self.spec["head_dim"],
            "dtype": WIRE_DTYPES[self.spec["dtype"]],
            "vocab_size": self.vocab_size,
        }
        if self.turns.pacer is not None:  # paced compute: its pace, turns and overruns
            described["compute_pace"] = self.turns.pacer.describe()
        return described

    def layout(self, prompt_len: int) -> KVLayout:
        return wire_layout(self.spec, prompt_len)

    def plan(self, request_id: int, body: PrefillRequest) -> PrefillPlan:
        from topkv.engine import prompt_token_ids

        if not body.has_prompt:
            raise EngineRequestError(
                f"this worker serves model {self.model_id}: give a prompt ('prompt' token "
                "ids, or 'prompt_seed' with 'prompt_tokens'), not a layout"
            )
        if body.model_id and body.model_id != self.model_id:
            raise EngineRequestError(
                f"this worker serves model {self.model_id}, not {body.model_id!r}"
            )
        if body.prompt is not None:
            ids = tuple(body.prompt)
        else:
            assert body.prompt_seed is not None and body.prompt_tokens is not None
            ids = tuple(prompt_token_ids(body.prompt_tokens, body.prompt_seed, self.vocab_size))
        low, high = min(ids), max(ids)
        if low < 0 or high >= self.vocab_size:
            raise EngineRequestError(
                f"token ids must be in [0, {self.vocab_size}), got range [{low}, {high}]"
            )
        if self.max_prompt is not None and len(ids) > self.max_prompt:
            raise EngineRequestError(
                f"prompt has {len(ids)} tokens, the model's context is {self.max_prompt}"
            )
        return PrefillPlan(request_id, self.model_id, self.layout(len(ids)), ids)

    def prefill(self, plan: PrefillPlan, publish: Publish) -> int | None:
        from topkv.engine import layer_to_numpy

        def on_layer(index: int, k: Any, v: Any) -> None:
            k_np, v_np = layer_to_numpy(k, v)
            tensors = (_bytes_of(k_np), _bytes_of(v_np))
            crcs = tuple(crc64(t) for t in tensors)
            self.turns.pace_layer()  # paced compute: the layer is out when the device made it
            publish(index, tensors, crcs)

        self.turns.begin()
        if plan.chunk_tokens is None:  # one pass, one turn
            with self.turns.turn("prefill"):
                result = self._prefill.run(list(plan.prompt), on_layer)
        else:  # one turn per chunk: decode steps run between them
            result = self._prefill.run(
                list(plan.prompt),
                on_layer,
                plan.chunk_tokens,
                turn=lambda: self.turns.turn("prefill"),
            )
        return int(result.first_token)

    def decode(self, kv: HeldKV, first_token: int, max_new_tokens: int) -> list[int]:
        from topkv.engine import arrays_from_bytes

        expected = self.layout(kv.layout.seq_len)
        if kv.model_id != self.model_id or kv.layout != expected:
            raise EngineRequestError(
                f"request {kv.request_id}: KV of {kv.model_id} {kv.layout} does not fit "
                f"model {self.model_id} ({expected})"
            )
        if not 0 <= first_token < self.vocab_size:
            raise EngineRequestError(
                f"first_token must be in [0, {self.vocab_size}), got {first_token}"
            )
        self.turns.begin()
        with kv.use():
            if len(kv.layers) != expected.num_layers:
                raise EngineRequestError(f"request {kv.request_id}: its KV was released")
            layers = [arrays_from_bytes(self.spec, expected.seq_len, *layer) for layer in kv.layers]
            with self.turns.turn("decode"):
                tokens = self._decode.generate(
                    layers,
                    first_token,
                    expected.seq_len,
                    max_new_tokens,
                    between_steps=lambda: self.turns.yield_to("prefill", "decode"),
                )
        return [int(t) for t in tokens]

    def call_span(self, asked_s: float) -> tuple[float, float]:
        return self.turns.span(asked_s)

    def generate(self, plan: PrefillPlan, max_new_tokens: int) -> list[int]:
        from topkv.engine import reference_generate

        self.turns.begin()
        with self.turns.turn("generate"):
            return [
                int(t) for t in reference_generate(self.loaded, list(plan.prompt), max_new_tokens)
            ]

    def close(self) -> None:
        return None


def register_pace_metrics(registry: CollectorRegistry, engine: WorkerEngine) -> None:
    """A paced engine's turns and overruns on the worker's ``GET /metrics`` (none else)."""
    if isinstance(engine, HfEngine) and engine.turns.pacer is not None:
        registry.register(PaceCollector(engine.turns.pacer))
