"""Hypothesis properties of the selection and routing policies."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from topkv.policy import (
    CostPolicy,
    DecodeWorkerView,
    Endpoint,
    LinkLoad,
    PairView,
    PaperPolicy,
    PathCandidate,
    RoutingPolicy,
    TransferRequest,
    next_after_failure,
)

LINKS = ["n0:nic0", "n0:nic1", "n1:nic0", "n0/GPU0:nvlink", "n0/GPU0:pcie", "n0:tcp"]
TRANSPORTS = ["nvlink", "nvswitch", "pcie", "rdma", "tcp"]

paths = st.builds(
    PathCandidate,
    transport=st.sampled_from(TRANSPORTS),
    bandwidth_gbps=st.floats(min_value=0.1, max_value=2000.0),
    setup_latency_s=st.floats(min_value=0.0, max_value=1e-3),
    links=st.lists(st.sampled_from(LINKS), max_size=3, unique=True).map(tuple),
)

loads = st.builds(
    LinkLoad,
    st.dictionaries(st.sampled_from(LINKS), st.integers(0, 10**11)),
    st.dictionaries(st.sampled_from(LINKS), st.integers(0, 16)),
)

requests = st.builds(
    TransferRequest,
    nbytes=st.integers(min_value=0, max_value=10**11),
    chunks=st.integers(min_value=1, max_value=100_000),
)


@st.composite
def pairs(draw: st.DrawFn) -> PairView:
    candidates = tuple(draw(st.lists(paths, min_size=1, max_size=6)))
    present = {c.transport for c in candidates}
    # keep the facts consistent with the listed paths, as the adapters do
    same_domain = bool(present & {"nvlink", "nvswitch"}) and draw(st.booleans())
    same_node = "pcie" in present and draw(st.booleans())
    rdma = "rdma" in present and draw(st.booleans())
    if not (same_domain or same_node or rdma) and "tcp" not in present:
        candidates = (*candidates, PathCandidate("tcp", 10.0, 1e-4, ("n0:tcp",)))
    return PairView(
        Endpoint("n0", 0), Endpoint("n1", 0), same_domain, same_node, rdma, True, candidates
    )


@given(pair=pairs(), request=requests, load=loads)
def test_cost_choice_has_the_minimum_estimate(
    pair: PairView, request: TransferRequest, load: LinkLoad
) -> None:
    selection = CostPolicy().select(pair, request, load)
    assert len(selection.candidates) == len(pair.candidates)
    assert selection.chosen.estimated_s == min(c.estimated_s for c in selection.candidates)
    assert selection.choice not in selection.fallbacks
    assert set(selection.ranked_transports) == set(pair.transports)


@given(pair=pairs(), request=requests, a=loads, b=loads)
def test_paper_policy_ignores_load(
    pair: PairView, request: TransferRequest, a: LinkLoad, b: LinkLoad
) -> None:
    first, second = PaperPolicy().select(pair, request, a), PaperPolicy().select(pair, request, b)
    assert first.ranked_transports == second.ranked_transports
    assert first.chosen.links == second.chosen.links


@given(pair=pairs(), request=requests, load=loads, failed=st.sets(st.sampled_from(TRANSPORTS)))
def test_failover_never_returns_a_failed_transport(
    pair: PairView, request: TransferRequest, load: LinkLoad, failed: set[str]
) -> None:
    selection = CostPolicy().select(pair, request, load)
    nxt = next_after_failure(selection, failed)
    if nxt is None:
        assert set(selection.ranked_transports) <= failed
    else:
        assert nxt not in failed and nxt in selection.ranked_transports


workers = st.lists(
    st.builds(
        DecodeWorkerView,
        worker_id=st.text(alphabet="abcdef", min_size=1, max_size=4),
        endpoint=st.builds(Endpoint, st.sampled_from(["n0", "n1", "n2"]), st.integers(0, 3)),
        free_slots=st.integers(0, 3),
        load=st.floats(min_value=0.0, max_value=1.0),
        healthy=st.booleans(),
    ),
    max_size=8,
    unique_by=lambda w: w.worker_id,
)


def _lookup(src: Endpoint, dst: Endpoint) -> PairView:
    from topkv.policy import pair_view_from_facts

    return pair_view_from_facts(
        src, dst, same_nvlink_domain=src.node == dst.node, rdma_available=dst.node != "n2"
    )


@settings(max_examples=60)
@given(pool=workers, request=requests, exclude=st.sets(st.text(alphabet="abcdef", max_size=4)))
def test_routing_is_deterministic_and_respects_eligibility(
    pool: list[DecodeWorkerView], request: TransferRequest, exclude: set[str]
) -> None:
    source = Endpoint("n0", 0)
    policy = RoutingPolicy()
    decision = policy.choose_decode(source, pool, _lookup, request, CostPolicy(), exclude=exclude)
    again = policy.choose_decode(
        source, list(reversed(pool)), _lookup, request, CostPolicy(), exclude=exclude
    )
    eligible = [w for w in pool if w.healthy and w.free_slots > 0 and w.worker_id not in exclude]
    if not eligible:
        assert decision is None and again is None
        return
    assert decision is not None and again is not None
    assert decision.worker_id == again.worker_id
    chosen = next(w for w in eligible if w.worker_id == decision.worker_id)
    costs = {
        w.worker_id: CostPolicy().select(_lookup(source, w.endpoint), request).chosen.estimated_s
        for w in eligible
    }
    assert costs[chosen.worker_id] <= min(costs.values()) * (1 + 1e-9)
    assert sorted((decision.worker_id, *decision.alternatives)) == sorted(costs)


@given(path=paths, request=requests)
def test_idle_estimate_is_the_planners_eq2(path: PathCandidate, request: TransferRequest) -> None:
    from math import isclose

    from topkv.planner.transports import TransportSpec, transfer_time_s
    from topkv.policy import NO_LOAD, NominalBandwidth, estimate_path

    estimate = estimate_path(path, request, NO_LOAD, NominalBandwidth())
    spec = TransportSpec(path.transport, path.bandwidth_gbps, path.setup_latency_s)
    expected = transfer_time_s(request.nbytes, spec, request.chunks)
    assert isclose(estimate.estimated_s, expected, rel_tol=1e-12, abs_tol=1e-18)
