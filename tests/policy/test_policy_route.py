"""Decode-worker routing: cheapest transfer, then least loaded, then worker id."""

from __future__ import annotations

from topkv.policy import (
    NO_LOAD,
    CostPolicy,
    DecodeWorkerView,
    Endpoint,
    LinkLoad,
    PairView,
    PaperPolicy,
    RoutingPolicy,
    TransferRequest,
    pair_view_from_facts,
)

SOURCE = Endpoint("node0", 0)
REQUEST = TransferRequest(1_340_000_000)


def lookup(src: Endpoint, dst: Endpoint) -> PairView:
    """node0 is one NVL8 domain; node1 and node2 are other nodes with RDMA; node3 has none."""
    rdma = "node3" not in (src.node, dst.node)
    return pair_view_from_facts(
        src, dst, same_nvlink_domain=src.node == dst.node, rdma_available=rdma
    )


def worker(
    wid: str, node: str, gpu: int, *, slots: int = 4, load: float = 0.0, healthy: bool = True
) -> DecodeWorkerView:
    return DecodeWorkerView(wid, Endpoint(node, gpu), slots, load, healthy)


def choose(
    workers: list[DecodeWorkerView],
    load: LinkLoad = NO_LOAD,
    exclude: frozenset[str] = frozenset(),
) -> str | None:
    decision = RoutingPolicy().choose_decode(
        SOURCE, workers, lookup, REQUEST, CostPolicy(), load=load, exclude=exclude
    )
    return None if decision is None else decision.worker_id


def test_cheapest_transfer_wins_over_load() -> None:
    workers = [worker("remote", "node1", 0, load=0.0), worker("local", "node0", 3, load=0.9)]
    decision = RoutingPolicy().choose_decode(SOURCE, workers, lookup, REQUEST, CostPolicy())
    assert decision is not None
    assert decision.worker_id == "local"
    assert decision.selection.choice == "nvlink"
    assert decision.alternatives == ("remote",)


def test_equal_cost_goes_to_least_loaded_then_worker_id() -> None:
    workers = [
        worker("w-b", "node1", 0, load=0.5),
        worker("w-c", "node2", 0, load=0.2),
        worker("w-a", "node2", 1, load=0.2),
    ]
    decision = RoutingPolicy().choose_decode(SOURCE, workers, lookup, REQUEST, CostPolicy())
    assert decision is not None
    assert decision.worker_id == "w-a"
    assert decision.alternatives == ("w-c", "w-b")
    assert "least loaded" in decision.rationale
    # same answer whatever the input order
    assert choose(list(reversed(workers))) == "w-a"


def test_unhealthy_full_and_excluded_workers_are_skipped() -> None:
    workers = [
        worker("dead", "node0", 1, healthy=False),
        worker("full", "node0", 2, slots=0),
        worker("gone", "node0", 3),
        worker("remote", "node1", 0),
    ]
    assert choose(workers) == "gone"
    assert choose(workers, exclude=frozenset({"gone"})) == "remote"
    assert choose(workers, exclude=frozenset({"gone", "remote"})) is None
    assert choose([]) is None


def test_busy_link_steers_routing_to_another_node() -> None:
    workers = [worker("n1", "node1", 0, load=0.0), worker("n2", "node2", 0, load=0.8)]
    assert choose(workers) == "n1"
    # node1's NIC already carries two large flows
    busy = LinkLoad({"node1:nic0": 8 * 10**9}, {"node1:nic0": 2})
    assert choose(workers, load=busy) == "n2"


def test_worker_without_any_path_is_skipped() -> None:
    def no_path_to_node1(src: Endpoint, dst: Endpoint) -> PairView:
        view = lookup(src, dst)
        if dst.node == "node1":
            return PairView(src, dst, False, False, False, False, ())
        return view

    workers = [worker("island", "node1", 0), worker("tcp-only", "node3", 0)]
    decision = RoutingPolicy().choose_decode(
        SOURCE, workers, no_path_to_node1, REQUEST, CostPolicy()
    )
    assert decision is not None
    assert decision.worker_id == "tcp-only"
    assert decision.selection.choice == "tcp"


def test_paper_selector_routes_by_algorithm_one() -> None:
    workers = [worker("remote", "node1", 0), worker("local", "node0", 1)]
    decision = RoutingPolicy().choose_decode(SOURCE, workers, lookup, REQUEST, PaperPolicy())
    assert decision is not None and decision.worker_id == "local"
