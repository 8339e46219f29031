"""Validate the simulator against the live demo (issue #7 item 7b).

The simulator is configured as the local cluster of ``topkv demo`` (#6) and predicts the
TTFT of the very requests the demo served; the prediction is compared with the demo's
measured TTFT (p50, p90), split into queueing (arrival -> a prefill worker picks the
request up: the demo's ``queue_ms``) and service (the rest: prefill, exposed transfer,
handoff), and request by request for the route (prefill worker, decode worker, transport).

* **Requests**: the record's own ``arrival_ms`` and ``prompt_len`` (``topkv demo --json``
  carries them); each prompt length must agree with the request's KV ``bytes``. Older
  records without them are rebuilt with the demo's :func:`topkv.demo.workload.load_requests`
  (same trace, count, seed and speedup give the same requests), checked against ``bytes``
  so that a record made with other settings is refused rather than mis-simulated.
* **Cluster**: two emulated 8x H100 nodes, reduced to the GPUs the demo uses: prefill on
  GPU0 and decode on GPU1 of each node (TP 1, P:D 1:1), NVLink inside a node, one RDMA
  NIC per GPU across nodes. The demo paces every link ``dilation`` times slower than the
  hardware, so the simulated links run at ``bandwidth / dilation`` with
  ``setup * dilation`` per chunk (layer).
* **Policies**: the same :class:`~topkv.policy.route.RoutingPolicy` and
  :class:`~topkv.policy.select.CostPolicy` as the demo's relay orchestrator; each decode
  worker has ``decode_slots`` (2) slots, held from routing to the end of decode; one
  request per prefill pass (no batching), FIFO, pipelined layer-by-layer transfer.
* **Compute**, calibrated from measurements (:class:`Calibration`):

  - ``quadratic`` (default): prefill ``a + b s + c s^2`` ms for ``s`` prompt tokens,
    least squares on the measured ``prefill_ms``;
  - ``contention``: a model of *this CPU host*, where the demo's four worker processes
    share 2 cores: ``a + s (b + k_p o_p + k_d o_d)`` ms, with ``o_p`` (``o_d``) the
    number of other prefills (decodes) running, averaged over this prefill. Fitted on the
    measured timeline (each request's prefill and decode intervals follow from
    ``arrival_ms``, ``queue_ms``, ``prefill_ms``, ``ttft_ms`` and ``decode_ms``); to
    *predict*, the overlaps come from the simulated timeline instead, solved as a fixed
    point (simulate, recompute every prefill's overlaps, damp, repeat). GPUs do not
    share compute between instances: this term models the host, not the hardware.
  - decode per token: median ``decode_ms / (new_tokens - 1)``; ``overhead_ms``: median
    ``ttft - queue - prefill - exposed`` (orchestrator handoff, first-token message),
    added to every predicted TTFT; ``dispatch_ms``: median ``queue_ms`` of requests that
    arrived to an idle prefill worker, added to every predicted queueing time.

:func:`validate_against_demo` calibrates on all requests of the run (in-sample) and also
cross-validates (calibrated on even request ids only, TTFT compared on the odd ids the fit
never saw); :func:`calibration_from` calibrates on another recorded run (cross-run).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from topkv.inputs import InputFileError, load_json
from topkv.kv.spec import ModelSpec
from topkv.planner.transports import DEFAULT_TRANSPORTS
from topkv.policy.view import PathCandidate
from topkv.sim.cluster import ClusterSpec, Instance, NodeGroup
from topkv.sim.compute import ComputeModel, get_gpu
from topkv.sim.errors import SimError
from topkv.sim.runner import SimConfig, Simulation, _Decode, _Req
from topkv.traces import Request, Workload

#: Tolerance the issue sets for the TTFT p50 prediction.
TARGET_ERROR = 0.10
#: Decode time per token (ms) used when the record has no ``decode_ms``: measured, the
#: median ``decode_ms / (new_tokens - 1)`` of a 50-request run on the 2-core dev host.
DEFAULT_DECODE_STEP_MS = 16.2
#: Fixed point of the contention model: stop when no prefill moves by more than this.
CONVERGED_MS = 0.5
MAX_ITERATIONS = 40

PREFILL_MODELS = ("quadratic", "contention")


class LiveValidationError(SimError):
    """The demo record cannot be validated against (malformed, or other demo settings)."""


# -- the demo's record ---------------------------------------------------------------------


@dataclass(frozen=True)
class DemoMeasurement:
    """One request of ``topkv demo --json`` (wall-clock ms on the demo's host).

    The optional fields are newer than issue #6's list; older records lack them.
    """

    id: int
    transport: str
    bytes: int
    prefill_ms: float
    exposed_ms: float
    ttft_ms: float
    decode_ms: float | None = None
    arrival_ms: float | None = None
    prompt_len: int | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None
    queue_ms: float | None = None

    @property
    def service_ms(self) -> float | None:
        """TTFT less queueing: prefill, exposed transfer and handoff."""
        return None if self.queue_ms is None else self.ttft_ms - self.queue_ms


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
            data = load_json(path, what="a topkv demo --json record", invalid="not JSON")
        except InputFileError as exc:
            raise LiveValidationError(str(exc)) from None
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
        if not (math.isfinite(dilation) and 1 <= dilation <= _RECORD_MAX):
            raise LiveValidationError(
                f"{source}: dilation must be >= 1 and <= {_RECORD_MAX:g}, got {dilation}"
            )
        rows = [_measurement(row, i, source) for i, row in enumerate(data["requests"])]
        if not rows:
            raise LiveValidationError(f"{source}: the record has no requests")
        ids = [m.id for m in rows]
        if len(set(ids)) != len(ids):
            raise LiveValidationError(f"{source}: request ids are not unique")
        options = data.get("options")
        options = dict(options) if isinstance(options, dict) else {}
        for key, low in (("requests", 1), ("seed", 0), ("new_tokens", 1), ("speedup", 1e-3)):
            value = options.get(key)
            high = _RECORD_BOUNDS.get(key, _RECORD_MAX)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not low <= value <= high
                or (key != "speedup" and value != int(value))
            ):
                kind = "a number" if key == "speedup" else "an integer"
                raise LiveValidationError(
                    f"{source}: options.{key} must be {kind} in [{low:g}, {high:g}]"
                )
        return cls(tuple(rows), dilation, options, source)

    @property
    def has_requests(self) -> bool:
        """Every request carries its arrival and prompt length (no rebuild needed)."""
        return all(m.arrival_ms is not None and m.prompt_len is not None for m in self.requests)

    @property
    def has_timeline(self) -> bool:
        """Every request's prefill and decode intervals follow from the record."""
        return self.has_requests and all(
            m.queue_ms is not None
            and m.decode_ms is not None
            and math.isfinite(m.prefill_ms)
            and math.isfinite(m.ttft_ms)
            for m in self.requests
        )


#: Largest magnitude of a demo record's times (ms), counts and options (except these keys):
#: far beyond any run, and small enough that the simulated horizon -- hence the memory of
#: the simulation -- stays bounded whatever the file says.
_RECORD_MAX = 1e7
_RECORD_BOUNDS = {"bytes": 1e13, "seed": 2.0**63}


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
        bound = _RECORD_BOUNDS.get(key, _RECORD_MAX)
        if not abs(value) <= bound:
            raise LiveValidationError(
                f"{where}: {key} {value:g} is out of range (at most {bound:g})"
            )
        return float(value)

    def optional(key: str) -> float | None:
        value = number(key, optional=True)
        return None if math.isnan(value) else value

    def worker(key: str) -> str | None:
        value = row.get(key)
        if value is None or value == "":
            return None
        if not isinstance(value, str):
            raise LiveValidationError(f"{where}: {key} must be a string, got {value!r}")
        return value

    rid, nbytes = number("id"), number("bytes")
    if not (math.isfinite(rid + nbytes) and rid == int(rid) >= 0 and nbytes == int(nbytes) >= 0):
        raise LiveValidationError(f"{where}: id and bytes must be non-negative integers")
    prompt_len = optional("prompt_len")
    if prompt_len is not None and not (prompt_len == int(prompt_len) and prompt_len >= 1):
        raise LiveValidationError(f"{where}: prompt_len must be a positive integer")
    arrival = optional("arrival_ms")
    if arrival is not None and not (math.isfinite(arrival) and arrival >= 0):
        raise LiveValidationError(f"{where}: arrival_ms must be >= 0, got {arrival}")
    return DemoMeasurement(
        id=int(rid),
        transport=str(row.get("transport") or ""),
        bytes=int(nbytes),
        prefill_ms=number("prefill_ms"),
        exposed_ms=number("exposed_ms"),
        ttft_ms=number("ttft_ms"),
        decode_ms=optional("decode_ms"),
        arrival_ms=arrival,
        prompt_len=None if prompt_len is None else int(prompt_len),
        prefill_worker=worker("prefill_worker"),
        decode_worker=worker("decode_worker"),
        queue_ms=optional("queue_ms"),
    )


# -- prefill models ----------------------------------------------------------------------------


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

    def describe(self) -> str:
        return (
            f"quadratic {self.a_ms:.1f} + {self.b_ms_per_token:.4f} s + "
            f"{self.c_ms_per_token2:.3g} s^2 ms"
        )


@dataclass(frozen=True)
class Overlap:
    """Other prefills / decodes running during one prefill, averaged over its duration."""

    prefills: float = 0.0
    decodes: float = 0.0


@dataclass(frozen=True)
class ContentionFit:
    """Prefill time on a shared CPU host: ``a + s (b + k_p o_p + k_d o_d)`` ms.

    ``o_p`` / ``o_d`` (:class:`Overlap`): how many other prefills / decodes ran alongside,
    on average over the prefill. ``k_p`` and ``k_d`` are the extra ms per token that one
    co-running prefill or decode costs; they are kept >= 0 (a term that fits negative is
    dropped and the rest refitted).
    """

    a_ms: float
    b_ms_per_token: float
    k_prefill_ms_per_token: float
    k_decode_ms_per_token: float
    rms_ms: float = 0.0
    points: int = 0

    def ms(self, tokens: float, overlap: Overlap = Overlap()) -> float:
        per_token = (
            self.b_ms_per_token
            + self.k_prefill_ms_per_token * overlap.prefills
            + self.k_decode_ms_per_token * overlap.decodes
        )
        return self.a_ms + per_token * tokens

    @classmethod
    def fit(
        cls, tokens: Sequence[float], overlaps: Sequence[Overlap], prefill_ms: Sequence[float]
    ) -> ContentionFit:
        rows = [
            (float(s), o, float(m))
            for s, o, m in zip(tokens, overlaps, prefill_ms, strict=True)
            if math.isfinite(float(s)) and math.isfinite(float(m)) and m > 0
        ]
        distinct = len({s for s, _, _ in rows})
        if distinct < 2 or len(rows) < 4:
            raise LiveValidationError(
                f"cannot fit the contention model: {len(rows)} measured prefills with "
                f"{distinct} distinct prompt lengths (need 4 and 2)"
            )
        s = np.array([r[0] for r in rows])
        y = np.array([r[2] for r in rows])
        columns = {
            "a": np.ones_like(s),
            "b": s,
            "kp": s * np.array([r[1].prefills for r in rows]),
            "kd": s * np.array([r[1].decodes for r in rows]),
        }
        use = list(columns)
        while True:
            x = np.column_stack([columns[k] for k in use])
            solved = dict(zip(use, np.linalg.lstsq(x, y, rcond=None)[0].tolist(), strict=True))
            negative = [k for k in ("kp", "kd", "a") if solved.get(k, 0.0) < 0]
            if not negative:
                break
            use.remove(negative[0])
        if solved.get("b", 0.0) <= 0:
            raise LiveValidationError("the contention fit gives a non-positive time per token")
        fit = cls(solved.get("a", 0.0), solved["b"], solved.get("kp", 0.0), solved.get("kd", 0.0))
        predicted = np.array([fit.ms(r[0], r[1]) for r in rows])
        rms = float(np.sqrt(np.mean((predicted - y) ** 2)))
        return replace(fit, rms_ms=rms, points=len(rows))

    def describe(self) -> str:
        return (
            f"contention {self.a_ms:.1f} + s ({self.b_ms_per_token:.3f} + "
            f"{self.k_prefill_ms_per_token:.3f} o_p + {self.k_decode_ms_per_token:.3f} o_d) ms"
        )


PrefillModel = PrefillFit | ContentionFit


def overlaps(
    prefills: Mapping[int, tuple[float, float]], decodes: Mapping[int, tuple[float, float]]
) -> dict[int, Overlap]:
    """For every prefill interval, the mean number of *other* prefills and of decodes
    running during it (intervals in any one time unit, e.g. ms)."""
    out: dict[int, Overlap] = {}
    for rid, span in prefills.items():
        out[rid] = Overlap(_shared(span, prefills, rid), _shared(span, decodes, None))
    return out


def _shared(
    span: tuple[float, float], others: Mapping[int, tuple[float, float]], skip: int | None
) -> float:
    """Total time of ``others`` (but ``skip``) inside ``span``, over its length."""
    start, end = span
    if not end > start:
        return 0.0
    total = 0.0
    for other, (s2, e2) in others.items():
        if other != skip:
            total += max(0.0, min(end, e2) - max(start, s2))
    return total / (end - start)


def measured_timeline(
    record: DemoRecord,
) -> tuple[dict[int, tuple[float, float]], dict[int, tuple[float, float]]]:
    """Each request's prefill and decode interval (ms since the first arrival), from the
    record's arrival, queueing, prefill, TTFT and decode times."""
    if not record.has_timeline:
        raise LiveValidationError(
            f"{record.source}: the contention model needs arrival_ms, prompt_len, queue_ms and "
            "decode_ms for every request (topkv demo --json gives them); use "
            "--prefill-model quadratic for an older record"
        )
    prefills: dict[int, tuple[float, float]] = {}
    decodes: dict[int, tuple[float, float]] = {}
    for m in record.requests:
        assert m.arrival_ms is not None and m.queue_ms is not None and m.decode_ms is not None
        start = m.arrival_ms + m.queue_ms
        prefills[m.id] = (start, start + m.prefill_ms)
        first_token = m.arrival_ms + m.ttft_ms
        decodes[m.id] = (first_token, first_token + m.decode_ms)
    return prefills, decodes


# -- calibration ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """Everything the simulator takes from measurements of one run (or part of one)."""

    prefill: PrefillModel
    decode_step_ms: float
    #: Added to every TTFT: handoff after the last layer landed, first-token message.
    overhead_ms: float = 0.0
    #: Added to every queueing time: arrival -> an idle prefill worker picks it up.
    dispatch_ms: float = 0.0
    points: int = 0
    source: str = ""

    @property
    def model(self) -> str:
        return "contention" if isinstance(self.prefill, ContentionFit) else "quadratic"

    def describe(self) -> str:
        return (
            f"{self.prefill.describe()} (rms residual {self.prefill.rms_ms:.1f} ms over "
            f"{self.prefill.points} requests); decode {self.decode_step_ms:.2f} ms/token; "
            f"dispatch {self.dispatch_ms:.1f} ms; overhead {self.overhead_ms:.1f} ms"
        )

    def as_dict(self) -> dict[str, Any]:
        fit = self.prefill
        if isinstance(fit, ContentionFit):
            prefill: dict[str, Any] = {
                "model": "contention",
                "a": fit.a_ms,
                "b_per_token": fit.b_ms_per_token,
                "k_prefill_per_token": fit.k_prefill_ms_per_token,
                "k_decode_per_token": fit.k_decode_ms_per_token,
            }
        else:
            prefill = {
                "model": "quadratic",
                "a": fit.a_ms,
                "b_per_token": fit.b_ms_per_token,
                "c_per_token2": fit.c_ms_per_token2,
            }
        prefill.update(rms=fit.rms_ms, points=fit.points)
        return {
            "source": self.source,
            "prefill_ms": prefill,
            "decode_step_ms": self.decode_step_ms,
            "overhead_ms": self.overhead_ms,
            "dispatch_ms": self.dispatch_ms,
        }


def measured_decode_step_ms(
    record: DemoRecord, new_tokens: int, ids: set[int] | None = None
) -> float:
    """Median decode time per simulated step from the record's ``decode_ms``, else the
    measured default. The first token comes from prefill; the simulator decodes n - 1."""
    steps = max(1, new_tokens - 1)
    decodes = [
        m.decode_ms / steps for m in record.requests if m.decode_ms and (ids is None or m.id in ids)
    ]
    return float(np.median(decodes)) if decodes else DEFAULT_DECODE_STEP_MS


def measured_overhead_ms(record: DemoRecord, ids: set[int] | None = None) -> float:
    """Median TTFT outside queueing, prefill and exposed transfer (0 without queue_ms)."""
    rest = [
        m.ttft_ms - m.queue_ms - m.prefill_ms - m.exposed_ms
        for m in record.requests
        if m.queue_ms is not None and (ids is None or m.id in ids)
    ]
    rest = [r for r in rest if math.isfinite(r)]
    return max(0.0, float(np.median(rest))) if rest else 0.0


def measured_dispatch_ms(record: DemoRecord, ids: set[int] | None = None) -> float:
    """Median ``queue_ms`` of the requests that arrived while some prefill worker was
    idle (by the record's timeline): the demo's pickup latency. 0 without a timeline."""
    if not record.has_timeline or not all(m.prefill_worker for m in record.requests):
        return 0.0
    spans, _ = measured_timeline(record)
    workers = sorted({str(m.prefill_worker) for m in record.requests})
    busy = {w: [spans[m.id] for m in record.requests if m.prefill_worker == w] for w in workers}
    picked = []
    for m in record.requests:
        if ids is not None and m.id not in ids:
            continue
        assert m.arrival_ms is not None and m.queue_ms is not None
        t = m.arrival_ms
        if any(not any(s <= t < e for s, e in busy[w]) for w in workers):
            picked.append(m.queue_ms)
    return max(0.0, float(np.median(picked))) if picked else 0.0


def resolve_model(record: DemoRecord, model: str) -> str:
    if model not in PREFILL_MODELS:
        raise LiveValidationError(f"unknown prefill model {model!r}; one of {PREFILL_MODELS}")
    if model == "contention" and not record.has_timeline:
        measured_timeline(record)  # raises the actionable error
    return model


def calibrate(
    record: DemoRecord,
    requests: Sequence[Request],
    ids: set[int] | None = None,
    model: str = "quadratic",
    decode_step_ms: float | None = None,
) -> Calibration:
    """Fit the compute model on the record's requests (``ids`` only, if given)."""
    tokens = {r.rid: r.input_tokens for r in requests}
    rows = [m for m in record.requests if m.id in tokens and (ids is None or m.id in ids)]
    new_tokens = requests[0].output_tokens if requests else 1
    decode = (
        decode_step_ms
        if decode_step_ms is not None
        else measured_decode_step_ms(record, new_tokens, ids)
    )
    prefill: PrefillModel
    if resolve_model(record, model) == "contention":
        spans, decodes = measured_timeline(record)
        seen = overlaps(spans, decodes)
        prefill = ContentionFit.fit(
            [tokens[m.id] for m in rows], [seen[m.id] for m in rows], [m.prefill_ms for m in rows]
        )
    else:
        prefill = PrefillFit.fit([tokens[m.id] for m in rows], [m.prefill_ms for m in rows])
    scope = "all requests" if ids is None else f"{len(rows)} requests"
    return Calibration(
        prefill,
        decode,
        measured_overhead_ms(record, ids),
        measured_dispatch_ms(record, ids),
        len(rows),
        f"{record.source} ({scope})",
    )


def fit_prefill(
    record: DemoRecord, requests: Sequence[Request], ids: set[int] | None = None
) -> PrefillFit:
    """Quadratic prefill fit from the record's ``prefill_ms`` (of ``ids`` only, if given)."""
    fit = calibrate(record, requests, ids, model="quadratic").prefill
    assert isinstance(fit, PrefillFit)
    return fit


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
    from topkv.engine.spec import DemoModelConfig

    cfg = DemoModelConfig()
    return 2 * cfg.kv_heads * cfg.head_dim * 4 * cfg.layers  # K and V, float32, all layers


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


# -- comparison ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PartError:
    """One part of TTFT (queueing or service) over a set of requests, ms."""

    measured_p50_ms: float
    predicted_p50_ms: float
    measured_mean_ms: float
    predicted_mean_ms: float

    @property
    def mean_error_ms(self) -> float:
        return self.predicted_mean_ms - self.measured_mean_ms

    def as_dict(self) -> dict[str, Any]:
        return {
            "p50_ms": {"measured": self.measured_p50_ms, "predicted": self.predicted_p50_ms},
            "mean_ms": {"measured": self.measured_mean_ms, "predicted": self.predicted_mean_ms},
        }


def _part(measured: np.ndarray, predicted: np.ndarray) -> PartError:
    return PartError(
        float(np.percentile(measured, 50)),
        float(np.percentile(predicted, 50)),
        float(measured.mean()),
        float(predicted.mean()),
    )


def _rank_correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (ties broken by order)."""
    ra, rb = (np.argsort(np.argsort(v, kind="stable"), kind="stable").astype(float) for v in (a, b))
    if len(a) < 2:
        return math.nan
    return float(np.corrcoef(ra, rb)[0, 1])


@dataclass(frozen=True)
class Comparison:
    """Predicted vs measured TTFT over one set of requests (ms), with its parts."""

    label: str
    requests: int
    measured_p50_ms: float
    predicted_p50_ms: float
    measured_p90_ms: float
    predicted_p90_ms: float
    measured_mean_ms: float = math.nan
    predicted_mean_ms: float = math.nan
    #: Arrival -> prefill starts (the demo's queue_ms), and TTFT less that.
    queue: PartError | None = None
    service: PartError | None = None
    rank_correlation: float = math.nan

    @property
    def p50_error(self) -> float:
        return (self.predicted_p50_ms - self.measured_p50_ms) / self.measured_p50_ms

    @property
    def p90_error(self) -> float:
        return (self.predicted_p90_ms - self.measured_p90_ms) / self.measured_p90_ms

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "requests": self.requests,
            "ttft_p50_ms": {"measured": self.measured_p50_ms, "predicted": self.predicted_p50_ms},
            "ttft_p90_ms": {"measured": self.measured_p90_ms, "predicted": self.predicted_p90_ms},
            "ttft_mean_ms": {
                "measured": self.measured_mean_ms,
                "predicted": self.predicted_mean_ms,
            },
            "p50_error": self.p50_error,
            "p90_error": self.p90_error,
            "rank_correlation": _json_number(self.rank_correlation),
        }
        if self.queue is not None and self.service is not None:
            out["queue"] = self.queue.as_dict()
            out["service"] = self.service.as_dict()
        return out


def _json_number(value: float) -> float | None:
    return value if math.isfinite(value) else None


def compare(
    label: str, record: DemoRecord, prediction: Prediction, ids: set[int] | None = None
) -> Comparison:
    """Measured vs predicted over ``ids`` (default: all) with a finite measured TTFT."""
    rows = [
        m
        for m in record.requests
        if (ids is None or m.id in ids) and m.id in prediction.ttft_ms and math.isfinite(m.ttft_ms)
    ]
    if len(rows) < 2:
        raise LiveValidationError(f"{label}: fewer than 2 requests with a measured TTFT")
    meas = np.array([m.ttft_ms for m in rows])
    pred = np.array([prediction.ttft_ms[m.id] for m in rows])
    queue = service = None
    if all(m.queue_ms is not None for m in rows):
        meas_q = np.array([m.queue_ms for m in rows], dtype=float)
        pred_q = np.array([prediction.queue_ms[m.id] for m in rows])
        queue = _part(meas_q, pred_q)
        service = _part(meas - meas_q, pred - pred_q)
    return Comparison(
        label,
        len(rows),
        float(np.percentile(meas, 50)),
        float(np.percentile(pred, 50)),
        float(np.percentile(meas, 90)),
        float(np.percentile(pred, 90)),
        float(meas.mean()),
        float(pred.mean()),
        queue,
        service,
        _rank_correlation(meas, pred),
    )


@dataclass(frozen=True)
class RouteAgreement:
    """Requests whose simulated route matches the measured one (of ``requests`` with a
    measured value for that part)."""

    requests: int
    prefill_worker: int
    decode_worker: int
    transport: int
    compared_workers: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "same_transport": self.transport,
            "workers_compared": self.compared_workers,
            "same_prefill_worker": self.prefill_worker,
            "same_decode_worker": self.decode_worker,
        }


def route_agreement(record: DemoRecord, prediction: Prediction) -> RouteAgreement:
    rows = [m for m in record.requests if m.id in prediction.transport]
    with_workers = [m for m in rows if m.prefill_worker and m.decode_worker]
    return RouteAgreement(
        requests=len(rows),
        transport=sum(m.transport == prediction.transport[m.id] for m in rows),
        compared_workers=len(with_workers),
        prefill_worker=sum(
            m.prefill_worker == prediction.prefill_worker[m.id] for m in with_workers
        ),
        decode_worker=sum(m.decode_worker == prediction.decode_worker[m.id] for m in with_workers),
    )


# -- validation ------------------------------------------------------------------------------


def _counts(values: Sequence[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        if v:
            out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class ValidationReport:
    source: str
    requests: int
    dilation: float
    calibration: Calibration
    #: Against the record's own calibration ("in-sample") or a given one ("cross-run").
    in_sample: Comparison
    #: Calibrated on even ids of this record, compared on odd ids.
    cross_validated: Comparison
    routes: RouteAgreement
    transports_measured: dict[str, int]
    transports_predicted: dict[str, int]
    predicted_ttft_ms: dict[int, float]
    iterations: int = 1
    converged: bool = True

    @property
    def fit(self) -> PrefillModel:
        return self.calibration.prefill

    @property
    def decode_step_ms(self) -> float:
        return self.calibration.decode_step_ms

    @property
    def within_target(self) -> bool:
        return abs(self.in_sample.p50_error) <= TARGET_ERROR

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "requests": self.requests,
            "dilation": self.dilation,
            "calibration": self.calibration.as_dict(),
            "fixed_point": {"iterations": self.iterations, "converged": self.converged},
            self.in_sample.label: self.in_sample.as_dict(),
            "cross_validated": self.cross_validated.as_dict(),
            "target_p50_error": TARGET_ERROR,
            "within_target": self.within_target,
            "routes": self.routes.as_dict(),
            "transports": {
                "measured": self.transports_measured,
                "predicted": self.transports_predicted,
            },
        }


def calibration_from(other: DemoRecord, options: ValidationOptions) -> ValidationOptions:
    """``options`` with the calibration of another recorded run (same demo settings), so
    that a run is predicted by a calibration that never saw it."""
    requests = requests_for(other, options)
    calibration = calibrate(
        other, requests, None, resolve_model(other, options.prefill_model), options.decode_step_ms
    )
    return replace(options, calibration=calibration)


def validate_against_demo(
    record: DemoRecord, options: ValidationOptions = ValidationOptions()
) -> ValidationReport:
    """Predict the recorded run's TTFT with the simulator and compare (see module doc)."""
    requests = requests_for(record, options)
    model = resolve_model(record, options.prefill_model)
    calibration = options.calibration or calibrate(
        record, requests, None, model, options.decode_step_ms
    )
    prediction = predict(requests, calibration, record.dilation, options)
    label = "in_sample" if options.calibration is None else "cross_run"
    primary = compare(label, record, prediction)
    all_ids = {r.rid for r in requests}
    even = {i for i in all_ids if i % 2 == 0}
    held_out = calibrate(record, requests, even, model, options.decode_step_ms)
    cross = compare(
        "cross_validated",
        record,
        predict(requests, held_out, record.dilation, options),
        all_ids - even,
    )
    return ValidationReport(
        source=record.source,
        requests=len(requests),
        dilation=record.dilation,
        calibration=calibration,
        in_sample=primary,
        cross_validated=cross,
        routes=route_agreement(record, prediction),
        transports_measured=_counts([m.transport for m in record.requests]),
        transports_predicted=_counts(list(prediction.transport.values())),
        predicted_ttft_ms=prediction.ttft_ms,
        iterations=prediction.iterations,
        converged=prediction.converged,
    )


def _comparison_lines(c: Comparison) -> list[str]:
    name = c.label.replace("_", "-")
    lines = [
        f"{name:>15} ({c.requests} req): TTFT p50 measured {c.measured_p50_ms:,.1f} ms, "
        f"predicted {c.predicted_p50_ms:,.1f} ms, error {100 * c.p50_error:+.1f}%; p90 "
        f"{c.measured_p90_ms:,.1f} vs {c.predicted_p90_ms:,.1f} ms, "
        f"error {100 * c.p90_error:+.1f}%; rank correlation {c.rank_correlation:.2f}"
    ]
    if c.queue is not None and c.service is not None:
        lines.append(
            f"{'':>15} mean TTFT error {c.predicted_mean_ms - c.measured_mean_ms:+.1f} ms = "
            f"queueing {c.queue.mean_error_ms:+.1f} + service {c.service.mean_error_ms:+.1f} ms; "
            f"p50 queueing {c.queue.measured_p50_ms:.1f} vs {c.queue.predicted_p50_ms:.1f}, "
            f"service {c.service.measured_p50_ms:.1f} vs {c.service.predicted_p50_ms:.1f} ms"
        )
    return lines


def format_report(report: ValidationReport) -> str:
    """Human-readable lines (measured = the demo on this host; predicted = the simulator)."""
    routes = report.routes
    lines = [
        f"simulator vs live demo ({report.source}): {report.requests} requests, links "
        f"emulated at {report.dilation:g}x dilation",
        f"calibration ({report.calibration.source}): {report.calibration.describe()}",
    ]
    if report.calibration.model == "contention":
        state = "converged" if report.converged else "NOT converged"
        lines.append(f"contention fixed point {state} after {report.iterations} simulations")
    lines += _comparison_lines(report.in_sample)
    lines += _comparison_lines(report.cross_validated)
    lines.append(
        f"transports measured {report.transports_measured}, predicted "
        f"{report.transports_predicted}; per request: same transport {routes.transport}/"
        f"{routes.requests}, same prefill worker {routes.prefill_worker}/"
        f"{routes.compared_workers}, same decode worker {routes.decode_worker}/"
        f"{routes.compared_workers}"
    )
    verdict = "within" if report.within_target else "NOT within"
    lines.append(
        f"TTFT p50 error {verdict} the {TARGET_ERROR:.0%} target "
        f"({report.in_sample.label.replace('_', '-')})"
    )
    return "\n".join(lines)
