"""Model JSON round trip, path ladder, cluster queries and the NIC maps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from topkv.topology.build import _nvlink_pair_counts, discover_from_files
from topkv.topology.detect.nvidia_smi import NvlinkLink, parse_cpu_list
from topkv.topology.model import Cluster, TopologyError, Transport
from topkv.topology.nicmap import render
from topkv.topology.paths import (
    classify,
    link_between,
    nearest_nics,
    nvlink_generation_for,
    path_rank,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
H100 = FIXTURES / "nvidia-smi-topo" / "sglang-30401-h100-8gpu-nv18-8nic.txt"


def _h100() -> Cluster:
    node = discover_from_files({"nvidia-smi-topo": H100}, name="h100", gpu_name="NVIDIA H100")
    return Cluster.replicate(node, 2)


def test_json_round_trip() -> None:
    cluster = _h100()
    again = Cluster.model_validate_json(cluster.model_dump_json())
    assert again == cluster
    data = json.loads(cluster.model_dump_json())
    link = data["nodes"][0]["links"][0]
    assert link == {
        "a": "GPU0",
        "b": "GPU1",
        "type": "NV18",
        "transport": "nvlink",
        "bandwidth_gbps": 450.0,
        "latency_s": 1e-06,
        "nvlink_count": 18,
        "source": "nvidia-smi topo -m",
    }


def test_replicate_and_cluster_queries() -> None:
    c = _h100()
    assert [n.name for n in c.nodes] == ["h100-0", "h100-1"]
    assert c.gpu("h100-1", 3).label == "GPU3"
    assert c.same_nvlink_domain(("h100-0", 0), ("h100-0", 7))
    assert not c.same_nvlink_domain(("h100-0", 0), ("h100-1", 0))
    assert {d.id for d in c.nvlink_domains} == {"h100-0/nvl0", "h100-1/nvl0"}
    assert [n.name for n in nearest_nics(c.node("h100-1"), 5)] == ["mlx5_5"]
    inside = link_between(c, ("h100-0", 0), ("h100-0", 1))
    assert inside.transport == Transport.NVLINK and inside.bandwidth_gbps == 450.0
    across = link_between(c, ("h100-0", 0), ("h100-1", 0))
    assert across.transport == Transport.RDMA and across.bandwidth_gbps == 25.0
    with pytest.raises(TopologyError):
        c.gpu("h100-0", 8)
    with pytest.raises(TopologyError):
        Cluster.replicate(c.nodes[0], 0)


def test_nvl72_domain_spans_nodes() -> None:
    fabric = FIXTURES / "nvlink" / "dra-driver-626-gb200-nvidia-smi-q-fabric-unhealthy-grep.txt"
    status = FIXTURES / "nvlink" / "bottlerocket-4418-h100-nvlink-status-gpu0-gpu1.txt"
    node = discover_from_files({"fabric": fabric, "nvlink": status}, name="gb")
    c = Cluster.replicate(node, 2)
    assert c.same_nvlink_domain(("gb-0", 0), ("gb-1", 1))
    (dom,) = c.nvlink_domains
    assert dom.kind == "NVL72" and len(dom.members) == 4
    link = link_between(c, ("gb-0", 0), ("gb-1", 1))
    assert link.transport == Transport.NVSWITCH and link.bandwidth_gbps == 900.0


def test_ladder_and_generations() -> None:
    assert [path_rank(t) for t in ("NV4", "PIX", "PXB", "PHB", "NODE", "SYS", "???")] == [
        0,
        1,
        2,
        3,
        4,
        5,
        6,
    ]
    assert classify("NV18", 4).bandwidth_gbps == 450.0
    assert classify("NV18", 5).bandwidth_gbps == 900.0
    assert classify("NV6", 2).bandwidth_gbps == 150.0
    assert classify("PXB").bandwidth_gbps == 31.5 and classify("SOC").bandwidth_gbps == 7.88
    assert nvlink_generation_for("NVIDIA H100 80GB HBM3") == 4
    assert nvlink_generation_for("NVIDIA B200") == 5
    assert nvlink_generation_for("Tesla V100-SXM2-32GB") == 2
    assert nvlink_generation_for("NVIDIA A100-SXM4-40GB") == 3
    assert nvlink_generation_for("mystery") is None


def test_nvlink_pair_counts_direct_and_switched() -> None:
    direct = {
        0: ("0000:01:00.0", [NvlinkLink(i, True, remote_bus_id="0000:02:00.0") for i in range(4)]),
        1: ("0000:02:00.0", [NvlinkLink(i, True, remote_bus_id="0000:01:00.0") for i in range(4)]),
    }
    assert _nvlink_pair_counts(direct) == {(0, 1): 4}
    switched = {
        i: (
            f"0000:1{i}:00.0",
            [NvlinkLink(k, True, remote_bus_id="0000:05:00.0") for k in range(18)],
        )
        for i in range(3)
    }
    assert _nvlink_pair_counts(switched) == {(0, 1): 18, (0, 2): 18, (1, 2): 18}


def test_cpu_list() -> None:
    assert parse_cpu_list("0-2,8,10-11") == [0, 1, 2, 8, 10, 11]
    assert parse_cpu_list("N/A") == []


def test_nic_maps() -> None:
    node = _h100().nodes[0]
    assert render(node, "ucx").splitlines()[1] == "  0) export UCX_NET_DEVICES=mlx5_0:1 ;;"
    assert render(node, "nccl") == "export NCCL_IB_HCA==" + ",".join(
        f"mlx5_{i}:1" for i in range(8)
    )
    mc = json.loads(render(node, "mooncake"))
    assert mc["cuda:3"][0] == ["mlx5_3"] and "mlx5_0" in mc["cuda:3"][1]
    assert json.loads(render(node, "sglang"))["7"] == "mlx5_7"
    with pytest.raises(TopologyError):
        render(node, "mpi")
    bare = discover_from_files(
        {"nvidia-smi-topo": FIXTURES / "nvidia-smi-topo" / "stas-2gpu-nvlink-bridge-nv2.txt"}
    )
    with pytest.raises(TopologyError, match="no NICs"):
        render(bare, "nccl")
