"""nvlink, nvidia-smi -q Fabric and lspci fixtures parse into the right content."""

from __future__ import annotations

from pathlib import Path

import pytest

from topkv.topology.build import discover_from_files
from topkv.topology.detect.errors import ParseError
from topkv.topology.detect.lspci import (
    parse_lspci_listing,
    parse_lspci_tree,
    switches_from_listing,
)
from topkv.topology.detect.nvidia_smi import parse_fabric, parse_nvlink, parse_smi_query

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
NVLINK = FIXTURES / "nvlink"
LSPCI = FIXTURES / "lspci"


def test_every_nvlink_and_lspci_fixture_is_covered() -> None:
    assert {p.name for p in NVLINK.iterdir()} == {
        "azhpc-images-506-gb200-fabric-insufficient-resources.txt",
        "bottlerocket-4418-h100-nvlink-status-gpu0-gpu1.txt",
        "dra-driver-626-gb200-nvidia-smi-q-fabric-unhealthy-grep.txt",
        "nccl-1182-h100-nvswitch-nvlink-R-gpu0.txt",
        "rtx6kpro-asus-rtxpro6000-nvidia-smi-q-gpu0-fabric-na.txt",
    }
    assert {p.name for p in LSPCI.iterdir()} == {
        "asus-esc8000a-e12-4x-rtx6000ada-cx7-lspci-tv.txt",
        "asus-esc8000a-e12-rtx6000ada-lspci-vvv-gpu0.txt",
        "nccl-19-supermicro-7048gr-plx-pex8747-lspci-grep.txt",
        "puget-wrx90-threadripper-2x-rtx6000ada-cx7-lspci-tv.txt",
        "rtx6kpro-asus-pex890xx-switch-to-rtxpro6000-lspci-vvv-excerpt.txt",
    }


def test_nvlink_status_speeds() -> None:
    gpus = parse_nvlink((NVLINK / "bottlerocket-4418-h100-nvlink-status-gpu0-gpu1.txt").read_text())
    assert [g.index for g in gpus] == [0, 1]
    assert gpus[0].name == "NVIDIA H100 80GB HBM3"
    assert gpus[1].uuid == "GPU-dd3b269a-8f3a-d2d5-1518-2713ba03fcf7"
    assert len(gpus[0].active_links) == 18
    assert {lk.speed_gbps for lk in gpus[1].links} == {26.562}


def test_nvlink_remote_ends_are_nvswitches() -> None:
    gpus = parse_nvlink((NVLINK / "nccl-1182-h100-nvswitch-nvlink-R-gpu0.txt").read_text())
    assert len(gpus[0].links) == 18 and len(gpus[1].links) == 2
    remotes = {lk.remote_bus_id for lk in gpus[0].links}
    assert remotes == {f"0000:0{i}:00.0" for i in (5, 6, 7, 8)}
    assert gpus[0].links[0].remote_link == 46
    node = discover_from_files(
        {"nvlink-remote": NVLINK / "nccl-1182-h100-nvswitch-nvlink-R-gpu0.txt"}
    )
    # GPU1's report is cut after 2 links: NV(min(18, 2)) through the switches
    link = node.link("GPU0", "GPU1")
    assert link is not None and link.type == "NV2" and link.transport == "nvlink"


def test_fabric_insufficient_resources_is_no_domain() -> None:
    (fab,) = parse_fabric(
        (NVLINK / "azhpc-images-506-gb200-fabric-insufficient-resources.txt").read_text()
    )
    assert fab.status == "Insufficient Resources" and fab.clique_id == "0"
    assert not fab.in_mnnvl_domain


def test_fabric_success_with_unhealthy_summary_is_a_flagged_domain() -> None:
    (fab,) = parse_fabric(
        (NVLINK / "dra-driver-626-gb200-nvidia-smi-q-fabric-unhealthy-grep.txt").read_text()
    )
    assert fab.in_mnnvl_domain and fab.clique_id == "2" and fab.healthy is False
    assert fab.cluster_uuid == "dc6e40c4-d722-4357-9ba6-5291dd461278"
    node = discover_from_files(
        {
            "fabric": NVLINK / "dra-driver-626-gb200-nvidia-smi-q-fabric-unhealthy-grep.txt",
            "nvlink": NVLINK / "bottlerocket-4418-h100-nvlink-status-gpu0-gpu1.txt",
        }
    )
    (dom,) = node.nvlink_domains
    assert dom.kind == "NVL72" and dom.clique == "2" and dom.healthy is False
    assert dom.members == ["node0/GPU0", "node0/GPU1"]


def test_fabric_na_on_pcie_card() -> None:
    (gpu,) = parse_smi_query(
        (NVLINK / "rtx6kpro-asus-rtxpro6000-nvidia-smi-q-gpu0-fabric-na.txt").read_text()
    )
    assert gpu.bus_id == "0000:06:00.0"
    assert gpu.product_name == "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    assert gpu.fabric is not None and gpu.fabric.status == "N/A"
    assert not gpu.fabric.in_mnnvl_domain
    node = discover_from_files(
        {"fabric": NVLINK / "rtx6kpro-asus-rtxpro6000-nvidia-smi-q-gpu0-fabric-na.txt"}
    )
    assert node.gpus[0].pci_bus_id == "0000:06:00.0" and node.nvlink_domains == []


def test_lspci_tree_asus_matches_its_nvidia_smi_matrix() -> None:
    tree = parse_lspci_tree(
        (LSPCI / "asus-esc8000a-e12-4x-rtx6000ada-cx7-lspci-tv.txt").read_text()
    )
    gpus = [d.bus_id for d in tree.gpus()]
    assert gpus == ["0000:01:00.0", "0000:41:00.0", "0000:c1:00.0", "0000:e1:00.0"]
    cx7 = [d.bus_id for d in tree.devices.values() if d.is_rdma_nic]
    assert cx7 == ["0000:21:00.0", "0000:21:00.1", "0000:81:00.0", "0000:81:00.1"]
    assert tree.bridges_above("0000:01:00.0") == ["0000:00:01.1"]
    # roots 00/20/40/60 are socket 0, 80/a0/c0/e0 socket 1 (the matrix's NUMA Affinity)
    numa = {r: (0 if int(r.split(":")[1], 16) < 0x80 else 1) for r in tree.roots}
    assert tree.path_type("0000:01:00.0", "0000:41:00.0", numa) == "NODE"  # GPU0-GPU1
    assert tree.path_type("0000:01:00.0", "0000:c1:00.0", numa) == "SYS"  # GPU0-GPU2
    assert tree.path_type("0000:21:00.0", "0000:21:00.1", numa) == "PIX"  # NIC0-NIC1
    assert tree.path_type("0000:c1:00.0", "0000:81:00.0", numa) == "NODE"  # GPU2-NIC2
    # NVMe behind two switch levels on root 60
    assert tree.path_type("0000:65:00.0", "0000:66:00.0") == "PIX"
    assert tree.path_type("0000:65:00.0", "0000:6b:00.0") == "PXB"


def test_lspci_tree_puget_gpus_phb() -> None:
    tree = parse_lspci_tree(
        (LSPCI / "puget-wrx90-threadripper-2x-rtx6000ada-cx7-lspci-tv.txt").read_text()
    )
    (a, b) = [d.bus_id for d in tree.gpus()]
    assert (a, b) == ("0000:c1:00.0", "0000:c2:00.0")
    assert tree.path_type(a, b) == "PHB"  # same matrix answer as the puget topo fixture
    assert {d.bus_id for d in tree.devices.values() if d.is_rdma_nic} == {
        "0000:21:00.0",
        "0000:21:00.1",
    }


def test_lspci_vvv_gpu_details() -> None:
    (gpu,) = parse_lspci_listing(
        (LSPCI / "asus-esc8000a-e12-rtx6000ada-lspci-vvv-gpu0.txt").read_text()
    )
    assert gpu.bus_id == "0000:01:00.0" and gpu.is_gpu and gpu.numa_node == 0
    assert (gpu.link_cap_gts, gpu.link_cap_width) == (16.0, 16)
    assert gpu.link_speed_gts == 2.5 and gpu.link_downgraded
    assert gpu.link_cap_gbps == pytest.approx(31.5, abs=0.05)
    assert gpu.driver == "nvidia"


def test_lspci_vvv_switch_excerpt() -> None:
    devs = parse_lspci_listing(
        (LSPCI / "rtx6kpro-asus-pex890xx-switch-to-rtxpro6000-lspci-vvv-excerpt.txt").read_text()
    )
    gpus = [d for d in devs if d.is_gpu]
    assert [g.bus_id for g in gpus] == ["0000:06:00.0"]
    (switch,) = switches_from_listing(devs)
    assert switch.upstream == "0000:01:00.0" and len(switch.downstream) == 6
    usp = next(d for d in devs if d.bus_id == "0000:01:00.0")
    assert usp.port_type == "Upstream Port" and usp.secondary_bus == "02"
    assert usp.link_cap_gts == 32.0


def test_plain_lspci_grep_plx_switches() -> None:
    devs = parse_lspci_listing(
        (LSPCI / "nccl-19-supermicro-7048gr-plx-pex8747-lspci-grep.txt").read_text()
    )
    assert len(devs) == 8 and all(d.is_bridge for d in devs)
    switches = {s.upstream: s.downstream for s in switches_from_listing(devs)}
    assert switches["0000:03:00.0"] == ["0000:04:08.0", "0000:04:10.0"]
    assert switches["0000:82:00.0"] == ["0000:83:08.0", "0000:83:10.0"]


def test_lspci_tree_refuses_a_listing() -> None:
    with pytest.raises(ParseError):
        parse_lspci_tree(
            (LSPCI / "nccl-19-supermicro-7048gr-plx-pex8747-lspci-grep.txt").read_text()
        )


def test_node_from_lspci_tree_only() -> None:
    node = discover_from_files(
        {"lspci": LSPCI / "asus-esc8000a-e12-4x-rtx6000ada-cx7-lspci-tv.txt"}
    )
    assert next(g.pci_bus_id for g in node.gpus) == "0000:01:00.0"
    link = node.link("GPU0", "GPU1")
    assert link is not None and link.type == "NODE" and link.source == "lspci -t"
