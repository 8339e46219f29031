"""The simulator configured as the demo's local cluster, on the demo's own requests.

:func:`requests_for` takes the record's arrivals and prompt lengths (or rebuilds them from
the demo's trace); :func:`predict` simulates the demo's two emulated nodes
(:func:`demo_cluster_spec`) with a :class:`~topkv.harness.validate_model.Calibration`,
solving the contention model's fixed point when it has one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from topkv.harness.validate_model import (
    Calibration,
    PrefillFit,
    PrefillModel,
    overlaps,
)
from topkv.harness.validate_record import DemoRecord, LiveValidationError
from topkv.kv.spec import ModelSpec
from topkv.planner.transports import DEFAULT_TRANSPORTS
from topkv.policy.view import PathCandidate
from topkv.sim.cluster import ClusterSpec, Instance, NodeGroup
from topkv.sim.compute import ComputeModel, get_gpu
from topkv.sim.runner import SimConfig, Simulation, _Decode, _Req
from topkv.traces import Request, Workload

#: Fixed point of the contention model: stop when no prefill moves by more than this.
CONVERGED_MS = 0.5
MAX_ITERATIONS = 40


# -- the demo's local cluster ----------------------------------------------------------------


def demo_model_spec() -> ModelSpec:
    """The demo's seeded model (:class:`topkv.engine.spec.DemoModelConfig` defaults)."""
    from topkv.engine.spec import DemoModelConfig

    cfg = DemoModelConfig()
    return ModelSpec(
        name="topkv-demo",
        source="topkv.engine.spec.DemoModelConfig",
        num_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
    )


#: The demo's model computes and stores K/V in float32.
DEMO_KV_DTYPE = "fp32"


def demo_cluster_spec(dilation: float) -> ClusterSpec:
    """The demo's two emulated H100 nodes, as far as its four workers use them.

    Per node GPU0 (prefill) and GPU1 (decode) with one NIC each (their nearest NICs in the
    fixture are distinct), links ``dilation`` times slower, setup ``dilation`` times longer.
    """
    if not (math.isfinite(dilation) and dilation >= 1):
        raise LiveValidationError(f"dilation must be >= 1, got {dilation}")
    return ClusterSpec(
        name=f"demo-local-dilated-{dilation:g}x",
        node_groups=[
            NodeGroup(
                count=2,
                gpu="H100",
                gpus_per_node=2,
                nvlink="node",
                nvlink_gb_s=450.0 / dilation,
                pcie_gb_s=50.0 / dilation,
                nics_per_node=2,
                nic_gb_s=25.0 / dilation,
                tcp_gb_s=10.0 / dilation,
            )
        ],
        setup_latency_s={k: v.setup_latency_s * dilation for k, v in DEFAULT_TRANSPORTS.items()},
    )


# -- the requests --------------------------------------------------------------------------


@dataclass(frozen=True)
class ValidationOptions:
    """How to validate. ``seed``/``speedup``/``new_tokens``/``trace``: demo settings the
    record does not carry (``None``: the record's, else the demo's defaults); they matter
    only for records without ``arrival_ms``/``prompt_len`` (rebuilt requests)."""

    seed: int | None = None
    speedup: float | None = None
    new_tokens: int | None = None
    trace: Path | None = None
    decode_slots: int = 2
    decode_step_ms: float | None = None
    policy: str = "cost"
    #: ``quadratic`` (the default: the better p50 on the recorded runs) or
    #: ``contention`` (the better p90 on runs without outside load; needs the timeline).
    prefill_model: str = "quadratic"
    #: Predict with this calibration (e.g. another run's, :func:`calibration_from`)
    #: instead of calibrating on the record itself.
    calibration: Calibration | None = None


def _setting(explicit: Any, record: DemoRecord, key: str, default: Any) -> Any:
    if explicit is not None:
        return explicit
    return record.options.get(key, default)


def _kv_bytes_per_token() -> int:
    return demo_model_spec().kv_bytes_per_token(DEMO_KV_DTYPE)  # K and V, all layers


def requests_for(
    record: DemoRecord, options: ValidationOptions = ValidationOptions()
) -> list[Request]:
    """The record's requests: its own arrivals and prompt lengths, or rebuilt ones."""
    if not record.has_requests:
        return rebuild_requests(record, options)
    new_tokens = int(_setting(options.new_tokens, record, "new_tokens", 8))
    if new_tokens < 1:
        raise LiveValidationError(f"new_tokens must be >= 1, got {new_tokens}")
    per_token = _kv_bytes_per_token()
    out: list[Request] = []
    for m in record.requests:
        assert m.prompt_len is not None and m.arrival_ms is not None
        if m.bytes != m.prompt_len * per_token:
            raise LiveValidationError(
                f"{record.source}: request {m.id} carries {m.bytes:,} KV bytes but prompt_len "
                f"{m.prompt_len} ({m.prompt_len * per_token:,} bytes for the demo's model); "
                "the record is not from the demo's default model"
            )
        out.append(Request(m.id, m.arrival_ms * 1e-3, m.prompt_len, new_tokens))
    return sorted(out, key=lambda r: (r.arrival_s, r.rid))


def rebuild_requests(record: DemoRecord, options: ValidationOptions) -> list[Request]:
    """The demo's requests (arrival s, prompt length, new tokens) rebuilt from the trace
    (records without ``arrival_ms``/``prompt_len``), checked against ``bytes``."""
    from topkv.demo.runner import DemoOptions
    from topkv.demo.workload import find_trace, load_requests
    from topkv.errors import TopKVError

    defaults = DemoOptions()
    seed = int(_setting(options.seed, record, "seed", defaults.seed))
    speedup = float(_setting(options.speedup, record, "speedup", defaults.speedup))
    new_tokens = int(_setting(options.new_tokens, record, "new_tokens", defaults.new_tokens))
    count = int(record.options.get("requests", len(record.requests)))
    try:
        demo_requests = load_requests(
            find_trace(options.trace),
            count,
            seed=seed,
            min_tokens=defaults.min_tokens,
            max_tokens=defaults.max_tokens,
            speedup=speedup,
        )
    except TopKVError as exc:
        raise LiveValidationError(f"{exc} (cannot rebuild the demo's requests)") from None
    per_token = _kv_bytes_per_token()
    by_id = {r.rid: r for r in demo_requests}
    out: list[Request] = []
    for m in record.requests:
        demo = by_id.get(m.id)
        if demo is None or m.bytes != demo.prompt_len * per_token:
            implied = m.bytes / per_token
            expected = "none" if demo is None else str(demo.prompt_len)
            raise LiveValidationError(
                f"{record.source}: request {m.id} carries {m.bytes:,} KV bytes ({implied:g} "
                f"tokens) but the rebuilt request has {expected} tokens; pass the demo's "
                "--requests/--seed/--trace of that run"
            )
        out.append(Request(m.id, demo.arrival_s, demo.prompt_len, new_tokens))
    return sorted(out, key=lambda r: (r.arrival_s, r.rid))


# -- simulation --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _GivenPrefill(ComputeModel):
    """Prefill time handed in per pass by :class:`_DemoSimulation` (ms, a stack)."""

    pending_ms: list[float] = field(default_factory=list)

    def prefill_s(self, prompt_tokens: list[int] | tuple[int, ...]) -> float:
        return self.pending_ms.pop() * 1e-3


class _DemoSimulation(Simulation):
    """The simulator with each request's own prefill time; records where prefill ran."""

    def __init__(
        self, config: SimConfig, workload: Workload, policy: str, prefill_ms: Mapping[int, float]
    ) -> None:
        super().__init__(config, workload, policy)
        if not isinstance(self.compute, _GivenPrefill):
            raise LiveValidationError("internal: the demo simulation needs its compute model")
        self._given = self.compute
        self._prefill_ms = prefill_ms
        self.prefill_instance: dict[int, Instance] = {}

    def _dispatch(self) -> None:
        # The demo hands a request to the lowest-numbered free prefill worker (it scans
        # them in name order); the simulator takes ``idle[-1]``.
        self.idle.sort(key=lambda inst: -inst.iid)
        super()._dispatch()

    def _start_prefill(
        self, inst: Instance, batch: list[tuple[_Req, _Decode, PathCandidate, str]]
    ) -> None:
        for r, *_ in batch:
            self.prefill_instance[r.req.rid] = inst
        self._given.pending_ms.append(sum(self._prefill_ms[r.req.rid] for r, *_ in batch))
        super()._start_prefill(inst, batch)


@dataclass(frozen=True)
class Prediction:
    """The simulator's account of every request (ms; workers named as the demo's)."""

    ttft_ms: dict[int, float]
    queue_ms: dict[int, float]
    prefill_ms: dict[int, float]
    transport: dict[int, str]
    prefill_worker: dict[int, str]
    decode_worker: dict[int, str]
    iterations: int = 1
    converged: bool = True


def _simulate_once(
    requests: Sequence[Request],
    prefill_ms: Mapping[int, float],
    calibration: Calibration,
    dilation: float,
    options: ValidationOptions,
) -> tuple[Prediction, dict[int, tuple[float, float]], dict[int, tuple[float, float]]]:
    model = demo_model_spec()
    cached = max(1, round(float(np.median([r.input_tokens for r in requests]))))
    compute = _GivenPrefill(model, get_gpu("H100"), tp=1, kv_dtype=DEMO_KV_DTYPE).calibrated(
        decode_step_ms=calibration.decode_step_ms, at_batch=1, at_cached_tokens=cached
    )
    config = SimConfig(
        model=model,
        cluster=demo_cluster_spec(dilation),
        tp=1,
        pd_ratio=(1, 1),
        pipelining=True,
        max_prefill_tokens=1,  # one prompt per forward pass, as the demo's workers
        compute=compute,
        decode_slots=options.decode_slots,
    )
    sim = _DemoSimulation(
        config, Workload("topkv-demo", tuple(requests)), options.policy, prefill_ms
    )
    sim.run()
    nodes: list[str] = []
    for gpu in sim.cluster.gpus:
        if gpu.node not in nodes:
            nodes.append(gpu.node)

    def demo_name(inst: Instance) -> str:
        return f"{inst.role}{nodes.index(inst.gpus[0].node)}"

    dispatch = calibration.dispatch_ms
    extra = calibration.overhead_ms + dispatch
    ms = 1e3
    spans: dict[int, tuple[float, float]] = {}
    decodes: dict[int, tuple[float, float]] = {}
    prediction = Prediction({}, {}, {}, {}, {}, {})
    for r in sim.done:
        rid = r.req.rid
        prediction.ttft_ms[rid] = r.ttft * ms + extra
        prediction.queue_ms[rid] = (r.prefill_start - r.req.arrival_s) * ms + dispatch
        prediction.prefill_ms[rid] = (r.prefill_end - r.prefill_start) * ms
        prediction.transport[rid] = r.transport
        prediction.prefill_worker[rid] = demo_name(sim.prefill_instance[rid])
        assert r.decode is not None
        prediction.decode_worker[rid] = demo_name(r.decode.inst)
        spans[rid] = (r.prefill_start * ms + dispatch, r.prefill_end * ms + dispatch)
        decodes[rid] = (r.xfer_end * ms + extra, r.finish * ms + extra)
    return prediction, spans, decodes


def predict(
    requests: Sequence[Request],
    calibration: Calibration,
    dilation: float,
    options: ValidationOptions = ValidationOptions(),
) -> Prediction:
    """Simulate the demo's cluster on ``requests`` with ``calibration``.

    With a :class:`ContentionFit`, each prefill's time depends on the prefills and decodes
    the *simulation* runs alongside it: simulate, recompute every prefill from its
    simulated overlaps, move halfway there, repeat until no prefill moves by more than
    :data:`CONVERGED_MS` (or :data:`MAX_ITERATIONS`).
    """
    if options.decode_slots < 1:
        raise LiveValidationError(f"decode slots must be >= 1, got {options.decode_slots}")
    step = calibration.decode_step_ms
    if not (math.isfinite(step) and step > 0):
        raise LiveValidationError(f"decode step must be > 0 ms, got {step}")
    fit = calibration.prefill
    tokens = {r.rid: r.input_tokens for r in requests}
    if isinstance(fit, PrefillFit):
        durations = {rid: fit.ms(s) for rid, s in tokens.items()}
        return _simulate_once(requests, durations, calibration, dilation, options)[0]
    durations = {rid: fit.ms(s) for rid, s in tokens.items()}
    for iteration in range(1, MAX_ITERATIONS + 1):
        prediction, spans, decodes = _simulate_once(
            requests, durations, calibration, dilation, options
        )
        seen = overlaps(spans, decodes)
        target = {rid: fit.ms(tokens[rid], seen[rid]) for rid in tokens}
        moved = max(abs(target[rid] - durations[rid]) for rid in tokens)
        if moved <= CONVERGED_MS:
            return replace(prediction, iterations=iteration, converged=True)
        durations = {rid: (durations[rid] + target[rid]) / 2 for rid in tokens}
    return replace(prediction, iterations=MAX_ITERATIONS, converged=False)


def simulate_demo(
    requests: Sequence[Request],
    fit: PrefillModel,
    dilation: float,
    decode_step_ms: float,
    options: ValidationOptions = ValidationOptions(),
) -> tuple[dict[int, float], dict[int, str]]:
    """Simulated TTFT (ms) and transport of every request on the demo's local cluster."""
    prediction = predict(requests, Calibration(fit, decode_step_ms), dilation, options)
    return prediction.ttft_ms, prediction.transport
