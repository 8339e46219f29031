"""Adaptive Decoder Pool policy: velocity EMA, 2-of-3 rush detection, hysteresis, plans."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from topkv.policy.adp.pool import (
    AdaptiveDecoderPool,
    ADPConfig,
    RushDetector,
    TokenVelocity,
    WorkerView,
    convert_cap,
    p99,
    plan_conversions,
)
from topkv.policy.clock import ManualClock
from topkv.policy.errors import PolicyInputError

CFG = ADPConfig()


def _steady(det: RushDetector, clock: ManualClock, seconds: int, tokens: float = 1000.0) -> None:
    """``seconds`` of one request of ``tokens`` per second, a calm queue, fast first tokens."""
    for _ in range(seconds):
        clock.advance(1.0)
        det.observe_arrival(tokens)
        det.observe_ttft(0.1)
        det.update(queue_depth=0)


# -- token velocity ----------------------------------------------------------------------


def test_constant_rate_reads_as_that_rate_from_the_start() -> None:
    clock = ManualClock()
    v = TokenVelocity(clock, window_s=10.0)
    for _ in range(3):  # bias correction: no ramp from zero
        clock.advance(0.1)
        v.observe(50.0)
    # 50 tokens every 0.1 s = 500 tokens/s; after 0.3 s the estimate is already close
    assert v.rate() == pytest.approx(500.0, rel=0.2)
    for _ in range(2000):
        clock.advance(0.1)
        v.observe(50.0)
    assert v.rate() == pytest.approx(500.0, rel=0.01)


def test_velocity_decays_without_arrivals() -> None:
    clock = ManualClock()
    v = TokenVelocity(clock, window_s=10.0)
    for _ in range(200):
        clock.advance(1.0)
        v.observe(100.0)
    before = v.rate()
    clock.advance(10.0)
    assert v.rate() == pytest.approx(before * math.exp(-1.0), rel=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.0, 5.0), st.floats(0.0, 1e5)),
        min_size=1,
        max_size=60,
    ),
    st.floats(0.5, 100.0),
)
def test_velocity_is_bounded_by_the_tokens_seen(
    events: list[tuple[float, float]], window: float
) -> None:
    """Invariants: never negative; never more than all tokens seen over the elapsed time
    corrected for warm-up (an EMA is a weighted average of the arrivals)."""
    clock = ManualClock()
    v = TokenVelocity(clock, window_s=window)
    seen = 0.0
    for dt, tokens in events:
        clock.advance(dt)
        v.observe(tokens)
        seen += tokens
        rate = v.rate()
        assert rate >= 0.0
        warm = 1.0 - math.exp(-clock.now() / window)
        if warm > 0:
            assert rate <= seen / window / warm * (1 + 1e-9) + 1e-9


def test_time_cannot_go_backwards() -> None:
    class Jumpy:
        t = 5.0

        def now(self) -> float:
            return self.t

    clock = Jumpy()
    v = TokenVelocity(clock, 1.0)
    v.observe(1.0)
    clock.t = 4.0
    with pytest.raises(PolicyInputError):
        v.observe(1.0)


# -- rush detection: 2 of 3 --------------------------------------------------------------


def test_one_signal_alone_is_not_a_rush() -> None:
    for which in ("queue", "velocity", "ttft"):
        clock = ManualClock()
        det = RushDetector(clock)
        _steady(det, clock, 400)
        depth = 0
        for _ in range(60):
            clock.advance(1.0)
            det.observe_arrival(4000.0 if which == "velocity" else 1000.0)
            det.observe_ttft(5.0 if which == "ttft" else 0.1)
            if which == "queue":
                depth += 2
            s = det.update(queue_depth=depth)
            assert s.passing <= 1, (which, s)
            assert not det.in_rush, which
        # and the one signal did pass, so the test can fail
        last = det.last
        assert last is not None
        assert {"queue": last.queue_high, "velocity": last.velocity_high, "ttft": last.ttft_high}[
            which
        ]


@pytest.mark.parametrize("pair", [("queue", "velocity"), ("queue", "ttft"), ("velocity", "ttft")])
def test_two_signals_start_a_rush(pair: tuple[str, str]) -> None:
    clock = ManualClock()
    det = RushDetector(clock)
    _steady(det, clock, 400)
    assert not det.in_rush
    depth = 0
    started_at = None
    for _ in range(30):
        clock.advance(1.0)
        det.observe_arrival(4000.0 if "velocity" in pair else 1000.0)
        det.observe_ttft(5.0 if "ttft" in pair else 0.1)
        if "queue" in pair:
            depth += 2
        det.update(queue_depth=depth)
        if det.in_rush and started_at is None:
            started_at = clock.now()
    assert det.in_rush, pair
    assert started_at is not None and started_at - 400 <= 15  # within seconds
    assert det.periods == [(started_at, None)]


def test_signal_thresholds_are_read_from_the_config() -> None:
    clock = ManualClock()
    det = RushDetector(clock, ADPConfig(queue_growth_per_s=5.0, ttft_target_s=10.0))
    _steady(det, clock, 100)
    depth = 0
    for _ in range(30):
        clock.advance(1.0)
        det.observe_arrival(1000.0)
        det.observe_ttft(5.0)  # under a 10 s target
        depth += 2  # 2/s, under a 5/s threshold
        det.update(queue_depth=depth)
    assert not det.in_rush


# -- hysteresis --------------------------------------------------------------------------


def _rush_then_flicker(cfg: ADPConfig) -> tuple[RushDetector, ManualClock, list[bool]]:
    clock = ManualClock()
    det = RushDetector(clock, cfg)
    _steady(det, clock, 400)
    depth = 0
    for _ in range(20):  # queue + TTFT: a rush
        clock.advance(1.0)
        det.observe_arrival(1000.0)
        det.observe_ttft(5.0)
        depth += 3
        det.update(queue_depth=depth)
    assert det.in_rush
    states = []
    # then one signal flickers on every 10 s for a while: never calm for the hold time
    for k in range(120):
        clock.advance(1.0)
        det.observe_arrival(1000.0)
        det.observe_ttft(0.1)
        depth = depth + 10 if k % 10 == 0 else depth
        det.update(queue_depth=depth)
        states.append(det.in_rush)
    return det, clock, states


def test_hysteresis_no_flapping_while_any_signal_recurs() -> None:
    # TTFT p99 stays high for its 60 s window after the slow first tokens stop, so the
    # rush lasts at least that long plus the flicker; it must not end mid-flicker.
    det, _clock, states = _rush_then_flicker(ADPConfig(ttft_window_s=5.0))
    assert all(states), "the rush ended while a signal kept passing"
    assert len(det.periods) == 1


def test_rush_ends_after_the_hold_time_calm_and_only_then() -> None:
    cfg = ADPConfig(ttft_window_s=5.0, hold_s=30.0)
    det, clock, _ = _rush_then_flicker(cfg)
    depth = 10_000  # held level: no growth from here on
    ended_at = None
    calm_from = None
    for _ in range(120):
        clock.advance(1.0)
        det.observe_arrival(500.0)  # demand halves
        det.observe_ttft(0.1)
        s = det.update(queue_depth=depth)
        calm = s.passing == 0 and s.velocity <= cfg.release_velocity_ratio * det.onset_velocity
        if calm and calm_from is None:
            calm_from = clock.now()
        if not det.in_rush and ended_at is None:
            ended_at = clock.now()
    assert calm_from is not None and ended_at is not None
    assert ended_at - calm_from == pytest.approx(cfg.hold_s)
    assert det.periods[-1] == (det.periods[-1][0], ended_at)
    assert not det.in_rush


def test_rush_lasts_while_the_demand_that_caused_it_does() -> None:
    """Converted workers calm the signals; with demand unchanged the rush must not end
    (or the pools would convert back into the same overload and flap)."""
    cfg = ADPConfig(ttft_window_s=5.0, hold_s=30.0)
    det, clock, _ = _rush_then_flicker(cfg)
    calm = 0
    for _ in range(300):
        clock.advance(1.0)
        det.observe_arrival(1000.0)  # the same demand as at the onset
        det.observe_ttft(0.1)
        calm += det.update(queue_depth=10_000).passing == 0
    assert calm >= 280  # the signals are calm (after the queue window) ...
    assert det.in_rush and len(det.periods) == 1  # ... and the rush goes on


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans()), max_size=200))
def test_detector_state_machine_invariants(flags: list[tuple[bool, bool, bool]]) -> None:
    """Over any signal sequence: a rush starts only at >= 2 passing signals, ends only
    after hold_s of none passing, and periods are ordered and closed except the last."""
    cfg = ADPConfig(hold_s=5.0, ttft_window_s=1.0, queue_window_s=1.0)
    clock = ManualClock()
    det = RushDetector(clock, cfg)
    _steady(det, clock, 400)
    depth = 0
    history: list[tuple[bool, int]] = []
    for queue, vel, ttft in flags:
        clock.advance(1.0)
        det.observe_arrival(20_000.0 if vel else 1000.0)
        det.observe_ttft(9.0 if ttft else 0.1)
        depth += 5 if queue else 0
        was = det.in_rush
        s = det.update(queue_depth=depth)
        if not was and det.in_rush:
            assert s.passing >= 2
        if was and not det.in_rush:
            calm = [p for _, p in history[-(int(cfg.hold_s)) :]]
            assert s.passing == 0 and all(p == 0 for p in calm)
        history.append((det.in_rush, s.passing))
    ends = [e for _, e in det.periods]
    assert all(e is not None for e in ends[:-1])
    starts = [st_ for st_, _ in det.periods]
    assert starts == sorted(starts)
    assert (ends[-1] is None) == det.in_rush if det.periods else not det.in_rush


def test_p99_matches_numpy() -> None:
    np = pytest.importorskip("numpy")
    values = [0.1 * k for k in range(37)] + [9.0]
    assert p99(values) == pytest.approx(float(np.percentile(values, 99)))


# -- conversion plan ---------------------------------------------------------------------


def _pool(n_decode: int, **over: dict[str, object]) -> list[WorkerView]:
    workers = [WorkerView(f"p{k}", "prefill", "prefill", 0, 0) for k in range(2)]
    for k in range(n_decode):
        fields = {"active_decode": 0, "unacked_kv": 0, "prefilling": False, "role": "decode"}
        fields.update(over.get(f"d{k}", {}))
        workers.append(
            WorkerView(
                f"d{k}",
                "decode",
                fields["role"],  # type: ignore[arg-type]
                int(fields["active_decode"]),  # type: ignore[call-overload]
                100,
                unacked_kv=int(fields["unacked_kv"]),  # type: ignore[call-overload]
                prefilling=bool(fields["prefilling"]),
            )
        )
    return workers


def _apply(workers: list[WorkerView], to_prefill: tuple[str, ...]) -> list[WorkerView]:
    return [
        WorkerView(w.worker_id, w.native, "prefill", w.active_decode, w.decode_slots)
        if w.worker_id in to_prefill
        else w
        for w in workers
    ]


@pytest.mark.parametrize(
    ("n", "share", "cap"), [(4, 0.5, 2), (8, 0.5, 4), (1, 1.0, 0), (3, 1.0, 2)]
)
def test_the_cap_is_respected(n: int, share: float, cap: int) -> None:
    cfg = ADPConfig(max_convert_share=share, convert_step=10)
    assert convert_cap(n, cfg) == cap
    workers = _pool(n)
    for _ in range(n + 2):  # keep asking, under pressure, every update
        plan = plan_conversions(workers, in_rush=True, pressure=True, config=cfg)
        workers = _apply(workers, plan.to_prefill)
        assert sum(w.converted for w in workers) <= cap
    assert sum(w.converted for w in workers) == cap
    assert any(w.role == "decode" for w in workers if w.native == "decode")


def test_one_step_per_update_idle_first_then_least_loaded() -> None:
    workers = _pool(4, d0={"active_decode": 20}, d1={"active_decode": 5}, d3={"active_decode": 1})
    plan = plan_conversions(workers, in_rush=True, pressure=True)
    assert plan.to_prefill == ("d2",)  # the idle one
    workers = _apply(workers, plan.to_prefill)
    plan = plan_conversions(workers, in_rush=True, pressure=True)
    assert plan.to_prefill == ("d3",)  # then the least loaded
    workers = _apply(workers, plan.to_prefill)
    assert plan_conversions(workers, in_rush=True, pressure=True).to_prefill == ()  # cap 2


def test_a_worker_with_unacknowledged_kv_is_never_converted() -> None:
    workers = _pool(4, d0={"unacked_kv": 1}, d1={"unacked_kv": 3}, d2={"unacked_kv": 1})
    cfg = ADPConfig(max_convert_share=1.0, convert_step=4)
    plan = plan_conversions(workers, in_rush=True, pressure=True, config=cfg)
    assert plan.to_prefill == ("d3",)
    assert plan.fence == ("d0", "d2")  # chosen, but first fenced: no new KV routed there
    busy = _pool(2, d0={"unacked_kv": 1}, d1={"unacked_kv": 2})
    plan = plan_conversions(busy, True, True, cfg)
    assert plan.to_prefill == () and plan.fence == ("d0",)
    # fenced, KV still in flight: still not converted, whatever the pressure
    fenced = [replace(w, fenced=True) if w.worker_id == "d0" else w for w in busy]
    again = plan_conversions(fenced, True, True, cfg)
    assert again.to_prefill == () and again.fence == ()
    # its KV acknowledged: converted now
    acked = [replace(w, unacked_kv=0) if w.worker_id == "d0" else w for w in fenced]
    assert plan_conversions(acked, True, False, cfg, may_convert=False).to_prefill == ("d0",)
    # the rush ends before that: the fence opens again
    assert plan_conversions(fenced, False, False, cfg).unfence == ("d0",)


def test_decode_beyond_the_chunked_prefill_reserve_is_fenced_until_drained() -> None:
    # 30% of 100 slots = 30 sequences may stay; 31 is too many
    workers = _pool(4, d0={"active_decode": 31}, d1={"active_decode": 30})
    cfg = ADPConfig(convert_step=4, max_convert_share=1.0)
    plan = plan_conversions(
        [w for w in workers if w.worker_id in ("p0", "d0", "d1", "d2")], True, True, cfg
    )
    assert "d0" not in plan.to_prefill and "d1" in plan.to_prefill
    # chosen beyond the reserve: fenced (no new sequences), converted once drained to it
    busy = _pool(2, d0={"active_decode": 35}, d1={"active_decode": 40})
    plan = plan_conversions(busy, True, True)
    assert plan.to_prefill == () and plan.fence == ("d0",)  # the least loaded, fenced
    fenced = [replace(w, fenced=True) if w.worker_id == "d0" else w for w in busy]
    assert plan_conversions(fenced, True, True).to_prefill == ()  # 35 > 30: still draining
    drained = [replace(w, active_decode=30) if w.worker_id == "d0" else w for w in fenced]
    assert plan_conversions(drained, True, False, may_convert=False).to_prefill == ("d0",)


def test_no_conversion_without_pressure_or_rate_limit() -> None:
    workers = _pool(4)
    assert plan_conversions(workers, in_rush=True, pressure=False).to_prefill == ()
    assert plan_conversions(workers, True, True, may_convert=False).to_prefill == ()
    assert plan_conversions(workers, in_rush=False, pressure=True).empty


def test_converting_back_drains_busy_workers_first() -> None:
    workers = _pool(
        4,
        d0={"role": "prefill", "prefilling": True},
        d1={"role": "prefill", "unacked_kv": 1},
        d2={"role": "prefill"},
    )
    plan = plan_conversions(workers, in_rush=False, pressure=False)
    assert plan.to_decode == ("d2",)
    assert plan.drain == ("d0", "d1")
    assert plan.to_prefill == ()


def test_pool_end_to_end_converts_in_a_rush_and_back_after() -> None:
    clock = ManualClock()
    adp = AdaptiveDecoderPool(clock, ADPConfig(ttft_window_s=5.0))
    workers = _pool(4)
    roles: list[int] = []

    def step(tokens: float, ttft: float, depth: int) -> None:
        nonlocal workers
        clock.advance(1.0)
        adp.observe_arrival(tokens)
        adp.observe_ttft(ttft)
        plan = adp.update(depth, workers)
        workers = [
            WorkerView(
                w.worker_id,
                w.native,
                "prefill"
                if w.worker_id in plan.to_prefill
                else ("decode" if w.worker_id in plan.to_decode else w.role),
                w.active_decode,
                w.decode_slots,
            )
            for w in workers
        ]
        roles.append(sum(w.converted for w in workers))

    for _ in range(400):
        step(1000.0, 0.1, 0)
    assert max(roles) == 0
    depth = 0
    for _ in range(60):
        depth += 3
        step(4000.0, 5.0, depth)
    assert adp.in_rush and roles[-1] == 2  # ramped to the cap, 5 s apart
    first = roles.index(1)
    assert roles.index(2) - first >= CFG.convert_interval_s
    for _ in range(200):
        step(1000.0, 0.1, 0)
    assert not adp.in_rush and roles[-1] == 0
    assert adp.conversions == 4  # two each way
    assert len(adp.rush_periods) == 1 and adp.rush_periods[0][1] is not None


@pytest.mark.parametrize(
    "bad",
    [
        {"velocity_window_s": 0.0},
        {"baseline_window_s": 1.0},
        {"min_signals": 4},
        {"max_convert_share": 1.5},
        {"decode_reserve": 1.0},
        {"chunk_tokens": 0},
        {"hold_s": -1.0},
    ],
)
def test_bad_config_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(PolicyInputError):
        ADPConfig(**bad)  # type: ignore[arg-type]


def test_chunks_and_reserve() -> None:
    assert CFG.chunk_tokens == 512 and CFG.decode_reserve == 0.3
    assert [CFG.chunks(n) for n in (1, 512, 513, 4096)] == [1, 1, 2, 8]
    assert CFG.reserved_slots(256) == 76


def test_a_decode_only_worker_counts_for_the_pool_but_is_never_chosen() -> None:
    prefill = [WorkerView(f"p{i}", "prefill", "prefill", 0, 0) for i in range(2)]
    # c0 is a plain decode-only instance (idle), b0/b1 may move (one busy past the reserve)
    c0 = WorkerView("c0", "decode", "decode", 0, 4, convertible=False)
    b0 = WorkerView("b0", "decode", "decode", 3, 4)
    b1 = WorkerView("b1", "decode", "decode", 1, 4)
    workers = [*prefill, c0, b0, b1]
    # the least loaded convertible one is chosen (b1), never the idle decode-only c0
    assert plan_conversions(workers, in_rush=True, pressure=True).to_prefill == ("b1",)
    # c0's 4 slots count as open decode: without them, converting b1 leaves 4 slots for 4
    # in use (no headroom), with them 8 for 4
    alone = plan_conversions([*prefill, b0, b1], in_rush=True, pressure=True)
    assert alone.to_prefill == () and "no decode headroom" in alone.rationale
    # the cap: half of 3 natives is 1, and never more than the convertible ones
    assert convert_cap(3, ADPConfig(), convertible=2) == 1
    assert convert_cap(4, ADPConfig(), convertible=1) == 1
    assert convert_cap(4, ADPConfig(), convertible=0) == 0
    only = [*prefill, c0, WorkerView("c1", "decode", "decode", 0, 4, convertible=False)]
    assert plan_conversions(only, in_rush=True, pressure=True).to_prefill == ()
