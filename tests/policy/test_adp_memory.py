"""Adaptive Decoder Pool policy: the rules that weigh decode KV memory (policy/adp/memory):
the KV projection (a conversion only if the decode KV in use, scaled by the prefill pool's
growth, fits the decode workers left open; rechecked for a fenced worker) and the
decode-bound return (in a rush, requests waiting while prefill idles for want of decode KV
room turn converted workers back)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from topkv.policy.adp.memory import decode_bound, kv_fits, kv_known, kv_runs_out
from topkv.policy.adp.pool import AdaptiveDecoderPool, ADPConfig, WorkerView, plan_conversions
from topkv.policy.clock import ManualClock
from topkv.policy.errors import PolicyInputError


def _pool(used: float, converted: int = 0, fenced: bool = False) -> list[WorkerView]:
    """The simulator's shape: 4 prefill + 4 decode workers, each decode worker holding
    ``used`` of a KV capacity of 1.0 (256 slots, few in use, so the slot rule never binds);
    the first ``converted`` decode workers serve prefill, idle; ``fenced``: the next one is
    fenced (drained, its KV acknowledged)."""
    out = [WorkerView(f"prefill{i}", "prefill", "prefill", 0, 0) for i in range(4)]
    for i in range(4):
        conv = i < converted
        out.append(
            WorkerView(
                f"decode{i}",
                "decode",
                "prefill" if conv else "decode",
                0 if conv else 10,
                256,
                fenced=fenced and i == converted,
                kv_used=0.0 if conv else used,
                kv_capacity=1.0,
            )
        )
    return out


def test_kv_unknown_leaves_the_slot_rules_alone() -> None:
    workers = [replace(w, kv_used=0.0, kv_capacity=0.0) for w in _pool(0.9)]
    assert not kv_known(workers)
    assert kv_fits(workers, 10.0, 4)
    plan = plan_conversions(workers, in_rush=True, pressure=True)
    assert plan.to_prefill == ("decode0",)


def test_projection_scales_the_kv_in_use_by_the_prefill_growth() -> None:
    # 4 decode workers at 0.55 hold 2.2; one converted leaves 3.0 open for 2.2 * 5/4 = 2.75
    assert kv_fits(_pool(0.55), 1.0, 1)
    # at 0.62: 2.48 * 5/4 = 3.1 > 3.0, though 2.48 alone would fit what is left
    assert not kv_fits(_pool(0.62), 1.0, 1)
    assert kv_fits(_pool(0.62), 1.0, 0)


def test_a_conversion_whose_projected_kv_does_not_fit_is_refused() -> None:
    assert plan_conversions(_pool(0.55), in_rush=True, pressure=True).to_prefill == ("decode0",)
    plan = plan_conversions(_pool(0.62), in_rush=True, pressure=True)
    assert plan.empty
    assert "projected decode KV would not fit" in plan.rationale
    # the second conversion: 3 open at 0.6 hold 1.8; two left, 1.8 * 6/5 = 2.16 > 2
    assert plan_conversions(_pool(0.6, converted=1), in_rush=True, pressure=True).empty
    assert plan_conversions(_pool(0.5, converted=1), in_rush=True, pressure=True).to_prefill == (
        "decode1",
    )


def test_each_chosen_worker_is_charged_its_capacity() -> None:
    # 4 at 0.3 hold 1.2: one converted, 1.2 * 5/4 = 1.5 <= 3; two, 1.2 * 6/4 = 1.8 <= 2;
    # three would be over the cap anyway, so at 0.45 (1.8): one fits (2.25 <= 3), two not
    # (2.7 > 2)
    cfg = ADPConfig(convert_step=2)
    assert plan_conversions(_pool(0.3), True, True, cfg).to_prefill == ("decode0", "decode1")
    assert plan_conversions(_pool(0.45), True, True, cfg).to_prefill == ("decode0",)


def test_a_fenced_worker_is_checked_again_and_reopened_if_it_no_longer_fits() -> None:
    # decode0 fenced (its capacity already out of the open pool, its KV still counted): 4
    # at 0.3 hold 1.2 -> 1.2 * 5/4 = 1.5 <= 3 open: it converts
    ok = plan_conversions(_pool(0.3, fenced=True), in_rush=True, pressure=False)
    assert ok.to_prefill == ("decode0",) and ok.unfence == ()
    # the load grew while it drained: 4 at 0.7 hold 2.8 -> 3.5 > 3: opened again instead
    grown = plan_conversions(_pool(0.7, fenced=True), in_rush=True, pressure=False)
    assert grown.to_prefill == () and grown.unfence == ("decode0",)


def test_decode_bound_turns_an_idle_converted_worker_back() -> None:
    workers = _pool(0.99, converted=2)
    plan = plan_conversions(workers, in_rush=True, pressure=True, decode_blocked=True)
    assert plan.to_decode == ("decode0",) and plan.to_prefill == () and plan.fence == ()
    assert "decode-bound" in plan.rationale
    # without the signal the rush holds them
    assert plan_conversions(workers, in_rush=True, pressure=True).to_decode == ()
    # rate-limited like any conversion
    held = plan_conversions(
        workers, in_rush=True, pressure=True, may_convert=False, decode_blocked=True
    )
    assert held.to_decode == ()


def test_decode_bound_never_turns_back_a_busy_worker_and_opens_fenced_ones() -> None:
    workers = _pool(0.99, converted=2)
    busy = [replace(w, prefilling=True) if w.worker_id == "decode0" else w for w in workers]
    busy = [replace(w, unacked_kv=1) if w.worker_id == "decode1" else w for w in busy]
    assert decode_bound([w for w in busy if w.converted]) is None
    plan = plan_conversions(busy, in_rush=True, pressure=True, decode_blocked=True)
    assert plan.to_decode == () and plan.to_prefill == ()
    fenced = plan_conversions(
        _pool(0.99, converted=1, fenced=True), True, True, decode_blocked=True
    )
    assert fenced.unfence == ("decode1",) and fenced.fence == ()
    # fewest resident sequences first
    two = [replace(w, active_decode=5) if w.worker_id == "decode0" else w for w in workers]
    assert plan_conversions(two, True, True, decode_blocked=True).to_decode == ("decode1",)


def test_the_pool_rate_limits_returns_in_a_rush() -> None:
    clock = ManualClock()
    pool = AdaptiveDecoderPool(clock, ADPConfig())
    pool.detector.in_rush = True  # a rush in progress (the detector is tested elsewhere)
    pool.detector.periods.append((0.0, None))
    workers = _pool(0.99, converted=2)
    assert pool.update(50, workers, decode_blocked=True).to_decode == ("decode0",)
    clock.advance(1.0)
    left = [w for w in workers if w.worker_id != "decode0"]
    assert pool.update(50, left, decode_blocked=True).to_decode == ()
    clock.advance(4.0)
    assert pool.update(50, left, decode_blocked=True).to_decode == ("decode1",)


def test_projected_return_turns_a_worker_back_before_requests_block() -> None:
    # 2 converted, 2 decode workers at 0.8 hold 1.6 of 2.0 open: fits now, not blocked
    workers = _pool(0.8, converted=2)
    assert not kv_runs_out(workers, 0.0)
    assert plan_conversions(workers, in_rush=True, pressure=True).to_decode == ()
    # growing 0.5 over one conversion: 2.1 > 2.0, so one goes back now
    assert kv_runs_out(workers, 0.5)
    plan = plan_conversions(workers, in_rush=True, pressure=True, kv_growth=0.5)
    assert plan.to_decode == ("decode0",) and plan.to_prefill == ()
    assert "projected decode KV exceeds" in plan.rationale
    # a shrinking pool counts as no growth; nothing converted: nothing to return
    assert not kv_runs_out(workers, -5.0)
    assert not kv_runs_out(_pool(0.99), 10.0)
    # the caller reports no KV: the rule is off
    unknown = [replace(w, kv_used=0.0, kv_capacity=0.0) for w in workers]
    assert not kv_runs_out(unknown, 10.0)


def test_the_projection_counts_the_growth_before_converting() -> None:
    # 4 at 0.4 hold 1.6 -> 1.6 * 5/4 = 2.0 <= 3 converts; growing 1.0 over a conversion:
    # 2.6 * 5/4 = 3.25 > 3, refused
    assert plan_conversions(_pool(0.4), True, True).to_prefill == ("decode0",)
    assert not kv_fits(_pool(0.4), 1.0, 1, growth=1.0)
    assert plan_conversions(_pool(0.4), True, True, kv_growth=1.0).empty


def test_the_pool_measures_the_kv_slope_over_the_queue_window() -> None:
    clock = ManualClock()
    pool = AdaptiveDecoderPool(clock, ADPConfig(queue_window_s=10.0), conversion_s=10.0)
    assert pool.kv_growth(_pool(0.2)) == 0.0  # one sample: no slope yet
    clock.advance(5.0)
    # 4 workers from 0.2 to 0.3: +0.4 in 5 s, 0.08/s, times 10 s
    assert abs(pool.kv_growth(_pool(0.3)) - 0.8) < 1e-9
    clock.advance(10.0)  # the first sample falls out of the window: 0.3 -> 0.3
    assert abs(pool.kv_growth(_pool(0.3))) < 1e-9
    with pytest.raises(PolicyInputError, match="conversion_s"):
        AdaptiveDecoderPool(clock, conversion_s=float("nan"))


def test_the_growth_follows_the_kv_holding_time_when_releases_are_reported() -> None:
    clock = ManualClock()
    pool = AdaptiveDecoderPool(clock, ADPConfig(queue_window_s=10.0), conversion_s=10.0)

    def pool_at(used: float, released: float) -> list[WorkerView]:
        return [replace(w, kv_released=released) for w in _pool(used)]

    pool.kv_growth(pool_at(0.2, 0.0))
    clock.advance(5.0)
    # 4 workers: KV 0.8 -> 1.2 (+0.08/s), 1.0 freed in 5 s (0.2/s): held tau = 1.2/0.2 = 6 s,
    # so it tends to 1.2 + 6 * 0.08 and covers 1 - exp(-10/6) of that rise in 10 s
    want = 0.08 * 6.0 * (1.0 - math.exp(-10.0 / 6.0))
    got = pool.kv_growth(pool_at(0.3, 0.25))
    assert abs(got - want) < 1e-9
    assert got < 0.08 * 10.0  # less than the straight line: the pool nears its balance
