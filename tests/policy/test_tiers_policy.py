"""KV tier policies: next use, demotion order, placement, disk admission, prefetch, EMA model."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from topkv.policy.clock import ManualClock
from topkv.policy.errors import PolicyInputError
from topkv.policy.tiers import (
    PAPER_TIERS,
    Resident,
    Running,
    TierModel,
    TierSpec,
    admit_to_disk,
    choose_victims,
    demotion_order,
    fastest_first,
    next_use_s,
    place,
    prefetch_order,
)

TIERS = list(PAPER_TIERS.values())


def test_paper_figures() -> None:
    cxl, nvme = PAPER_TIERS["cxl"], PAPER_TIERS["nvme"]
    assert (cxl.latency_s, cxl.bandwidth_gbps, cxl.capacity_bytes) == (150e-9, 64.0, 128e9)
    assert (nvme.latency_s, nvme.bandwidth_gbps) == (13e-6, 7.0)
    assert [t.name for t in fastest_first(reversed(TIERS))] == ["hbm", "dram", "cxl", "nvme"]


def test_next_use_by_progress_and_queue() -> None:
    # Two slots: r1 has 10 tokens left, r2 has 2; the queue is w1, w2, w3.
    got = next_use_s(
        [Running(1, 10), Running(2, 2)], [11, 12, 13], slots=2, step_s=0.01, tokens_per_request=5
    )
    assert got[1] == got[2] == 0.0
    assert got[11] == pytest.approx(0.02)  # r2's slot frees first
    assert got[12] == pytest.approx(0.07)  # then w1's (0.02 + 5 steps)
    assert got[13] == pytest.approx(0.10)  # then r1's


def test_demotion_is_not_plain_lru() -> None:
    needed = {1: 0.5, 2: 5.0, 3: 0.0}
    residents = [
        Resident(1, "hbm", 10, last_use_s=0.0),  # oldest use, but needed soon
        Resident(2, "hbm", 10, last_use_s=9.0),  # just arrived, far back in the queue
        Resident(3, "hbm", 10, last_use_s=1.0, pinned=True),
    ]
    assert [r.request_id for r in demotion_order(residents, needed)] == [2, 1]
    assert [r.request_id for r in choose_victims(residents, needed, 15, 0) or []] == [2, 1]
    assert choose_victims(residents, needed, 30, 0) is None  # the pinned one never moves
    assert choose_victims(residents, needed, 5, 5) == []


def test_place_fastest_with_room() -> None:
    free = {"hbm": 5, "dram": 100, "cxl": 100, "nvme": 1000}
    assert place(10, TIERS, free).name == "dram"  # type: ignore[union-attr]
    assert place(500, TIERS, free).name == "nvme"  # type: ignore[union-attr]
    assert place(500, TIERS, free, allow_disk=False) is None
    assert place(10, TIERS, free, skip=["dram"]).name == "cxl"  # type: ignore[union-attr]


def test_disk_admission_skips_soon_needed() -> None:
    model = TierModel(TIERS, ManualClock())
    nbytes = 7 * 10**9  # 1 s each way at 7 GB/s
    assert not admit_to_disk(1.0, nbytes, model, "nvme")
    assert admit_to_disk(10.0, nbytes, model, "nvme")


def test_prefetch_soonest_first_within_lookahead() -> None:
    model = TierModel(TIERS, ManualClock())
    demoted = [Resident(1, "cxl", 64 * 10**9), Resident(2, "cxl", 10), Resident(3, "nvme", 10)]
    needed = {1: 1.5, 2: 0.2, 3: 5.0}
    # 1 needs 1 s to come back from CXL: due at 1.5 s with a 0.6 s lookahead.
    assert [r.request_id for r in prefetch_order(demoted, needed, model, lookahead_s=0.6)] == [2, 1]
    assert [r.request_id for r in prefetch_order(demoted, needed, model, lookahead_s=0.2)] == [2]


def test_model_ema_tracks_measurements() -> None:
    clock = ManualClock()
    model = TierModel(TIERS, clock, alpha=0.5)
    assert model.reading("cxl", "read").source == "nominal"
    for _ in range(20):
        model.record("cxl", "read", 10**9, 0.1)  # 10 GB/s measured
    r = model.reading("cxl", "read")
    assert r.source == "measured" and r.samples == 20
    assert r.bandwidth_gbps == pytest.approx(10.0, rel=0.1)
    assert model.reading("cxl", "write").source == "nominal"  # directions are separate
    clock.advance(1e6)
    assert model.reading("cxl", "read").source == "nominal"  # stale: back to nominal
    with pytest.raises(PolicyInputError, match="no tier 'x'"):
        model.record("x", "read", 1, 1.0)
    with pytest.raises(PolicyInputError, match="bytes > 0"):
        model.record("cxl", "read", 0, 1.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity_bytes": -1},
        {"bandwidth_gbps": 0.0},
        {"bandwidth_gbps": float("nan")},
        {"latency_s": -1.0},
        {"kind": "tape"},
    ],
)
def test_bad_tier_spec(kwargs: dict[str, object]) -> None:
    base: dict[str, object] = {
        "name": "t",
        "kind": "host",
        "capacity_bytes": 1,
        "latency_s": 0.0,
        "bandwidth_gbps": 1.0,
    }
    with pytest.raises(PolicyInputError, match="tier 't'"):
        TierSpec(**{**base, **kwargs})  # type: ignore[arg-type]


@given(
    st.lists(st.integers(0, 50), max_size=6),
    st.lists(st.integers(100, 200), max_size=10, unique=True),
    st.integers(1, 4),
)
def test_next_use_invariants(left: list[int], waiting: list[int], slots: int) -> None:
    running = [Running(i, t) for i, t in enumerate(left)]
    got = next_use_s(running, waiting, slots=slots, step_s=0.01, tokens_per_request=8)
    assert all(got[r.request_id] == 0.0 for r in running)
    times = [got[w] for w in waiting]
    assert times == sorted(times)  # queue order is service order
    assert all(t >= 0 for t in times)


@given(
    st.lists(st.tuples(st.integers(1, 100), st.floats(0, 10), st.booleans()), max_size=12),
    st.integers(0, 500),
    st.integers(0, 100),
)
def test_victims_make_room_or_none(
    rows: list[tuple[int, float, bool]], need: int, free: int
) -> None:
    residents = [Resident(i, "hbm", n, pinned=p) for i, (n, _, p) in enumerate(rows)]
    needed = {i: when for i, (_, when, _) in enumerate(rows)}
    victims = choose_victims(residents, needed, need, free)
    movable = sum(r.nbytes for r in residents if not r.pinned)
    if victims is None:
        assert free + movable < need
    else:
        assert free + sum(v.nbytes for v in victims) >= need and not any(v.pinned for v in victims)
        # least soon needed go first
        chosen = [needed[v.request_id] for v in victims]
        assert chosen == sorted(chosen, reverse=True)


def test_model_latency_from_small_operations() -> None:
    model = TierModel(TIERS, ManualClock(), alpha=1.0)
    model.record("nvme", "read", 4096, 20e-6 + 4096 / 7e9)
    assert model.reading("nvme", "read").latency_s == pytest.approx(20e-6)
    assert model.reading("nvme", "read").bandwidth_gbps == 7.0  # small ops leave bandwidth
