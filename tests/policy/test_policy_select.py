"""Transport selection: Algorithm 1, the cost policy, uniform, failover."""

from __future__ import annotations

import pytest

from topkv.policy import (
    CostPolicy,
    Endpoint,
    LinkLoad,
    NoPathError,
    PairView,
    PaperPolicy,
    PathCandidate,
    PolicyInputError,
    TransferRequest,
    UniformPolicy,
    next_after_failure,
    pair_view_from_facts,
    policy_from_name,
)
from topkv.policy.pairs import nic_port

GB = 10**9
LLAMA70B_4K = 1_340_000_000  # Eq. 1, FP16, 4K tokens

A0 = Endpoint("node0", 0)
A1 = Endpoint("node0", 1)
B0 = Endpoint("node1", 0)


def nvl8_pair() -> PairView:
    """Two H100s of one NV18 node (one NVL8 domain) with RDMA NICs."""
    return pair_view_from_facts(A0, A1, same_nvlink_domain=True, rdma_available=True)


def cross_node(rdma: bool, nics: tuple[str, ...] = ("nic0",)) -> PairView:
    return pair_view_from_facts(
        A0, B0, same_nvlink_domain=False, rdma_available=rdma, src_nics=nics, dst_nics=nics
    )


@pytest.mark.parametrize("policy", [PaperPolicy(), CostPolicy()])
def test_nvlink_pair_in_one_node_uses_nvlink(policy: PaperPolicy | CostPolicy) -> None:
    selection = policy.select(nvl8_pair(), TransferRequest(LLAMA70B_4K))
    assert selection.choice == "nvlink"
    assert selection.chosen.bandwidth_gbps == 450.0
    assert selection.chosen.estimated_s == pytest.approx(1e-6 + LLAMA70B_4K / (450 * GB))


@pytest.mark.parametrize("policy", [PaperPolicy(), CostPolicy()])
def test_two_nodes_use_rdma_when_nics_exist_else_tcp(policy: PaperPolicy | CostPolicy) -> None:
    request = TransferRequest(LLAMA70B_4K)
    assert policy.select(cross_node(rdma=True), request).choice == "rdma"
    without = policy.select(cross_node(rdma=False), request)
    assert without.choice == "tcp"
    assert without.fallbacks == ()


def test_same_node_without_nvlink_uses_pcie() -> None:
    pair = pair_view_from_facts(A0, A1, same_nvlink_domain=False, rdma_available=False)
    assert PaperPolicy().select(pair, TransferRequest(GB)).choice == "pcie"
    assert CostPolicy().select(pair, TransferRequest(GB)).choice == "pcie"


def test_paper_nvlink_step_uses_nvswitch_path_on_nvswitch_domain() -> None:
    pair = pair_view_from_facts(
        A0, B0, same_nvlink_domain=True, rdma_available=True, nvlink_transport="nvswitch"
    )
    assert PaperPolicy().select(pair, TransferRequest(GB)).choice == "nvswitch"


def test_fallbacks_rank_every_other_transport() -> None:
    paper = PaperPolicy().select(nvl8_pair(), TransferRequest(GB))
    assert paper.ranked_transports == ("nvlink", "pcie", "rdma", "tcp")
    cost = CostPolicy().select(nvl8_pair(), TransferRequest(GB))
    assert cost.ranked_transports == ("nvlink", "pcie", "rdma", "tcp")
    estimates = [c.estimated_s for c in cost.candidates]
    assert estimates == sorted(estimates)


def test_busy_nic_moves_cost_policy_to_the_idle_nic() -> None:
    pair = cross_node(rdma=True, nics=("nic0", "nic1"))
    busy = LinkLoad({nic_port("node0", "nic0"): 4 * GB}, {nic_port("node0", "nic0"): 1})
    request = TransferRequest(LLAMA70B_4K)
    idle_choice = CostPolicy().select(pair, request)
    assert idle_choice.chosen.links[0] == "node0:nic0"  # equal estimates: view order
    moved = CostPolicy().select(pair, request, busy)
    assert moved.choice == "rdma"
    assert moved.chosen.links[0] == "node0:nic1"
    idle = moved.best_path("rdma")
    assert idle is not None and idle.queued_bytes == 0
    queued = next(c for c in moved.candidates if c.links[0] == "node0:nic0")
    assert queued.bottleneck_link == "node0:nic0"
    # the busy NIC's path serves min(4 GB, 1 flow x 1.34 GB) of others first
    assert queued.queued_bytes == LLAMA70B_4K
    # the paper policy ignores load: it keeps the view's first RDMA path
    assert PaperPolicy().select(pair, request, busy).chosen.links[0] == "node0:nic0"


def test_busy_rdma_link_moves_cost_policy_to_tcp() -> None:
    pair = cross_node(rdma=True)
    nic = nic_port("node0", "nic0")
    request = TransferRequest(LLAMA70B_4K)
    # four large flows already on the only NIC: (1.34 + 4 x 1.34) GB / 25 GB/s = 268 ms
    busy = LinkLoad({nic: 4 * 3 * GB}, {nic: 4})
    selection = CostPolicy().select(pair, request, busy)
    assert selection.choice == "tcp"
    assert selection.fallbacks == ("rdma",)
    rdma = selection.best_path("rdma")
    assert rdma is not None
    assert rdma.estimated_s == pytest.approx(5e-6 + 5 * LLAMA70B_4K / (25 * GB))
    assert PaperPolicy().select(pair, request, busy).choice == "rdma"
    # a light load (small flows) does not move it
    light = LinkLoad({nic: 10_000_000}, {nic: 2})
    assert CostPolicy().select(pair, request, light).choice == "rdma"


def custom_pair(*paths: PathCandidate) -> PairView:
    return PairView(A0, B0, False, False, True, True, tuple(paths))


def test_many_small_chunks_prefer_lower_setup_path() -> None:
    wide_slow_setup = PathCandidate("rdma", 50.0, 20e-6, ("node0:nic0",))
    narrow_fast_setup = PathCandidate("tcp", 25.0, 2e-6, ("node0:tcp",))
    pair = custom_pair(wide_slow_setup, narrow_fast_setup)
    assert CostPolicy().select(pair, TransferRequest(LLAMA70B_4K, chunks=1)).choice == "rdma"
    # 80 layers x 256 pages of 64 KiB: setup dominates
    paged = TransferRequest(20_480 * 65_536, chunks=20_480)
    selection = CostPolicy().select(pair, paged)
    assert selection.choice == "tcp"
    assert selection.chosen.setup_s == pytest.approx(20_480 * 2e-6)
    assert selection.fallbacks == ("rdma",)


def test_manual_override_wins_in_every_policy() -> None:
    request = TransferRequest(GB, manual_override="tcp")
    for policy in (PaperPolicy(), CostPolicy(), UniformPolicy("rdma")):
        selection = policy.select(nvl8_pair(), request)
        assert selection.choice == "tcp"
        assert "override" in selection.rationale
        assert "nvlink" in selection.fallbacks


def test_override_to_a_missing_transport_is_a_clear_error() -> None:
    request = TransferRequest(GB, manual_override="rdma")
    for policy in (PaperPolicy(), CostPolicy()):
        with pytest.raises(NoPathError, match="no rdma path"):
            policy.select(cross_node(rdma=False), request)


def test_paper_choice_missing_from_view_is_a_clear_error() -> None:
    pair = custom_pair(PathCandidate("tcp", 10.0, 1e-4))  # claims RDMA but lists no path
    with pytest.raises(NoPathError, match="Algorithm 1"):
        PaperPolicy().select(pair, TransferRequest(GB))


def test_empty_view_has_no_path() -> None:
    with pytest.raises(NoPathError, match="no path at all"):
        CostPolicy().select(custom_pair(), TransferRequest(GB))


def test_uniform_rdma_baseline_even_inside_an_nvlink_domain() -> None:
    selection = UniformPolicy("rdma").select(nvl8_pair(), TransferRequest(LLAMA70B_4K))
    assert selection.choice == "rdma"
    assert selection.fallbacks == ("nvlink", "pcie", "tcp")
    with pytest.raises(NoPathError):
        UniformPolicy("rdma").select(cross_node(rdma=False), TransferRequest(GB))


def test_next_after_failure_walks_the_ranking() -> None:
    selection = CostPolicy().select(nvl8_pair(), TransferRequest(GB))
    assert next_after_failure(selection, "nvlink") == "pcie"
    assert next_after_failure(selection, ["nvlink", "pcie"]) == "rdma"
    assert next_after_failure(selection, "rdma") == "nvlink"
    assert next_after_failure(selection, selection.ranked_transports) is None


def test_policy_from_name() -> None:
    assert policy_from_name("cost").name == "cost"
    assert policy_from_name("Paper").name == "paper"
    assert policy_from_name("uniform-rdma").name == "uniform-rdma"
    with pytest.raises(PolicyInputError, match="unknown selection policy"):
        policy_from_name("fastest")


def test_selection_serialises_every_candidate() -> None:
    data = CostPolicy().select(nvl8_pair(), TransferRequest(GB, chunks=4)).to_dict()
    assert data["choice"] == "nvlink"
    candidates = data["candidates"]
    assert isinstance(candidates, list) and len(candidates) == 4
    assert {c["source"] for c in candidates} == {"nominal"}
    assert "4 x" in candidates[0]["reason"]
