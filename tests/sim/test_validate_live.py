"""The simulator against the live demo (issue #7 item 7b) and its calibration pieces."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from topkv.cli.main import _typer_app
from topkv.harness.validate_live import TARGET_ERROR, calibration_from, validate_against_demo
from topkv.harness.validate_model import (
    Calibration,
    ContentionFit,
    Overlap,
    PrefillFit,
    calibrate,
    measured_dispatch_ms,
    measured_timeline,
    overlaps,
)
from topkv.harness.validate_predict import (
    ValidationOptions,
    demo_cluster_spec,
    demo_model_spec,
    predict,
    rebuild_requests,
    requests_for,
    simulate_demo,
)
from topkv.harness.validate_record import DemoRecord, LiveValidationError
from topkv.jsonout import loads_strict
from topkv.planner.pipeline import simulate_pipeline
from topkv.traces import Request

#: Real `topkv demo --requests 50 --json` runs of the current demo (relay orchestrator) on
#: the 2-core dev host; see data/README.md for when and under which load.
DATA = Path(__file__).resolve().parent / "data"
RECORD = DATA / "demo_record_50.json"
RECORD_RUN2 = DATA / "demo_record_50_run2.json"
#: A third run while other jobs loaded the host (load average 3.5 -> 6.6).
RECORD_LOADED = DATA / "demo_record_50_loaded.json"
#: Bound for the p50 error of run 2 calibrated on run 1 (measured: +12.8%).
CROSS_RUN_BOUND = 0.2
#: Bound for the cross-validated p50 error (calibrated on even ids, TTFT on odd ids;
#: measured -7.1% / +1.0% / -3.2% on the three records).
CROSS_VALIDATED_BOUND = 0.15
#: The issue #6 keys: what an older `topkv demo --json` printed per request.
PLAIN_KEYS = ("id", "transport", "bytes", "prefill_ms", "transfer_ms", "exposed_ms",
              "modelled_exposed_ms", "ttft_ms", "tokens_identical", "emulated")  # fmt: skip


def _record_json(path: Path = RECORD) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _plain(data: dict[str, Any]) -> dict[str, Any]:
    return {"requests": [{k: r[k] for k in PLAIN_KEYS} for r in data["requests"]],
            "summary": data["summary"]}  # fmt: skip


# -- against the recorded live runs --------------------------------------------------------


@pytest.fixture(scope="module")
def report() -> Any:
    return validate_against_demo(DemoRecord.load(RECORD))


def test_ttft_p50_predicted_within_target(report: Any) -> None:
    assert report.requests == 50
    assert report.in_sample.label == "in_sample"
    assert abs(report.in_sample.p50_error) <= TARGET_ERROR  # measured -9.1%
    assert report.within_target


@pytest.mark.parametrize("path", [RECORD, RECORD_RUN2, RECORD_LOADED])
def test_cross_validated_p50_within_bound(path: Path) -> None:
    result = validate_against_demo(DemoRecord.load(path))
    assert result.cross_validated.requests == 25
    assert abs(result.cross_validated.p50_error) <= CROSS_VALIDATED_BOUND


def test_prediction_tracks_each_request(report: Any) -> None:
    """Not just the median: requests predicted slow are the ones measured slow."""
    rows = _record_json()["requests"]
    measured = np.array([r["ttft_ms"] for r in rows])
    predicted = np.array([report.predicted_ttft_ms[r["id"]] for r in rows])
    ranks = [np.argsort(np.argsort(v)) for v in (measured, predicted)]
    assert np.corrcoef(*ranks)[0, 1] > 0.6  # Spearman rank correlation (measured: 0.78)
    assert report.in_sample.rank_correlation == pytest.approx(np.corrcoef(*ranks)[0, 1], abs=0.01)


def test_error_splits_into_queueing_and_service(report: Any) -> None:
    """Mean TTFT error = mean queueing error + mean service error; parts are measured."""
    c = report.in_sample
    assert c.queue is not None and c.service is not None
    total = c.predicted_mean_ms - c.measured_mean_ms
    assert total == pytest.approx(c.queue.mean_error_ms + c.service.mean_error_ms, abs=1e-6)
    rows = _record_json()["requests"]
    assert c.queue.measured_mean_ms == pytest.approx(np.mean([r["queue_ms"] for r in rows]))
    service = [r["ttft_ms"] - r["queue_ms"] for r in rows]
    assert c.service.measured_p50_ms == pytest.approx(np.percentile(service, 50))


def test_routes_agree_request_by_request(report: Any) -> None:
    """Same prefill worker (the demo's lowest-free-worker rule), same decode worker."""
    routes = report.routes
    assert routes.requests == routes.compared_workers == 50
    assert routes.prefill_worker >= 35  # measured 40/50
    assert routes.decode_worker >= 35  # measured 42/50
    assert routes.transport >= 45  # measured 48/50 (the 2 RDMA requests predicted NVLink)
    assert report.transports_measured == {"nvlink": 48, "rdma": 2}


def test_calibrated_on_another_run() -> None:
    """Calibration from one live run predicts a second run of the same requests; the
    host's load differs between runs, so the bound is wider than in-sample."""
    options = calibration_from(DemoRecord.load(RECORD), ValidationOptions())
    result = validate_against_demo(DemoRecord.load(RECORD_RUN2), options)
    assert result.in_sample.label == "cross_run"
    assert abs(result.in_sample.p50_error) <= CROSS_RUN_BOUND


def test_a_loaded_run_is_not_predicted_by_a_quiet_one() -> None:
    """Outside load is no input of the model: calibrated on a quiet run, the loaded run's
    TTFT is badly underestimated (measured -60%), while its own calibration is close."""
    loaded = DemoRecord.load(RECORD_LOADED)
    quiet = calibration_from(DemoRecord.load(RECORD), ValidationOptions())
    assert validate_against_demo(loaded, quiet).in_sample.p50_error < -0.4
    assert abs(validate_against_demo(loaded).in_sample.p50_error) <= TARGET_ERROR


def test_contention_model_improves_the_tail_of_a_quiet_run() -> None:
    record = DemoRecord.load(RECORD)
    contention = validate_against_demo(record, ValidationOptions(prefill_model="contention"))
    quadratic = validate_against_demo(record)
    assert contention.converged and contention.calibration.model == "contention"
    assert abs(contention.in_sample.p90_error) < abs(quadratic.in_sample.p90_error)
    assert abs(contention.in_sample.p90_error) <= TARGET_ERROR  # measured -2.5%
    assert abs(contention.in_sample.p50_error) <= TARGET_ERROR  # measured -6.5%


def test_record_requests_used_directly_match_the_rebuilt_ones() -> None:
    """The record's arrival_ms/prompt_len are the requests the trace rebuild gives."""
    record = DemoRecord.load(RECORD)
    assert record.has_requests and record.has_timeline
    direct = requests_for(record)
    rebuilt = rebuild_requests(DemoRecord.from_json(_plain(_record_json())), ValidationOptions())
    assert [(r.rid, r.input_tokens, r.output_tokens) for r in direct] == [
        (r.rid, r.input_tokens, r.output_tokens) for r in rebuilt
    ]
    for a, b in zip(direct, rebuilt, strict=True):
        assert a.arrival_s == pytest.approx(b.arrival_s, abs=1e-5)


def test_plain_demo_json_without_extra_fields(tmp_path: Path) -> None:
    """Issue #6's keys only (no arrivals, lengths, decode_ms, options): requests are
    rebuilt from the trace and the defaults used; the contention model says what it needs."""
    path = tmp_path / "plain.json"
    path.write_text(json.dumps(_plain(_record_json())))
    record = DemoRecord.load(path)
    assert not record.has_requests
    result = validate_against_demo(record)
    assert result.calibration.overhead_ms == 0.0 and result.in_sample.queue is None
    assert abs(result.in_sample.p50_error) <= 0.15  # measured -11.7%
    with pytest.raises(LiveValidationError, match="needs arrival_ms"):
        validate_against_demo(record, ValidationOptions(prefill_model="contention"))


def test_other_demo_settings_are_refused() -> None:
    """A record whose bytes disagree with its (or the rebuilt) prompt length is refused."""
    data = _record_json()
    data["requests"][3]["bytes"] += 12288  # one token more than the request has
    with pytest.raises(LiveValidationError, match="request 3 carries"):
        requests_for(DemoRecord.from_json(data))
    with pytest.raises(LiveValidationError, match="request 3 carries"):
        rebuild_requests(DemoRecord.from_json(_plain(data)), ValidationOptions())
    requests = requests_for(DemoRecord.load(RECORD))
    assert [r.output_tokens for r in requests] == [8] * 50
    assert requests[0].arrival_s == 0.0


def test_cli_json(tmp_path: Path) -> None:
    result = CliRunner().invoke(_typer_app, ["sim-validate", "--demo-json", str(RECORD), "--json"])
    assert result.exit_code == 0, result.output
    out = loads_strict(result.output)
    assert out["within_target"] is True
    assert {"requests", "ttft_p50_ms", "ttft_p90_ms", "p50_error", "p90_error", "queue",
            "service"} <= set(out["in_sample"])  # fmt: skip
    assert out["transports"]["measured"] == {"nvlink": 48, "rdma": 2}
    assert out["routes"]["same_prefill_worker"] == out["routes"]["workers_compared"] - 10


def test_cli_cross_run_with_contention() -> None:
    args = ["sim-validate", "--demo-json", str(RECORD_RUN2), "--calibrate-from", str(RECORD),
            "--prefill-model", "contention"]  # fmt: skip
    result = CliRunner().invoke(_typer_app, args)
    assert "cross-run" in result.output and "contention" in result.output
    assert result.exit_code == 1  # measured +16%: beyond the target, said so
    assert "NOT within the 10% target" in result.output


def test_cli_bad_record_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"requests": [{"id": 0}], "summary": {"emulation": {"dilation": 3000}}}')
    result = CliRunner().invoke(_typer_app, ["sim-validate", "--demo-json", str(path)])
    assert result.exit_code != 0
    assert isinstance(result.exception, LiveValidationError)
    assert "requests[0]: bytes must be a number" in str(result.exception)


def test_cli_unknown_prefill_model() -> None:
    args = ["sim-validate", "--demo-json", str(RECORD), "--prefill-model", "gpu"]
    result = CliRunner().invoke(_typer_app, args)
    assert isinstance(result.exception, LiveValidationError)
    assert "unknown prefill model 'gpu'" in str(result.exception)


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        ("[]", "expected topkv demo --json output"),
        ('{"requests": [], "summary": {}}', "no summary.emulation.dilation"),
        ('{"requests": [], "summary": {"emulation": {"dilation": 0.5}}}', "dilation must be"),
        ('{"requests": [], "summary": {"emulation": {"dilation": 3000}}}', "no requests"),
        ("{not json", "not JSON"),
        ('{"requests": [{"id": 0, "bytes": 1, "prefill_ms": 1, "exposed_ms": 0, "ttft_ms": 2, '
         '"prompt_len": 1.5}], "summary": {"emulation": {"dilation": 3000}}}',
         "prompt_len must be a positive integer"),
        ('{"requests": [{"id": 0, "bytes": 1, "prefill_ms": 1, "exposed_ms": 0, "ttft_ms": 2, '
         '"arrival_ms": -1}], "summary": {"emulation": {"dilation": 3000}}}',
         "arrival_ms must be >= 0"),
        ('{"requests": [{"id": 0, "bytes": 1, "prefill_ms": 1, "exposed_ms": 0, "ttft_ms": 2, '
         '"prefill_worker": 3}], "summary": {"emulation": {"dilation": 3000}}}',
         "prefill_worker must be a string"),
    ],
)  # fmt: skip
def test_malformed_records(tmp_path: Path, payload: str, match: str) -> None:
    path = tmp_path / "r.json"
    path.write_text(payload)
    with pytest.raises(LiveValidationError, match=match):
        DemoRecord.load(path)


# -- the contention model ------------------------------------------------------------------


def test_overlaps_by_hand() -> None:
    prefills = {0: (0.0, 100.0), 1: (50.0, 150.0), 2: (300.0, 300.0)}
    decodes = {0: (100.0, 200.0), 1: (0.0, 25.0)}
    seen = overlaps(prefills, decodes)
    assert seen[0] == Overlap(prefills=0.5, decodes=0.25)
    assert seen[1] == Overlap(prefills=0.5, decodes=0.5)
    assert seen[2] == Overlap()  # zero length


def test_contention_fit_recovers_its_parameters() -> None:
    rng = np.random.default_rng(1)
    tokens = rng.integers(128, 1024, 40).tolist()
    seen = [Overlap(float(p), float(d)) for p, d in rng.uniform(0, 1.5, (40, 2))]
    truth = ContentionFit(5.0, 0.5, 0.3, 0.1)
    fit = ContentionFit.fit(
        tokens, seen, [truth.ms(s, o) for s, o in zip(tokens, seen, strict=True)]
    )
    assert fit.a_ms == pytest.approx(5.0, abs=1e-6)
    assert fit.k_prefill_ms_per_token == pytest.approx(0.3, rel=1e-6)
    assert fit.k_decode_ms_per_token == pytest.approx(0.1, rel=1e-6)
    assert fit.rms_ms < 1e-6 and fit.points == 40


def test_contention_fit_drops_a_negative_term() -> None:
    tokens = [100, 200, 300, 400, 500, 600]
    seen = [Overlap(0.0, d) for d in (0.0, 1.0, 0.0, 1.0, 0.0, 1.0)]
    measured = [
        0.5 * s - 20.0 * o.decodes for s, o in zip(tokens, seen, strict=True)
    ]  # decodes "help"
    fit = ContentionFit.fit(tokens, seen, measured)
    assert fit.k_decode_ms_per_token == 0.0 and fit.k_prefill_ms_per_token == 0.0
    with pytest.raises(LiveValidationError, match="need 4 and 2"):
        ContentionFit.fit([100, 100, 100, 100], [Overlap()] * 4, [1.0] * 4)


def test_measured_timeline_and_dispatch() -> None:
    record = DemoRecord.load(RECORD)
    spans, decodes = measured_timeline(record)
    first = _record_json()["requests"][0]
    start = first["arrival_ms"] + first["queue_ms"]
    assert spans[0] == pytest.approx((start, start + first["prefill_ms"]))
    assert decodes[0][0] == pytest.approx(first["arrival_ms"] + first["ttft_ms"])
    assert 0.5 < measured_dispatch_ms(record) < 10.0  # measured 2.5 ms


def test_contention_fixed_point_slows_overlapping_prefills() -> None:
    """Two prompts at once on an idle cluster: each prefill runs alongside the other,
    so each takes a + s (b + k_p), and the fixed point finds it."""
    fit = ContentionFit(0.0, 0.5, 0.25, 0.0)
    requests = [Request(0, 0.0, 400, 2), Request(1, 0.0, 400, 2)]
    calibration = Calibration(fit, decode_step_ms=1.0)
    prediction = predict(requests, calibration, 3000.0)
    assert prediction.converged
    assert prediction.prefill_ms[0] == pytest.approx(400 * 0.75, abs=1.0)
    assert prediction.prefill_worker == {0: "prefill0", 1: "prefill1"}
    assert prediction.decode_worker == {0: "decode0", 1: "decode1"}
    alone = predict(requests[:1], calibration, 3000.0)
    assert alone.prefill_ms[0] == pytest.approx(200.0)


def test_calibrate_on_a_subset() -> None:
    record = DemoRecord.load(RECORD)
    requests = requests_for(record)
    even = {i for i in range(50) if i % 2 == 0}
    part = calibrate(record, requests, even)
    assert part.points == 25 and part.prefill.points == 25
    assert part.prefill != calibrate(record, requests).prefill


# -- the calibration fit -------------------------------------------------------------------


def test_fit_recovers_a_quadratic() -> None:
    tokens = [128, 200, 300, 500, 700, 1024]
    fit = PrefillFit.fit(tokens, [20 + 0.5 * s + 1e-4 * s * s for s in tokens])
    assert fit.a_ms == pytest.approx(20, abs=1e-6)
    assert fit.b_ms_per_token == pytest.approx(0.5, rel=1e-6)
    assert fit.c_ms_per_token2 == pytest.approx(1e-4, rel=1e-6)
    assert fit.rms_ms < 1e-6 and fit.points == 6


def test_fit_falls_back_to_linear_when_the_quadratic_goes_negative() -> None:
    # the least-squares parabola through these points is about -100 ms at both ends
    tokens = [100, 150, 500, 850, 900]
    fit = PrefillFit.fit(tokens, [1.0, 1.0, 1000.0, 1.0, 1.0])
    assert fit.c_ms_per_token2 == 0.0
    assert all(fit.ms(s) > 0 for s in range(100, 911, 10))


def test_fit_ignores_unmeasured_points_and_needs_two_lengths() -> None:
    fit = PrefillFit.fit([100, 200, 300], [10.0, math.nan, 30.0])
    assert fit.points == 2 and fit.ms(200) == pytest.approx(20.0)
    with pytest.raises(LiveValidationError, match="distinct prompt length"):
        PrefillFit.fit([100, 100], [10.0, 12.0])


@settings(max_examples=40, deadline=None)
@given(
    a=st.floats(0, 100),
    b=st.floats(0.01, 2),
    c=st.floats(0, 1e-3),
    tokens=st.lists(st.integers(128, 1024), min_size=3, max_size=30, unique=True),
)
def test_fit_is_exact_on_noise_free_data(a: float, b: float, c: float, tokens: list[int]) -> None:
    fit = PrefillFit.fit(tokens, [a + b * s + c * s * s for s in tokens])
    for s in tokens:
        assert fit.ms(s) == pytest.approx(a + b * s + c * s * s, rel=1e-6, abs=1e-6)


# -- the demo's cluster in the simulator -----------------------------------------------------


def test_dilated_cluster() -> None:
    spec = demo_cluster_spec(3000)
    group = spec.node_groups[0]
    assert group.nvlink_gb_s == pytest.approx(0.15) and group.nic_gb_s == pytest.approx(25 / 3000)
    assert spec.setup_latency_s["rdma"] == pytest.approx(5e-6 * 3000)
    with pytest.raises(LiveValidationError):
        demo_cluster_spec(0.5)


def test_one_request_equals_the_pipeline_model() -> None:
    """Idle cluster: TTFT = the exact layer pipeline over the dilated NVLink (hand check)."""
    fit = PrefillFit(10.0, 0.5, 0.0)
    tokens, dilation = 400, 3000.0
    ttft, transport = simulate_demo([Request(0, 0.0, tokens, 8)], fit, dilation, 10.0)
    assert transport == {0: "nvlink"}
    layers = demo_model_spec().num_layers
    layer_bytes = tokens * 2 * 2 * 64 * 4  # K and V, 2 kv heads x 64, float32
    compute = fit.ms(tokens) * 1e-3 / layers
    expected = simulate_pipeline(
        [compute] * layers, [layer_bytes / (450e9 / dilation)] * layers, 1e-6 * dilation
    )
    assert ttft[0] * 1e-3 == pytest.approx(expected.last_byte_s, rel=1e-6)


def test_full_local_decoder_sends_the_next_request_over_rdma() -> None:
    """Decode slots as the demo's router: with 1 slot each, a request arriving at the free
    prefill0 while decode0 still decodes goes to node 1's decoder over emulated RDMA."""
    fit = PrefillFit(100.0, 0.0, 0.0)
    requests = [Request(0, 0.0, 256, 8), Request(1, 0.15, 256, 8), Request(2, 0.16, 256, 8)]
    options = ValidationOptions(decode_slots=1)
    prediction = predict(requests, Calibration(fit, 50.0), 3000.0, options)
    assert prediction.transport == {0: "nvlink", 1: "rdma", 2: "nvlink"}
    assert prediction.prefill_worker[1] == "prefill0"
    assert prediction.decode_worker[1] == "decode1"
    # the third waits for a free decode slot (decode0: 7 steps of 50 ms after its KV)
    assert prediction.queue_ms[2] > 250.0
    ttft, _ = simulate_demo(requests, fit, 3000.0, 50.0, options)
    assert ttft == prediction.ttft_ms
    with pytest.raises(LiveValidationError, match="decode slots"):
        simulate_demo(requests, fit, 3000.0, 50.0, ValidationOptions(decode_slots=0))
