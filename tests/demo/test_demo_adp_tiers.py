"""``topkv demo --adp`` (issue #15) and ``--device-kv-capacity`` (issue #16): the pool's
time scale, the JSON they add, and one live run with both, every request checked."""

from __future__ import annotations

import dataclasses
import math

import pytest
from demo_results import result
from test_demo_cli import KEYS, _run_demo

from topkv.demo.adp import (
    PairedRun,
    adp_json,
    demo_adp_config,
    pair_orders,
    pairs_json,
    pairs_text,
    ttft_p90_ms,
)
from topkv.demo.report import JSON_REQUEST_KEYS, TIER_REQUEST_KEYS, request_json
from topkv.demo.results import RequestResult
from topkv.demo.tiers import tiers_json
from topkv.jsonout import loads_strict
from topkv.policy.adp.pool import DEFAULT_ADP


def _result(rid: int, ttft_ms: float, **over: object) -> RequestResult:
    error = over.pop("error", None)
    base = result(rid, 128, 0.0, error=error)  # type: ignore[arg-type]
    return dataclasses.replace(base, ttft_ms=ttft_ms, **over)  # type: ignore[arg-type]


def test_the_pools_time_constants_follow_the_replay_speed() -> None:
    cfg = demo_adp_config(4.0)
    assert cfg.velocity_window_s == DEFAULT_ADP.velocity_window_s / 4 == 2.5
    assert cfg.baseline_window_s == 75.0 and cfg.queue_window_s == 2.5
    assert cfg.ttft_window_s == 15.0 and cfg.hold_s == 7.5 and cfg.convert_interval_s == 1.25
    # a rate grows: 5 more requests queued over the (shorter) window, as in trace time
    assert cfg.queue_growth_per_s * cfg.queue_window_s == pytest.approx(
        DEFAULT_ADP.queue_growth_per_s * DEFAULT_ADP.queue_window_s
    )
    # ratios and the SLO on real compute stay
    for name in ("velocity_spike_ratio", "ttft_target_s", "max_convert_share", "decode_reserve"):
        assert getattr(cfg, name) == getattr(DEFAULT_ADP, name)
    assert demo_adp_config(1.0) == DEFAULT_ADP


def test_adp_json_adds_the_p90_and_with_both_the_run_without() -> None:
    report: dict[str, object] = {"conversions": [], "rush_periods": [[1.0, 2.0]]}
    on = [_result(i, float(t)) for i, t in enumerate((100, 200, 300, 400, 500))]
    off = [_result(i, float(t) * 2) for i, t in enumerate((100, 200, 300, 400, 500))]
    failed = _result(9, math.nan, error="boom")
    assert ttft_p90_ms([*on, failed]) == pytest.approx(460.0)
    single = adp_json(report, on)
    assert single == {**report, "ttft_p90_ms": pytest.approx(460.0)}
    both = adp_json(report, on, off)
    assert both["without_adp"] == {"ttft_p90_ms": pytest.approx(920.0)}
    assert both["ttft_p90_lower_with_adp"] is True
    assert adp_json(report, off, on)["ttft_p90_lower_with_adp"] is False
    assert adp_json(report, [failed], on)["ttft_p90_lower_with_adp"] is False


def test_pairs_alternate_their_order_and_report_medians_by_order() -> None:
    assert pair_orders(1) == [(False, True)]
    assert pair_orders(3) == [(False, True), (True, False), (False, True)]

    def run(pair: int, adp: bool, ttft: float) -> PairedRun:
        results = [_result(i, ttft) for i in range(3)]
        report: dict[str, object] | None = None
        if adp:
            c = {"worker": "decode0", "from": "decode", "to": "prefill", "at_ms": 5.0,
                 "duration_ms": 12.0}  # fmt: skip
            report = {"conversions": [c], "rush_periods": [[1.0, 9.0]]}
        return PairedRun(pair, adp, results, report, 40.0, 1e6, (0.5, 2.5))

    # ABBA: the second run of each pair is 10% slower, whichever it is
    runs = [run(0, False, 1000), run(0, True, 1100), run(1, True, 900), run(1, False, 990)]
    out = pairs_json(runs)
    assert [p["order"] for p in out["pairs"]] == ["off-on", "on-off"]
    first = out["pairs"][0]["runs"]
    assert first[0] == {"adp": False, "ttft_p90_ms": 1000.0, "dilation": 40.0,
                        "kv_bytes_per_prefill_s": 1e6, "load": [0.5, 2.5]}  # fmt: skip
    assert first[1]["conversions"][0]["duration_ms"] == 12.0
    assert first[1]["rush_periods"] == [[1.0, 9.0]]
    assert out["by_order"] == {
        "off-on": {"off_ttft_p90_ms": 1000.0, "on_ttft_p90_ms": 1100.0},
        "on-off": {"off_ttft_p90_ms": 990.0, "on_ttft_p90_ms": 900.0},
    }
    assert out["median"] == {"off_ttft_p90_ms": 995.0, "on_ttft_p90_ms": 1000.0}
    assert out["median_lower_with_adp"] is False
    text = pairs_text(out)
    assert "pair 1 (on-off): on 900 ms, 1 conversion(s); off 990 ms" in text
    assert "median: off 995 ms, on 1000 ms" in text


def test_repeats_need_the_comparison() -> None:
    process, _stdout, stderr = _run_demo("--repeats", "2", "--adp", "on")
    assert process.returncode != 0
    assert "--repeats and --warmup-run compare the pool: give --adp both" in stderr


def test_tier_keys_only_on_requests_served_with_tiers() -> None:
    plain = _result(0, 10.0)
    assert list(request_json(plain)) == list(JSON_REQUEST_KEYS)
    tiered = _result(1, 10.0, tiers=["device", "host", "device"], promotion_ms=0.5,
                     exposed_promotion_ms=0.0)  # fmt: skip
    row = request_json(tiered)
    assert list(row) == [*JSON_REQUEST_KEYS, *TIER_REQUEST_KEYS]
    assert row["tiers"] == ["device", "host", "device"]
    kept = _result(2, 10.0, tiers=["device"], promotion_ms=0.0, exposed_promotion_ms=0.0)
    summary = tiers_json(1, [tiered, kept, _result(3, 1.0, error="x", tiers=["device"])])
    assert summary["device_capacity"] == 1
    assert summary["requests_demoted"] == 1
    assert summary["visited"] == {"device": 2, "host": 1}
    assert summary["promotion_ms"]["p50"] == pytest.approx(0.25)


def test_live_adp_and_tiers_keep_every_request_and_its_tokens() -> None:
    # a real burst of the packaged trace (its requests 3,571-3,590 arrive 4x faster than
    # the 20 before), K = 1 cache on each decode worker's device tier
    process, stdout, stderr = _run_demo(
        "--requests", "40", "--trace-start", "3551", "--speedup", "2", "--json",
        "--adp", "on", "--device-kv-capacity", "1", "--dilation", "100",
    )  # fmt: skip
    assert process.returncode == 0, stderr[-3000:]
    report = loads_strict(stdout)
    assert set(report) == {"requests", "summary", "options", "adp"}
    summary = report["summary"]
    assert summary["all_tokens_identical"] is True and summary["completed"] == 40
    for row in report["requests"]:
        assert set(row) == KEYS | set(TIER_REQUEST_KEYS)
        assert row["tiers"][0] == "device" and row["tiers"][-1] == "device"
        assert row["promotion_ms"] >= 0 and row["exposed_promotion_ms"] >= 0
        if row["tiers"] == ["device"]:  # never demoted: nothing to promote, nothing waited
            assert row["promotion_ms"] == row["exposed_promotion_ms"] == 0
    kv = summary["kv_tiers"]
    assert kv["device_capacity"] == 1 and kv["visited"]["device"] == 40
    adp = report["adp"]
    assert {"conversions", "rush_periods", "ttft_p90_ms", "failed_conversions"} <= set(adp)
    for c in adp["conversions"]:
        assert set(c) == {"worker", "from", "to", "at_ms", "duration_ms"}
        assert c["worker"].startswith("decode") and {c["from"], c["to"]} == {"decode", "prefill"}
        assert c["duration_ms"] >= 0
    for start, end in adp["rush_periods"]:
        assert 0 <= start <= end
