"""Validate the simulator against the live demo (issue #7 item 7b).

The simulator is configured as the local cluster of ``topkv demo`` (#6) and predicts the
TTFT of the very requests the demo served; the prediction is compared with the demo's
measured TTFT (p50, p90).

* **Requests**: the demo's JSON has no arrival times or prompt lengths, so they are rebuilt
  with the demo's own :func:`topkv.demo.workload.load_requests` (same trace, count, seed
  and speedup give the same requests). The prompt length implied by each request's KV
  ``bytes`` is checked against the rebuilt one, so a record made with other settings is
  refused rather than silently mis-simulated.
* **Cluster**: two emulated 8x H100 nodes, reduced to the GPUs the demo uses: prefill on
  GPU0 and decode on GPU1 of each node (TP 1, P:D 1:1), NVLink inside a node, one RDMA
  NIC per GPU across nodes. The demo paces every link ``dilation`` times slower than the
  hardware, so the simulated links run at ``bandwidth / dilation`` with
  ``setup * dilation`` per chunk (layer).
* **Policies**: the same :class:`~topkv.policy.route.RoutingPolicy` and
  :class:`~topkv.policy.select.CostPolicy` as the demo's router; each decode worker has
  ``decode_slots`` (2) slots, held from routing to the end of decode; one request per
  prefill pass (no batching), FIFO, pipelined layer-by-layer transfer.
* **Compute**: prefill time as a function of prompt length, fitted by least squares
  (``a + b s + c s^2`` ms) to the demo's measured ``prefill_ms``; decode steps from the
  roofline scaled to the measured per-token decode time (the record's ``decode_ms`` when
  present, else ``decode_step_ms``).

:func:`validate_against_demo` calibrates on all requests (in-sample) and also
cross-validates: prefill is fitted on even request ids only and TTFT compared on the odd
ids the fit never saw.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from topkv.kv.spec import ModelSpec
from topkv.planner.transports import DEFAULT_TRANSPORTS
from topkv.sim.cluster import ClusterSpec, NodeGroup
from topkv.sim.compute import ComputeModel, get_gpu
from topkv.sim.errors import SimError
from topkv.sim.runner import SimConfig, Simulation
from topkv.sim.workload import Request, Workload

#: Tolerance the issue sets for the TTFT p50 prediction.
TARGET_ERROR = 0.10
#: Decode time per token (ms) used when the record has no ``decode_ms``: measured, the
#: median ``decode_ms / (new_tokens - 1)`` of tests/sim/data/demo_record_50.json (50
#: requests on the 2-core dev host).
DEFAULT_DECODE_STEP_MS = 16.2


class LiveValidationError(SimError):
    """The demo record cannot be validated against (malformed, or other demo settings)."""


# -- the demo's record ---------------------------------------------------------------------


@dataclass(frozen=True)
class DemoMeasurement:
    """One request of ``topkv demo --json`` (wall-clock ms on the demo's host)."""

    id: int
    transport: str
    bytes: int
    prefill_ms: float
    exposed_ms: float
    ttft_ms: float
    decode_ms: float | None = None  # optional extra field (benchmarks/sim_vs_live.py)


@dataclass(frozen=True)
class DemoRecord:
    """A recorded demo run: its requests, the time dilation and any recorded options."""

    requests: tuple[DemoMeasurement, ...]
    dilation: float
    options: Mapping[str, Any] = field(default_factory=dict)
    source: str = "<demo json>"

    @classmethod
    def load(cls, path: Path) -> DemoRecord:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise LiveValidationError(f"cannot read the demo record {path}: {exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise LiveValidationError(f"{path}: not JSON ({exc})") from None
        return cls.from_json(data, str(path))

    @classmethod
    def from_json(cls, data: Any, source: str = "<demo json>") -> DemoRecord:
        """Parse ``topkv demo --json`` output; errors name the request and the field."""
        if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
            raise LiveValidationError(f"{source}: expected topkv demo --json output")
        summary = data.get("summary")
        try:
            dilation = float(summary["emulation"]["dilation"])  # type: ignore[index]
        except (TypeError, KeyError, ValueError):
            raise LiveValidationError(f"{source}: no summary.emulation.dilation") from None
        if not (math.isfinite(dilation) and dilation >= 1):
            raise LiveValidationError(f"{source}: dilation must be >= 1, got {dilation}")
        rows = [_measurement(row, i, source) for i, row in enumerate(data["requests"])]
        if not rows:
            raise LiveValidationError(f"{source}: the record has no requests")
        options = data.get("options")
        return cls(
            tuple(rows), dilation, dict(options) if isinstance(options, dict) else {}, source
        )


def _measurement(row: Any, index: int, source: str) -> DemoMeasurement:
    where = f"{source}: requests[{index}]"
    if not isinstance(row, dict):
        raise LiveValidationError(f"{where}: expected an object")

    def number(key: str, optional: bool = False) -> float:
        value = row.get(key)
        if value is None and (optional or key in row):
            return math.nan  # the demo writes null for a request it could not measure
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise LiveValidationError(f"{where}: {key} must be a number, got {value!r}")
        return float(value)

    rid, nbytes = number("id"), number("bytes")
    if not (rid == int(rid) and rid >= 0 and nbytes == int(nbytes) and nbytes >= 0):
        raise LiveValidationError(f"{where}: id and bytes must be non-negative integers")
    decode = number("decode_ms", optional=True)
    return DemoMeasurement(
        id=int(rid),
        transport=str(row.get("transport") or ""),
        bytes=int(nbytes),
        prefill_ms=number("prefill_ms"),
        exposed_ms=number("exposed_ms"),
        ttft_ms=number("ttft_ms"),
        decode_ms=None if math.isnan(decode) else decode,
    )


# -- calibration ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillFit:
    """Prefill wall time of one prompt: ``a + b * s + c * s**2`` ms for ``s`` tokens."""

    a_ms: float
    b_ms_per_token: float
    c_ms_per_token2: float
    rms_ms: float = 0.0  # residual of the fit
    points: int = 0

    def ms(self, tokens: float) -> float:
        return self.a_ms + self.b_ms_per_token * tokens + self.c_ms_per_token2 * tokens * tokens

    @classmethod
    def fit(cls, tokens: Sequence[float], prefill_ms: Sequence[float]) -> PrefillFit:
        """Least squares over the finite points; linear when the quadratic would go <= 0.

        Needs at least three distinct prompt lengths (two for the linear fallback).
        """
        pairs = [(float(s), float(m)) for s, m in zip(tokens, prefill_ms, strict=True)]
        pairs = [(s, m) for s, m in pairs if math.isfinite(s) and math.isfinite(m) and m > 0]
        x = np.array([s for s, _ in pairs])
        y = np.array([m for _, m in pairs])
        distinct = len(set(x.tolist()))
        if distinct < 2:
            raise LiveValidationError(
                f"cannot fit prefill time: {distinct} distinct prompt length(s) with a measured "
                "prefill_ms; need at least 2 (run the demo on more requests)"
            )
        low, high = float(x.min()), float(x.max())
        if distinct >= 3:
            coef = np.linalg.lstsq(np.column_stack([np.ones_like(x), x, x * x]), y, rcond=None)[0]
            candidate = cls(float(coef[0]), float(coef[1]), float(coef[2]))
            grid = np.linspace(low, high, 64)
            if all(candidate.ms(float(s)) > 0 for s in grid):
                return candidate._with_residual(x, y)
        coef = np.linalg.lstsq(np.column_stack([np.ones_like(x), x]), y, rcond=None)[0]
        linear = cls(float(coef[0]), float(coef[1]), 0.0)
        if linear.ms(low) <= 0 or linear.ms(high) <= 0:
            raise LiveValidationError("the prefill fit predicts non-positive times")
        return linear._with_residual(x, y)

    def _with_residual(self, x: np.ndarray, y: np.ndarray) -> PrefillFit:
        predicted = np.array([self.ms(float(s)) for s in x])
        rms = float(np.sqrt(np.mean((predicted - y) ** 2)))
        return PrefillFit(self.a_ms, self.b_ms_per_token, self.c_ms_per_token2, rms, len(x))


@dataclass(frozen=True)
class FittedComputeModel(ComputeModel):
    """A :class:`ComputeModel` whose prefill is a measured fit (one prompt per pass)."""

    prefill_fit: PrefillFit | None = None

    def prefill_s(self, prompt_tokens: list[int] | tuple[int, ...]) -> float:
        if self.prefill_fit is None:
            return super().prefill_s(prompt_tokens)
        return sum(self.prefill_fit.ms(s) for s in prompt_tokens) * 1e-3


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


# -- validation ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ValidationOptions:
    """Demo settings the record does not carry (``None``: the record's, else the demo's)."""

    seed: int | None = None
    speedup: float | None = None
    new_tokens: int | None = None
    trace: Path | None = None
    decode_slots: int = 2
    decode_step_ms: float | None = None
    policy: str = "cost"
    #: Use this prefill fit (e.g. from another run, :func:`fit_prefill`) instead of
    #: fitting the record itself.
    prefill_fit: PrefillFit | None = None


@dataclass(frozen=True)
class Comparison:
    """Predicted vs measured TTFT over one set of requests (ms)."""

    label: str
    requests: int
    measured_p50_ms: float
    predicted_p50_ms: float
    measured_p90_ms: float
    predicted_p90_ms: float

    @property
    def p50_error(self) -> float:
        return (self.predicted_p50_ms - self.measured_p50_ms) / self.measured_p50_ms

    @property
    def p90_error(self) -> float:
        return (self.predicted_p90_ms - self.measured_p90_ms) / self.measured_p90_ms

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "ttft_p50_ms": {"measured": self.measured_p50_ms, "predicted": self.predicted_p50_ms},
            "ttft_p90_ms": {"measured": self.measured_p90_ms, "predicted": self.predicted_p90_ms},
            "p50_error": self.p50_error,
            "p90_error": self.p90_error,
        }


@dataclass(frozen=True)
class ValidationReport:
    source: str
    requests: int
    dilation: float
    fit: PrefillFit
    decode_step_ms: float
    in_sample: Comparison
    cross_validated: Comparison
    transports_measured: dict[str, int]
    transports_predicted: dict[str, int]
    predicted_ttft_ms: dict[int, float]

    @property
    def within_target(self) -> bool:
        return abs(self.in_sample.p50_error) <= TARGET_ERROR

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "requests": self.requests,
            "dilation": self.dilation,
            "prefill_fit_ms": {
                "a": self.fit.a_ms,
                "b_per_token": self.fit.b_ms_per_token,
                "c_per_token2": self.fit.c_ms_per_token2,
                "rms": self.fit.rms_ms,
                "points": self.fit.points,
            },
            "decode_step_ms": self.decode_step_ms,
            "in_sample": self.in_sample.as_dict(),
            "cross_validated": self.cross_validated.as_dict(),
            "target_p50_error": TARGET_ERROR,
            "within_target": self.within_target,
            "transports": {
                "measured": self.transports_measured,
                "predicted": self.transports_predicted,
            },
        }


def _setting(explicit: Any, record: DemoRecord, key: str, default: Any) -> Any:
    if explicit is not None:
        return explicit
    return record.options.get(key, default)


def rebuild_requests(record: DemoRecord, options: ValidationOptions) -> list[Request]:
    """The demo's requests (arrival s, prompt length, new tokens), checked against ``bytes``."""
    from topkv.demo.runner import DemoOptions
    from topkv.demo.workload import find_trace, load_requests
    from topkv.engine.spec import DemoModelConfig
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
        raise LiveValidationError(f"cannot rebuild the demo's requests: {exc}") from None
    cfg = DemoModelConfig()
    per_token = 2 * cfg.kv_heads * cfg.head_dim * 4 * cfg.layers
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


def simulate_demo(
    requests: Sequence[Request],
    fit: PrefillFit,
    dilation: float,
    decode_step_ms: float,
    options: ValidationOptions = ValidationOptions(),
) -> tuple[dict[int, float], dict[int, str]]:
    """Simulated TTFT (ms) and transport of every request on the demo's local cluster."""
    if options.decode_slots < 1:
        raise LiveValidationError(f"decode slots must be >= 1, got {options.decode_slots}")
    if not (math.isfinite(decode_step_ms) and decode_step_ms > 0):
        raise LiveValidationError(f"decode step must be > 0 ms, got {decode_step_ms}")
    model = demo_model_spec()
    cached = max(1, round(float(np.median([r.input_tokens for r in requests]))))
    compute = FittedComputeModel(
        model, get_gpu("H100"), tp=1, kv_dtype=DEMO_KV_DTYPE, prefill_fit=fit
    ).calibrated(decode_step_ms=decode_step_ms, at_batch=1, at_cached_tokens=cached)
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
    sim = Simulation(config, Workload("topkv-demo", tuple(requests)), options.policy)
    sim.run()
    ttft = {r.req.rid: r.ttft * 1e3 for r in sim.done}
    transport = {r.req.rid: r.transport for r in sim.done}
    return ttft, transport


def _compare(
    label: str, measured: Mapping[int, float], predicted: Mapping[int, float], ids: set[int]
) -> Comparison:
    use = sorted(i for i in ids if i in predicted and math.isfinite(measured.get(i, math.nan)))
    if len(use) < 2:
        raise LiveValidationError(f"{label}: fewer than 2 requests with a measured TTFT")
    meas = np.array([measured[i] for i in use])
    pred = np.array([predicted[i] for i in use])
    return Comparison(
        label,
        len(use),
        float(np.percentile(meas, 50)),
        float(np.percentile(pred, 50)),
        float(np.percentile(meas, 90)),
        float(np.percentile(pred, 90)),
    )


def fit_prefill(
    record: DemoRecord, requests: Sequence[Request], ids: set[int] | None = None
) -> PrefillFit:
    """Prefill fit from the record's measured ``prefill_ms`` (of ``ids`` only, if given)."""
    tokens = {r.rid: r.input_tokens for r in requests}
    rows = [m for m in record.requests if m.id in tokens and (ids is None or m.id in ids)]
    return PrefillFit.fit([tokens[m.id] for m in rows], [m.prefill_ms for m in rows])


def measured_decode_step_ms(record: DemoRecord, new_tokens: int) -> float:
    """Median decode time per simulated step from the record's ``decode_ms``, else the
    measured default. The first token comes from prefill; the simulator decodes n - 1."""
    steps = max(1, new_tokens - 1)
    decodes = [m.decode_ms / steps for m in record.requests if m.decode_ms]
    return float(np.median(decodes)) if decodes else DEFAULT_DECODE_STEP_MS


def calibration_from(other: DemoRecord, options: ValidationOptions) -> ValidationOptions:
    """``options`` with the prefill fit and decode step of another recorded run (same
    settings), so that a run is predicted by a calibration that never saw it."""
    requests = rebuild_requests(other, options)
    decode = options.decode_step_ms
    if decode is None:
        decode = measured_decode_step_ms(other, requests[0].output_tokens)
    return replace(options, prefill_fit=fit_prefill(other, requests), decode_step_ms=decode)


def validate_against_demo(
    record: DemoRecord, options: ValidationOptions = ValidationOptions()
) -> ValidationReport:
    """Predict the recorded run's TTFT with the simulator and compare (see module doc)."""
    requests = rebuild_requests(record, options)
    measured = {m.id: m.ttft_ms for m in record.requests}
    decode_step_ms = options.decode_step_ms
    if decode_step_ms is None:
        decode_step_ms = measured_decode_step_ms(record, requests[0].output_tokens)
    all_ids = {r.rid for r in requests}
    fit = options.prefill_fit or fit_prefill(record, requests)
    predicted, transports = simulate_demo(requests, fit, record.dilation, decode_step_ms, options)
    label = "in-sample" if options.prefill_fit is None else "given fit"
    in_sample = _compare(label, measured, predicted, all_ids)
    even = {i for i in all_ids if i % 2 == 0}
    held_out_fit = fit_prefill(record, requests, even)
    held_out, _ = simulate_demo(requests, held_out_fit, record.dilation, decode_step_ms, options)
    cross = _compare("cross-validated", measured, held_out, all_ids - even)
    measured_transports: dict[str, int] = {}
    for m in record.requests:
        if m.transport:
            measured_transports[m.transport] = measured_transports.get(m.transport, 0) + 1
    predicted_transports: dict[str, int] = {}
    for t in transports.values():
        predicted_transports[t] = predicted_transports.get(t, 0) + 1
    return ValidationReport(
        source=record.source,
        requests=len(requests),
        dilation=record.dilation,
        fit=fit,
        decode_step_ms=decode_step_ms,
        in_sample=in_sample,
        cross_validated=cross,
        transports_measured=dict(sorted(measured_transports.items())),
        transports_predicted=dict(sorted(predicted_transports.items())),
        predicted_ttft_ms=predicted,
    )


def format_report(report: ValidationReport) -> str:
    """Human-readable lines (measured = the demo on this host; predicted = the simulator)."""
    fit = report.fit
    lines = [
        f"simulator vs live demo ({report.source}): {report.requests} requests, links "
        f"emulated at {report.dilation:g}x dilation",
        f"prefill fit: {fit.a_ms:.1f} + {fit.b_ms_per_token:.4f} s + {fit.c_ms_per_token2:.3g} "
        f"s^2 ms (rms residual {fit.rms_ms:.1f} ms over {fit.points} requests); decode "
        f"{report.decode_step_ms:.2f} ms/token",
    ]
    for c in (report.in_sample, report.cross_validated):
        lines.append(
            f"{c.label:>15} ({c.requests} req): TTFT p50 measured {c.measured_p50_ms:,.1f} ms, "
            f"predicted {c.predicted_p50_ms:,.1f} ms, error {100 * c.p50_error:+.1f}%; p90 "
            f"{c.measured_p90_ms:,.1f} vs {c.predicted_p90_ms:,.1f} ms, "
            f"error {100 * c.p90_error:+.1f}%"
        )
    lines.append(
        f"transports measured {report.transports_measured}, predicted {report.transports_predicted}"
    )
    verdict = "within" if report.within_target else "NOT within"
    lines.append(
        f"TTFT p50 error {verdict} the {TARGET_ERROR:.0%} target ({report.in_sample.label})"
    )
    return "\n".join(lines)
