"""Prefix affinity (topkv.policy.prefix_affinity): block hashes, what an instance holds, and
the choice, on a manual clock."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from topkv.policy.clock import ManualClock
from topkv.policy.errors import PolicyInputError
from topkv.policy.prefix_affinity import (
    AffinityConfig,
    Candidate,
    PrefixAffinity,
    prefix_hashes,
)

tokens = st.lists(st.integers(0, 300), max_size=200)


@given(tokens, tokens, st.integers(1, 40))
def test_equal_hashes_mean_equal_prefixes(a: list[int], b: list[int], block: int) -> None:
    ha, hb = prefix_hashes(a, block), prefix_hashes(b, block)
    assert len(ha) == len(a) // block  # whole blocks only
    for i, (x, y) in enumerate(zip(ha, hb, strict=False)):
        assert (x == y) == (a[: (i + 1) * block] == b[: (i + 1) * block])


@given(tokens, tokens, st.integers(1, 16))
def test_matched_is_the_shared_whole_block_prefix(a: list[int], b: list[int], block: int) -> None:
    policy = PrefixAffinity(ManualClock(), AffinityConfig(block_units=block))
    policy.record("i0", prefix_hashes(a, block))
    shared = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    shared = min(len(a), len(b)) if shared is None else shared
    assert policy.matched("i0", prefix_hashes(b, block)) == shared // block
    assert policy.matched("other", prefix_hashes(b, block)) == 0


def test_blocks_expire_after_the_ttl_and_the_lru_bound_holds() -> None:
    clock = ManualClock()
    policy = PrefixAffinity(clock, AffinityConfig(block_units=2, ttl_s=10, capacity_blocks=3))
    hashes = prefix_hashes([1, 2, 3, 4, 5, 6], 2)
    policy.record("i0", hashes)
    clock.advance(9.9)
    assert policy.matched("i0", hashes) == 3
    clock.advance(0.2)
    assert policy.matched("i0", hashes) == 0  # the engine may have evicted them since
    policy.record("i0", hashes)
    policy.record("i0", prefix_hashes([9, 9], 2))  # a fourth block: the oldest goes
    assert policy.matched("i0", hashes) == 0
    assert policy.matched("i0", prefix_hashes([9, 9], 2)) == 1
    policy.forget("i0")
    assert policy.matched("i0", prefix_hashes([9, 9], 2)) == 0


def test_choose_prefers_the_longest_holder_within_the_load_gap() -> None:
    policy = PrefixAffinity(ManualClock(), AffinityConfig(block_units=1, max_load_gap=2))
    prompt = prefix_hashes([1, 2, 3, 4], 1)
    policy.record("short", prompt[:1])
    policy.record("long", prompt[:3])
    idle = [Candidate("short", 0), Candidate("long", 0), Candidate("cold", 0)]
    choice = policy.choose(idle, prompt)
    assert choice is not None and (choice.instance_id, choice.matched_blocks) == ("long", 3)
    busy = [Candidate("short", 0), Candidate("long", 3), Candidate("cold", 0)]
    choice = policy.choose(busy, prompt)  # "long" is 3 above the lowest load: past the gap
    assert choice is not None and choice.instance_id == "short"
    assert policy.choose([Candidate("cold", 0)], prompt) is None  # nobody holds any of it
    assert policy.choose(idle, ()) is None


@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 4)), min_size=1, max_size=6),
    st.floats(0, 5),
)
def test_the_choice_is_eligible_and_holds_the_most(
    instances: list[tuple[int, int]], gap: float
) -> None:
    """Whatever the loads and holdings: the chosen instance is within the gap of the least
    loaded, and no eligible instance holds more of the prompt."""
    policy = PrefixAffinity(ManualClock(), AffinityConfig(block_units=1, max_load_gap=gap))
    prompt = prefix_hashes([7, 8, 9, 10], 1)
    candidates = []
    for index, (load, held) in enumerate(instances):
        name = f"i{index}"
        policy.record(name, prompt[:held])
        candidates.append(Candidate(name, float(load)))
    choice = policy.choose(candidates, prompt)
    lowest = min(c.load for c in candidates)
    eligible = [c for c in candidates if c.load <= lowest + gap]
    best = max(policy.matched(c.instance_id, prompt) for c in eligible)
    if best == 0:
        assert choice is None
    else:
        assert choice is not None and choice.matched_blocks == best
        chosen = next(c for c in candidates if c.instance_id == choice.instance_id)
        assert chosen.load <= lowest + gap


def test_bad_settings_are_named() -> None:
    with pytest.raises(PolicyInputError, match="block_units"):
        AffinityConfig(block_units=0)
    with pytest.raises(PolicyInputError, match="ttl_s"):
        AffinityConfig(ttl_s=0)
    with pytest.raises(PolicyInputError, match="max_load_gap"):
        AffinityConfig(max_load_gap=-1)
