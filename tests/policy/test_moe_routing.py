"""MoE routing on hand-built expert registries: each strategy, stragglers, ties, staleness."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from topkv.policy import (
    CostPolicy,
    Endpoint,
    ManualClock,
    PairView,
    TransferRequest,
    pair_view_from_facts,
)
from topkv.policy.errors import PolicyInputError
from topkv.policy.moe.experts import ExpertReplica, ExpertSnapshot, MoEWeights
from topkv.policy.moe.router import STRATEGIES, MoERequest, MoERouter, MoETarget

SOURCE = Endpoint("nodeA", 0)
SELECTOR = CostPolicy()
#: Two nodes, each its own NVLink domain; RDMA between them.
DOMAINS = {"nodeA": "A/nvl", "nodeB": "B/nvl"}


def lookup(src: Endpoint, dst: Endpoint) -> PairView:
    return pair_view_from_facts(
        src, dst, same_nvlink_domain=src.node == dst.node, rdma_available=True
    )


def target(wid: str, node: str, gpu: int, **kw: object) -> MoETarget:
    return MoETarget(wid, Endpoint(node, gpu), DOMAINS[node], free_slots=4, **kw)  # type: ignore[arg-type]


def replica(
    expert: int,
    node: str,
    gpu: int,
    *,
    rate: float = 10.0,
    compute_s: float = 1e-3,
    queue: int = 0,
    at: float = 0.0,
    layer: int = 0,
) -> ExpertReplica:
    return ExpertReplica(
        layer=layer,
        expert=expert,
        worker_id=f"{node}-{gpu}",
        domain=DOMAINS[node],
        endpoint=Endpoint(node, gpu),
        rate=rate,
        compute_s=compute_s,
        network_s=2e-5,
        queue_depth=queue,
        updated_at=at,
    )


def full_replicas(**slow: float) -> list[ExpertReplica]:
    """Experts 0-3 replicated in both domains (GPU 1 of each node hosts them)."""
    return [
        replica(e, node, 1, compute_s=slow.get(node, 1e-3))
        for node in ("nodeA", "nodeB")
        for e in range(4)
    ]


TARGETS = [target("dA", "nodeA", 2), target("dB", "nodeB", 2)]
REQ = MoERequest(
    TransferRequest(50_000_000, chunks=8),
    decode_tokens=200,
    activations_per_token=8,
    dispatch_bytes=2 * 7168 * 2,
)


def decide(strategy: str, replicas: list[ExpertReplica], targets=TARGETS, req=REQ, now=0.0):  # type: ignore[no-untyped-def]
    clock = ManualClock(now)
    router = MoERouter(clock, strategy)
    return router.decide(router.snapshot(replicas), SOURCE, targets, lookup, req, SELECTOR)


def test_cache_affinity_prefers_the_holder_then_the_cheapest_kv() -> None:
    reps = full_replicas()
    assert decide("cache-affinity", reps).worker_id == "dA"  # same node as the KV: NVLink
    holder = [target("dA", "nodeA", 2), target("dB", "nodeB", 2, holds_kv=True)]
    d = decide("cache-affinity", reps, holder)
    assert d.worker_id == "dB" and d.rationale == "holds the KV"


def test_expert_locality_goes_where_most_activations_are() -> None:
    # Experts 0-2 only in B, expert 3 only in A: B hosts 75% of the activations.
    reps = [replica(e, "nodeB", 1) for e in range(3)] + [replica(3, "nodeA", 1)]
    d = decide("expert-locality", reps)
    assert d.worker_id == "dB" and d.local_share == pytest.approx(0.75)
    # The prompt's known routing overrides the rates: all on expert 3 -> domain A.
    known = MoERequest(REQ.kv, 200, 8, REQ.dispatch_bytes, shares={(0, 3): 1.0})
    assert decide("expert-locality", reps, req=known).worker_id == "dA"


def test_rates_shape_expected_activations() -> None:
    reps = [replica(0, "nodeA", 1, rate=90.0), replica(1, "nodeB", 1, rate=10.0)]
    assert decide("expert-locality", reps).worker_id == "dA"
    reps = [replica(0, "nodeA", 1, rate=10.0), replica(1, "nodeB", 1, rate=90.0)]
    assert decide("expert-locality", reps).worker_id == "dB"


@pytest.mark.parametrize("strategy", ["load-balance", "cost"])
def test_the_straggler_is_avoided(strategy: str) -> None:
    # Domain A's replicas are 10x slow: every strategy that weighs compute leaves A,
    # though A is where the KV is (cheaper transfer).
    reps = full_replicas(nodeA=10e-3)
    snap = ExpertSnapshot.build(reps, 0.0)
    assert snap.straggler_workers == {"nodeA-1"}
    d = decide(strategy, reps)
    assert d.worker_id == "dB" and d.straggler_share == 0
    # Recovered: the same latency as B again, so the cheaper KV wins back.
    assert decide(strategy, full_replicas()).worker_id == "dA"


def test_cost_weighs_kv_against_dispatch() -> None:
    reps = full_replicas()
    d = decide("cost", reps)
    assert d.worker_id == "dA"
    assert d.score == pytest.approx(d.kv_s + d.dispatch_s + d.queue_s)
    # A long queue at A outweighs its cheaper KV transfer.
    queued = [target("dA", "nodeA", 2, queue_s=60.0), target("dB", "nodeB", 2)]
    assert decide("cost", reps, queued).worker_id == "dB"
    # With remote-only experts, dispatching over RDMA each token costs more than the KV.
    only_b = [replica(e, "nodeB", 1) for e in range(4)]
    d = decide("cost", only_b)
    assert d.worker_id == "dB"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_tie_is_broken_by_load_then_worker_id(strategy: str) -> None:
    reps = full_replicas()
    # Same node, same experts: equal on every strategy; the smaller id wins...
    twins = [target("d2", "nodeA", 2), target("d1", "nodeA", 2)]
    assert decide(strategy, reps, twins).worker_id == "d1"
    # ...unless it is the more loaded one.
    loaded = [target("d2", "nodeA", 2), target("d1", "nodeA", 2, load=0.5)]
    assert decide(strategy, reps, loaded).worker_id == "d2"


def test_a_stale_entry_is_dropped() -> None:
    w = MoEWeights()
    fresh = [replica(e, "nodeB", 1, at=100.0) for e in range(3)]
    stale = [replica(3, "nodeA", 1, at=100.0 - w.stale_after_s - 1)]
    snap = ExpertSnapshot.build(fresh + stale, 100.0, w)
    assert snap.dropped_stale == 1 and (0, 3) not in snap.keys
    d = decide("expert-locality", fresh + stale, now=100.0)
    assert d.worker_id == "dB" and d.local_share == pytest.approx(1.0)


def test_ineligible_targets_and_nothing_left() -> None:
    reps = full_replicas()
    sick = [target("dA", "nodeA", 2, healthy=False), target("dB", "nodeB", 2)]
    assert decide("cost", reps, sick).worker_id == "dB"
    full = [MoETarget("dA", Endpoint("nodeA", 2), "A/nvl", free_slots=0)]
    assert decide("cost", reps, full) is None


def test_bad_inputs_are_refused_with_the_field_named() -> None:
    with pytest.raises(PolicyInputError, match="unknown MoE router 'fastest'"):
        MoERouter(ManualClock(), "fastest")
    with pytest.raises(PolicyInputError, match="compute_s=nan"):
        replica(0, "nodeA", 1, compute_s=math.nan)
    with pytest.raises(PolicyInputError, match="queue_depth -1"):
        replica(0, "nodeA", 1, queue=-1)
    with pytest.raises(PolicyInputError, match="straggler_factor"):
        MoEWeights(straggler_factor=0)


finite = st.floats(min_value=0, max_value=1e3, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(
    rates=st.lists(finite, min_size=1, max_size=8),
    computes=st.lists(st.floats(min_value=1e-6, max_value=1.0), min_size=1, max_size=8),
    strategy=st.sampled_from(STRATEGIES),
)
def test_properties_shares_sum_to_one_and_decisions_are_deterministic(
    rates: list[float], computes: list[float], strategy: str
) -> None:
    reps = [
        replica(i, "nodeA" if i % 2 else "nodeB", 1, rate=r, compute_s=computes[i % len(computes)])
        for i, r in enumerate(rates)
    ]
    snap = ExpertSnapshot.build(reps, 0.0)
    assert sum(snap.expected_shares().values()) == pytest.approx(1.0)
    first = decide(strategy, reps)
    again = decide(strategy, list(reversed(reps)), list(reversed(TARGETS)))
    assert first is not None and again is not None
    assert first.worker_id == again.worker_id
    assert first.dispatch_s >= 0 and math.isfinite(first.score)
    for r in reps:
        if snap.is_straggler(r):
            assert r.compute_s > snap.weights.straggler_factor * snap.baseline_compute_s
