"""Two-step routing (score once, choose per state) decides exactly as the one-call rule,
and the load tracker's snapshots equal LinkLoad's own arithmetic."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from topkv.policy import (
    NO_LOAD,
    BandwidthEstimator,
    CostPolicy,
    DecodeWorkerView,
    Endpoint,
    LinkLoad,
    LinkLoadTracker,
    ManualClock,
    PairView,
    PaperPolicy,
    PathCandidate,
    RoutingPolicy,
    TransferRequest,
    UniformPolicy,
    pair_view_from_facts,
)
from topkv.policy.errors import NoPathError
from topkv.policy.select import TransportSelector, transfer_cost
from topkv.relay.pairs import CachingSelector

SOURCE = Endpoint("n0", 0)
LINKS = ["n0:nic0", "n1:nic0", "n0/GPU0:nvlink", "n0/GPU0:pcie", "n0:tcp", "n1:tcp"]

workers = st.lists(
    st.builds(
        DecodeWorkerView,
        worker_id=st.text(alphabet="abcdef", min_size=1, max_size=4),
        endpoint=st.builds(Endpoint, st.sampled_from(["n0", "n1", "n2", "n3"]), st.integers(0, 3)),
        free_slots=st.integers(0, 3),
        load=st.sampled_from([0.0, 0.25, 0.5, 1.0]),
        healthy=st.booleans(),
    ),
    max_size=10,
    unique_by=lambda w: w.worker_id,
)
requests = st.builds(
    TransferRequest,
    nbytes=st.integers(0, 10**10),
    chunks=st.integers(1, 1000),
    manual_override=st.sampled_from([None, None, "rdma", "tcp"]),
)
loads = st.builds(
    LinkLoad,
    st.dictionaries(st.sampled_from(LINKS), st.integers(0, 10**10)),
    st.dictionaries(st.sampled_from(LINKS), st.integers(0, 8)),
)


def _lookup(src: Endpoint, dst: Endpoint) -> PairView:
    return pair_view_from_facts(
        src,
        dst,
        same_nvlink_domain=src.node == dst.node,
        rdma_available=dst.node not in ("n2", "n3"),
        tcp_available=dst.node != "n3",
    )


def _reference_choice(
    candidates: Sequence[DecodeWorkerView],
    request: TransferRequest,
    load: LinkLoad,
    exclude: Collection[str],
) -> tuple[str, tuple[str, ...], float, str] | None:
    """The routing rule as first written (score each eligible worker, pick, rank the rest)."""
    scored = []
    for w in candidates:
        if not w.eligible or w.worker_id in exclude:
            continue
        try:
            selection = CostPolicy().select(_lookup(SOURCE, w.endpoint), request, load)
        except NoPathError:
            continue
        scored.append((w, selection, selection.chosen.estimated_s))
    if not scored:
        return None
    limit = min(s[2] for s in scored) * (1.0 + 1e-9)
    tied = [s for s in scored if s[2] <= limit]
    best = min(tied, key=lambda s: (s[0].load, s[0].worker_id))
    rest = sorted(
        (s for s in scored if s is not best), key=lambda s: (s[2], s[0].load, s[0].worker_id)
    )
    return (best[0].worker_id, tuple(s[0].worker_id for s in rest), best[2], best[1].choice)


@settings(max_examples=150)
@given(
    pool=workers,
    request=requests,
    load=loads,
    exclude=st.sets(st.text(alphabet="abcdef", min_size=1, max_size=4)),
)
def test_scored_routing_matches_the_reference_rule(
    pool: list[DecodeWorkerView], request: TransferRequest, load: LinkLoad, exclude: set[str]
) -> None:
    policy = RoutingPolicy()
    expected = _reference_choice(pool, request, load, exclude)
    direct = policy.choose_decode(SOURCE, pool, _lookup, request, CostPolicy(), load, exclude)
    # Scores for every worker regardless of slots (what the orchestrator keeps), then the
    # rule applied to the current state.
    scores = policy.score(
        SOURCE, [(w.worker_id, w.endpoint) for w in pool], _lookup, request, CostPolicy(), load
    )
    two_step = policy.choose_scored(
        scores, {w.worker_id: w for w in pool}, CostPolicy(), request, load, exclude
    )
    for decision in (direct, two_step):
        if expected is None:
            assert decision is None
            continue
        assert decision is not None
        got = (
            decision.worker_id,
            decision.alternatives,
            decision.estimated_s,
            decision.selection.choice,
        )
        assert got == expected
    if direct is not None and two_step is not None:
        assert direct == two_step
    assert [s.cost for s in scores] == sorted(s.cost for s in scores)


@given(
    ops=st.lists(
        st.tuples(
            st.lists(st.sampled_from(LINKS), max_size=3).map(tuple),
            st.integers(0, 10**9),
            st.booleans(),
        ),
        max_size=30,
    )
)
def test_load_tracker_snapshots_equal_linkload_arithmetic(
    ops: list[tuple[tuple[str, ...], int, bool]],
) -> None:
    tracker = LinkLoadTracker()
    expected = NO_LOAD
    live: list[tuple[tuple[str, ...], int]] = []
    for links, nbytes, add in ops:
        if add or not live:
            tracker.add(links, nbytes)
            expected = expected.with_flow(links, nbytes)
            live.append((links, nbytes))
        else:
            links, nbytes = live.pop(0)
            tracker.remove(links, nbytes)
            expected = expected.without_flow(links, nbytes)
        snapshot = tracker.snapshot()
        assert dict(snapshot.bytes_in_flight) == dict(expected.bytes_in_flight)
        assert dict(snapshot.active_flows) == dict(expected.active_flows)
        assert tracker.snapshot() is snapshot  # unchanged: the same object
    for links, nbytes in live:
        tracker.remove(links, nbytes)
    assert tracker.snapshot() is NO_LOAD


TRANSPORTS = ["nvlink", "nvswitch", "pcie", "rdma", "tcp"]
paths = st.builds(
    PathCandidate,
    transport=st.sampled_from(TRANSPORTS),
    bandwidth_gbps=st.floats(min_value=0.1, max_value=2000.0),
    setup_latency_s=st.floats(min_value=0.0, max_value=1e-3),
    links=st.lists(st.sampled_from(LINKS), max_size=3, unique=True).map(tuple),
)


@st.composite
def pairs(draw: st.DrawFn) -> PairView:
    candidates = tuple(draw(st.lists(paths, min_size=0, max_size=6)))
    present = {c.transport for c in candidates}
    same_domain = bool(present & {"nvlink", "nvswitch"}) and draw(st.booleans())
    same_node = "pcie" in present and draw(st.booleans())
    rdma = "rdma" in present and draw(st.booleans())
    return PairView(
        Endpoint("n0", 0), Endpoint("n1", 0), same_domain, same_node, rdma, True, candidates
    )


def _measured() -> BandwidthEstimator:
    clock = ManualClock(100.0)
    estimator = BandwidthEstimator(clock)
    path = PathCandidate("rdma", 25.0, 5e-6, ("n0:nic0", "n1:nic0"))
    estimator.record(path, 1_000_000_000, 0.2)
    clock.advance(1.0)
    return estimator


SELECTORS: list[TransportSelector] = [
    CostPolicy(),
    PaperPolicy(),
    UniformPolicy("rdma"),
    UniformPolicy("tcp"),
    CostPolicy(_measured()),
    CachingSelector(CostPolicy()),
]


@settings(max_examples=200)
@given(
    pair=pairs(),
    request=requests,
    load=loads,
    which=st.integers(0, len(SELECTORS) - 1),
)
def test_cost_is_the_selections_chosen_estimate(
    pair: PairView, request: TransferRequest, load: LinkLoad, which: int
) -> None:
    selector = SELECTORS[which]
    try:
        expected = selector.select(pair, request, load).chosen.estimated_s
    except NoPathError:
        try:
            transfer_cost(selector, pair, request, load)
        except NoPathError:
            return
        raise AssertionError("cost found a path where select found none") from None
    assert transfer_cost(selector, pair, request, load) == expected
