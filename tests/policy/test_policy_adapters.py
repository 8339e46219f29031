"""Selection on topologies built from real ``nvidia-smi topo -m`` fixtures."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from topkv.errors import ConfigError, TopKVError
from topkv.policy import CostPolicy, Endpoint, LinkLoad, PaperPolicy, TransferRequest
from topkv.policy.adapters import cluster_from_json, pair_view_from_cluster
from topkv.topology.build import discover_from_files
from topkv.topology.model import Cluster

TOPO_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi-topo"

H100_NV18 = "sglang-30401-h100-8gpu-nv18-8nic.txt"
H100_NO_NIC = "stas-h100-8gpu-nv18-hyperthreads-no-nic.txt"
RTX_PHB_2NIC = "puget-wrx90-2x-rtx6000ada-phb-2nic.txt"
LLAMA70B_4K = 1_340_000_000

Build = Callable[[str, str], Cluster]


def test_h100_nv18_pair_in_one_node_goes_over_nvlink(two_node_cluster: Build) -> None:
    cluster = two_node_cluster(H100_NV18, "NVIDIA H100 80GB HBM3")
    pair = pair_view_from_cluster(cluster, Endpoint("node-0", 0), Endpoint("node-0", 1))
    assert pair.same_node and pair.same_nvlink_domain
    nvlink = pair.paths_for("nvlink")[0]
    assert nvlink.bandwidth_gbps == 450.0  # 18 links x 25 GB/s
    assert pair.paths_for("pcie")[0].bandwidth_gbps == 15.75  # same NUMA node: NODE
    for policy in (PaperPolicy(), CostPolicy()):
        assert policy.select(pair, TransferRequest(LLAMA70B_4K)).choice == "nvlink"
    cross_socket = pair_view_from_cluster(cluster, Endpoint("node-0", 0), Endpoint("node-0", 4))
    assert cross_socket.paths_for("pcie")[0].bandwidth_gbps == 7.88  # SYS


def test_gpus_on_two_nodes_use_rdma_when_nics_exist(two_node_cluster: Build) -> None:
    cluster = two_node_cluster(H100_NV18, "NVIDIA H100 80GB HBM3")
    pair = pair_view_from_cluster(cluster, Endpoint("node-0", 3), Endpoint("node-1", 5))
    assert not pair.same_node and pair.rdma_available
    rdma = pair.paths_for("rdma")
    # the nearest NICs (PIX), then both GPUs' PCIe ports, which GPUDirect RDMA crosses
    assert [p.links for p in rdma] == [
        ("node-0:mlx5_3", "node-1:mlx5_5", "node-0/GPU3:pcie", "node-1/GPU5:pcie")
    ]
    assert rdma[0].bandwidth_gbps == 25.0  # NIC figure; PIX (31.5) does not cap it
    for policy in (PaperPolicy(), CostPolicy()):
        selection = policy.select(pair, TransferRequest(LLAMA70B_4K))
        assert selection.choice == "rdma"
        assert selection.fallbacks == ("tcp",)


def test_gpus_on_two_nodes_without_nics_use_tcp(two_node_cluster: Build) -> None:
    cluster = two_node_cluster(H100_NO_NIC, "NVIDIA H100 80GB HBM3")
    pair = pair_view_from_cluster(cluster, Endpoint("node-0", 0), Endpoint("node-1", 0))
    assert not pair.rdma_available
    for policy in (PaperPolicy(), CostPolicy()):
        assert policy.select(pair, TransferRequest(LLAMA70B_4K)).choice == "tcp"


def test_pcie_only_node_and_a_busy_nic(two_node_cluster: Build) -> None:
    cluster = two_node_cluster(RTX_PHB_2NIC, "NVIDIA RTX 6000 Ada Generation")
    local = pair_view_from_cluster(cluster, Endpoint("node-0", 0), Endpoint("node-0", 1))
    assert not local.same_nvlink_domain
    assert local.paths_for("pcie")[0].bandwidth_gbps == 31.5  # PHB
    assert PaperPolicy().select(local, TransferRequest(LLAMA70B_4K)).choice == "pcie"

    remote = pair_view_from_cluster(cluster, Endpoint("node-0", 0), Endpoint("node-1", 0))
    assert len(remote.paths_for("rdma")) == 2  # both NICs tie at NODE
    request = TransferRequest(LLAMA70B_4K)
    assert CostPolicy().select(remote, request).chosen.links[0] == "node-0:mlx5_0"
    busy = LinkLoad({"node-0:mlx5_0": 8 * 10**9}, {"node-0:mlx5_0": 2})
    moved = CostPolicy().select(remote, request, busy)
    assert (moved.choice, moved.chosen.links[0]) == ("rdma", "node-0:mlx5_1")
    assert PaperPolicy().select(remote, request, busy).chosen.links[0] == "node-0:mlx5_0"


def test_unknown_gpu_is_a_topology_error(two_node_cluster: Build) -> None:
    cluster = two_node_cluster(H100_NV18, "NVIDIA H100 80GB HBM3")
    with pytest.raises(TopKVError, match="GPU9"):
        pair_view_from_cluster(cluster, Endpoint("node-0", 0), Endpoint("node-1", 9))


def test_cluster_json_round_trip_and_errors(two_node_cluster: Build) -> None:
    cluster = two_node_cluster(H100_NV18, "NVIDIA H100 80GB HBM3")
    assert cluster_from_json(cluster.model_dump_json()) == cluster
    single = cluster_from_json(cluster.nodes[0].model_dump_json())
    assert [n.name for n in single.nodes] == ["node-0"]
    with pytest.raises(ConfigError, match="not JSON"):
        cluster_from_json("{nope")
    with pytest.raises(ConfigError, match="not a topology"):
        cluster_from_json('{"nodes": [{"gpus": 3}]}')


def test_selection_on_clusters_from_the_topology_builder() -> None:
    """Same cases through ``topkv discover``'s own builder (the ``--json`` it writes)."""

    def cluster(fixture: str) -> Cluster:
        files = {"nvidia-smi-topo": TOPO_DIR / fixture}
        node = discover_from_files(files, name="n", gpu_name="NVIDIA H100 80GB HBM3")
        return cluster_from_json(Cluster.replicate(node, 2).model_dump_json())

    with_nics, without_nics = cluster(H100_NV18), cluster(H100_NO_NIC)
    request = TransferRequest(LLAMA70B_4K)
    cases = [
        (with_nics, Endpoint("n-0", 0), Endpoint("n-0", 7), "nvlink"),
        (with_nics, Endpoint("n-0", 0), Endpoint("n-1", 0), "rdma"),
        (without_nics, Endpoint("n-0", 0), Endpoint("n-1", 0), "tcp"),
    ]
    for topology, src, dst, expected in cases:
        pair = pair_view_from_cluster(topology, src, dst)
        assert PaperPolicy().select(pair, request).choice == expected
        assert CostPolicy().select(pair, request).choice == expected
