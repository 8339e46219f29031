"""Adaptive Decoder Pool policy: decode headroom. A decode worker is chosen for conversion only
if the decode workers left open keep more decode slots than the pool uses now."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from topkv.policy.adp.pool import (
    ADPConfig,
    WorkerView,
    decode_in_use,
    decode_slots_open,
    plan_conversions,
)


def _demo(slots: int, busy: bool = True) -> list[WorkerView]:
    """The demo's shape in a rush: 2 prefill + 2 decode workers of ``slots`` slots each; both
    prefill workers busy, each streaming a request's KV to a decode worker, and one
    sequence decoding (3 slots in use). ``busy`` False: nothing in use."""
    n = int(busy)
    return [
        WorkerView("prefill0", "prefill", "prefill", 0, 0, unacked_kv=n),
        WorkerView("prefill1", "prefill", "prefill", 0, 0, unacked_kv=n),
        WorkerView("decode0", "decode", "decode", n, slots, unacked_kv=n),
        WorkerView("decode1", "decode", "decode", 0, slots, unacked_kv=n),
    ]


def test_in_use_and_open_slots() -> None:
    workers = [
        *_demo(4),
        WorkerView("decode2", "decode", "prefill", 1, 4),  # converted: its own reserve
        WorkerView("decode3", "decode", "decode", 1, 4, fenced=True),
        WorkerView("decode4", "decode", "decode", 0, 4, healthy=False),
    ]
    assert decode_in_use(workers) == 2 + 1 + 1  # decode0, decode1, the fenced decode3
    assert decode_slots_open(workers) == 8  # decode0 and decode1 only


def test_two_slot_decode_workers_in_use_are_not_converted() -> None:
    """Two decode workers of 2 slots, 3 in use: one converted would leave 2 slots for 3."""
    plan = plan_conversions(_demo(2), in_rush=True, pressure=True)
    assert plan.to_prefill == () and plan.fence == ()
    assert "no decode headroom (3 decode slots in use, 4 open" in plan.rationale
    # as few in use as the busy prefill workers hold: 2 left for 2 is no gain either
    two = [replace(w, active_decode=0) for w in _demo(2)]
    assert decode_in_use(two) == 2
    assert plan_conversions(two, in_rush=True, pressure=True).empty


def test_the_same_load_on_four_slot_workers_converts_one() -> None:
    plan = plan_conversions(_demo(4), in_rush=True, pressure=True)
    # 8 slots open, 3 in use: one worker fewer leaves 4, one spare; the least loaded has
    # KV on its way, so it is fenced first
    assert plan.fence == ("decode1",) and plan.to_prefill == ()
    idle = plan_conversions(_demo(2, busy=False), in_rush=True, pressure=True)
    assert idle.to_prefill == ("decode0",)  # nothing in use: even 2 slots are headroom


def test_each_conversion_is_charged_its_slots() -> None:
    """Four 10-slot decode workers with 25 slots in use: one fewer leaves 30, two fewer 20."""
    workers = [
        WorkerView(f"d{i}", "decode", "decode", load, 10) for i, load in enumerate((0, 5, 10, 10))
    ]
    plan = plan_conversions(workers, True, True, ADPConfig(convert_step=2))
    assert plan.to_prefill == ("d0",) and plan.fence == ()
    # once d0 is fenced its slots are gone: a second conversion would leave 20 for 25
    fenced = [replace(w, fenced=True) if w.worker_id == "d0" else w for w in workers]
    again = plan_conversions(fenced, True, True, ADPConfig(convert_step=2))
    assert again.to_prefill == ("d0",) and again.fence == ()  # d0 is ready; nobody new
    # lighter load (9 in use): 20 left is enough; the cap leaves room for one more
    lighter = [replace(w, active_decode=2) if w.worker_id in ("d2", "d3") else w for w in fenced]
    plan = plan_conversions(lighter, True, True, ADPConfig(convert_step=2))
    assert plan.to_prefill == ("d0", "d2")


def test_a_worker_too_big_to_give_up_is_skipped_for_one_that_fits() -> None:
    workers = [
        WorkerView("big", "decode", "decode", 0, 20),
        WorkerView("small", "decode", "decode", 1, 4),
        WorkerView("busy", "decode", "decode", 25, 20),
    ]
    # 26 in use, 44 open: without "big" 24 are left (too few), without "small" 40
    plan = plan_conversions(workers, True, True, ADPConfig(max_convert_share=1.0))
    assert plan.to_prefill == ("small",)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 12), st.integers(0, 4), st.integers(1, 8), st.booleans()),
        min_size=1,
        max_size=6,
    ),
    st.integers(1, 4),
)
def test_chosen_workers_always_leave_the_slots_in_use(
    pool: list[tuple[int, int, int, bool]], step: int
) -> None:
    workers = [
        WorkerView(f"d{i}", "decode", "decode", active, slots, unacked_kv=unacked, fenced=fenced)
        for i, (active, unacked, slots, fenced) in enumerate(pool)
    ]
    cfg = ADPConfig(max_convert_share=1.0, convert_step=step)
    plan = plan_conversions(workers, True, True, cfg)
    already = {w.worker_id for w in workers if w.fenced}
    chosen = {*plan.fence, *plan.to_prefill} - already
    left = sum(w.decode_slots for w in workers if not w.fenced and w.worker_id not in chosen)
    if chosen:
        assert left > decode_in_use(workers)
