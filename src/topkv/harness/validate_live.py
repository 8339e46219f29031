"""Validate the simulator against the live demo (issue #7 item 7b): ``topkv sim-validate``.

The simulator, configured as the local cluster of ``topkv demo`` (#6), predicts the TTFT of
the very requests the demo served; this module compares the prediction with the demo's
measured TTFT (p50 and p90, queueing and service apart, the route request by request) and
reports it. :func:`validate_against_demo` calibrates on the run itself (in-sample and
cross-validated), :func:`calibration_from` on another run. The record is read by
:mod:`topkv.harness.validate_record`, the compute models are calibrated by
:mod:`topkv.harness.validate_model`, and :mod:`topkv.harness.validate_predict` simulates the
demo's cluster. Method and results: docs/simulator.md ("Validation against the live system").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from topkv.harness.validate_model import Calibration, PrefillModel, calibrate, resolve_model
from topkv.harness.validate_predict import Prediction, ValidationOptions, predict, requests_for
from topkv.harness.validate_record import DemoRecord, LiveValidationError

#: Tolerance the issue sets for the TTFT p50 prediction.
TARGET_ERROR = 0.10


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
