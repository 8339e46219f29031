"""Compute models calibrated from a demo record: prefill fits and the decode step.

* :class:`PrefillFit`: prefill ``a + b s + c s^2`` ms for ``s`` prompt tokens;
* :class:`ContentionFit`: prefill on a shared CPU host, ``a + s (b + k_p o_p + k_d o_d)``
  ms, with :class:`Overlap` the other prefills and decodes running alongside;
* :class:`Calibration`: a prefill model, the decode step, the handoff overhead and the
  pickup latency, as :func:`calibrate` measures them on a :class:`DemoRecord`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from topkv.harness.validate_record import DemoRecord, LiveValidationError
from topkv.traces import Request

#: Decode time per token (ms) used when the record has no ``decode_ms``: measured, the
#: median ``decode_ms / (new_tokens - 1)`` of a 50-request run on the 2-core dev host.
DEFAULT_DECODE_STEP_MS = 16.2

PREFILL_MODELS = ("quadratic", "contention")


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
