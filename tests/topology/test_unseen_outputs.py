"""Real tool outputs that the parsers were not written against (tests/topology/data/unseen).

Every expectation below was read off the saved output by eye (see SOURCES.md there for
where each file comes from), not produced by running the parser.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from topkv.topology.detect import k8s, lspci, numa, nvidia_smi, rdma

DATA = Path(__file__).resolve().parent / "data" / "unseen"


def text(kind: str, name: str) -> str:
    return (DATA / kind / f"{name}.txt").read_text()


def topo(name: str) -> nvidia_smi.TopoMatrix:
    return nvidia_smi.parse_topo_matrix(text("nvidia-smi-topo", name))


def test_every_unseen_file_is_listed_in_sources() -> None:
    sources = (DATA / "SOURCES.md").read_text()
    files = sorted(p.relative_to(DATA).as_posix() for p in DATA.rglob("*.txt"))
    assert len(files) >= 25
    missing = [f for f in files if f not in sources]
    assert missing == []


# --------------------------------------------------------------------------- topo -m

# DGX-1 V100 hybrid cube mesh as printed by nvidia-smi (same matrix in both V100 files).
DGX1_NV2 = {(0, 3), (0, 4), (1, 2), (1, 5), (2, 3), (4, 7), (5, 6), (6, 7)}
DGX1_NV1 = {(0, 1), (0, 2), (1, 3), (2, 6), (3, 7), (4, 5), (4, 6), (5, 7)}


def assert_dgx1_mesh(m: nvidia_smi.TopoMatrix) -> None:
    pairs = {(a, b): t for a, b, t in m.gpu_pairs()}
    assert len(pairs) == 28
    assert {p for p, t in pairs.items() if t == "NV2"} == DGX1_NV2
    assert {p for p, t in pairs.items() if t == "NV1"} == DGX1_NV1
    assert sum(1 for t in pairs.values() if t == "SYS") == 12


def test_dlperf_dgx1_v100_in_markdown_fence_with_legend() -> None:
    m = topo("dlperf-dgx1-v100-hybrid-cube-mesh-fenced-legend")
    assert m.gpu_indices == list(range(8))
    assert [n.name for n in m.nics] == ["mlx5_0"]
    assert_dgx1_mesh(m)
    assert m.path("GPU2", "mlx5_0") == "PIX" and m.path("GPU3", "mlx5_0") == "PIX"
    assert m.path("GPU0", "mlx5_0") == "NODE" and m.path("GPU7", "mlx5_0") == "SYS"
    assert m.rows[0].cpu_affinity_text == "0-11,24-35"
    assert m.rows[5].cpu_affinity == list(range(12, 24)) + list(range(36, 48))
    assert m.rows[5].numa_affinity == []  # this old nvidia-smi had no NUMA column
    assert m.warnings == []


def test_v100_nic0_gpu_numa_id_na_in_txt_fence() -> None:
    m = topo("v100-8gpu-nv1-nv2-nic0-gpu-numa-id-txt-fence")
    assert_dgx1_mesh(m)
    assert [n.label for n in m.nics] == ["NIC0"]
    assert {g for g, _, t in m.gpu_nic_pairs() if t == "PIX"} == {4, 5}
    assert [m.rows[g].numa_affinity for g in (0, 3, 4, 7)] == [[0], [0], [1], [1]]
    assert all(m.rows[g].gpu_numa_id is None for g in range(8))  # "N/A"
    assert m.rows[4].cpu_affinity == [4, 5, 6, 7, 12, 13, 14, 15]


def test_nersc_shell_comment_prefixed_matrix_with_mlx4_and_mlx5_columns() -> None:
    m = topo("nersc-cgpu-v100-hash-commented-mlx4-mlx5")
    assert m.gpu_indices == list(range(8))
    assert [n.name for n in m.nics] == ["mlx4_0"] + [f"mlx5_{i}" for i in range(8)]
    assert_dgx1_mesh(m)
    # each GPU pair shares a PIX pair of NICs: GPU0/1 -> mlx5_0/1 ... GPU6/7 -> mlx5_6/7
    for g in range(8):
        pix = sorted(n for gg, n, t in m.gpu_nic_pairs() if gg == g and t == "PIX")
        first = 2 * (g // 2)
        assert pix == [f"mlx5_{first}", f"mlx5_{first + 1}"]
    assert m.path("GPU0", "mlx4_0") == "SYS" and m.path("GPU4", "mlx4_0") == "NODE"
    assert m.path("mlx5_0", "mlx5_1") == "PIX"
    assert m.rows[7].cpu_affinity_text == "20-39,60-79" and m.rows[7].numa_affinity == [1]
    assert m.warnings == []


def test_juwels_booster_topo_mp_hash_commented_tabs_nps4() -> None:
    m = topo("icon-juwels-booster-a100-topo-mp-hash-commented-tabs")
    assert m.gpu_indices == [0, 1, 2, 3]
    assert [n.name for n in m.nics] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    assert {t for _, _, t in m.gpu_pairs()} == {"SYS"} and len(m.gpu_pairs()) == 6
    pix = sorted((g, n) for g, n, t in m.gpu_nic_pairs() if t == "PIX")
    assert pix == [(0, "mlx5_0"), (1, "mlx5_1"), (2, "mlx5_2"), (3, "mlx5_3")]
    assert [m.rows[g].numa_affinity for g in range(4)] == [[3], [1], [7], [5]]
    assert m.rows[2].cpu_affinity_text == "42-47,90-95"


def test_rtx4090_all_sys_tabs_empty_numa_cell_and_phb_nics() -> None:
    m = topo("go-gpuallocator-17-8x-rtx4090-all-sys-tabs")
    assert m.gpu_indices == list(range(8))
    assert {t for _, _, t in m.gpu_pairs()} == {"SYS"} and len(m.gpu_pairs()) == 28
    phb = sorted((g, n) for g, n, t in m.gpu_nic_pairs() if t == "PHB")
    assert phb == [(6, "NIC0"), (6, "NIC1")]
    assert m.path("NIC0", "NIC1") == "PIX"
    assert m.rows[3].cpu_affinity_text == "0-55,112-167" and m.rows[3].numa_affinity == [0]
    assert m.rows[4].cpu_affinity_text == "56-111,168-223" and m.rows[4].numa_affinity == [1]
    assert all(m.rows[g].gpu_numa_id is None for g in range(8))


def test_two_gpu_sys_no_nic() -> None:
    m = topo("qwen-vllm-notes-2gpu-sys-no-nic")
    assert m.gpu_indices == [0, 1] and m.nics == []
    assert m.gpu_pairs() == [(0, 1, "SYS")]
    assert m.rows[1].cpu_affinity == [4, 5, 6, 7, 12, 13, 14, 15]
    assert m.rows[1].numa_affinity == [1]


def test_dgx_a100_twelve_nics_partial_rows() -> None:
    m = topo("nccl-1505-dgx-a100-40gb-12nic-partial")
    assert m.gpu_indices == list(range(8))
    assert [n.label for n in m.nics] == [f"NIC{i}" for i in range(12)]
    assert {t for _, _, t in m.gpu_pairs()} == {"NV12"}
    # rows GPU0-GPU3 were kept: every pair touching one of them is known
    assert len(m.gpu_pairs()) == 28 - 6  # the 6 pairs among GPU4-7 are not shown
    pxb = sorted((g, n) for g, n, t in m.gpu_nic_pairs() if t == "PXB")
    expected = [(g, f"NIC{n}") for g in (0, 1) for n in (0, 1)]
    expected += [(g, f"NIC{n}") for g in (2, 3) for n in (2, 3)]
    assert pxb == expected
    assert m.rows[2].cpu_affinity_text == "16-31,144-159" and m.rows[2].numa_affinity == [1]
    assert any("partial output" in w for w in m.warnings)


def test_slurm_two_visible_a100_ten_nics_header_indent_6() -> None:
    m = topo("dask-cuda-1358-slurm-2-of-8-a100-10nic-partial")
    assert m.gpu_indices == [0, 1]
    assert len(m.nics) == 10
    assert m.gpu_pairs() == [(0, 1, "NV12")]
    assert sorted(n for g, n, t in m.gpu_nic_pairs() if g == 0 and t == "PXB") == ["NIC0", "NIC1"]
    assert m.path("NIC2", "NIC3") == "PXB"
    assert m.rows[1].numa_affinity == [3]


def test_four_h100_nv6_sparse_cpu_affinity_lists() -> None:
    m = topo("nccl-1617-4x-h100-nv6-4nic-pix-legend-partial")
    assert {t for _, _, t in m.gpu_pairs()} == {"NV6"} and len(m.gpu_pairs()) == 6
    pix = sorted((g, n) for g, n, t in m.gpu_nic_pairs() if t == "PIX")
    assert pix == [(0, "NIC0"), (1, "NIC1"), (2, "NIC2"), (3, "NIC3")]
    assert m.rows[0].cpu_affinity == [6, 14, 22, 30] and m.rows[0].numa_affinity == [3]
    assert m.rows[3].cpu_affinity == [5, 13, 21, 29] and m.rows[3].numa_affinity == [5]
    assert m.warnings == []


def test_2017_matrix_with_prompt_trailing_spaces_mlx4_and_phb() -> None:
    m = topo("k8s-53497-8gpu-pix-pairs-mlx4-trailing-spaces-partial")
    assert m.gpu_indices == list(range(8))
    assert [n.name for n in m.nics] == ["mlx4_0"]
    assert m.path("GPU0", "GPU1") == "PIX" and m.path("GPU2", "GPU3") == "PIX"
    assert m.path("GPU0", "GPU2") == "PHB" and m.path("GPU1", "GPU4") == "SYS"
    assert [t for g, _, t in m.gpu_nic_pairs()] == ["PHB"] * 4  # only GPU0-3 rows shown
    assert m.rows[3].cpu_affinity_text == "0-9,20-29"


@pytest.mark.parametrize(
    "name",
    [
        "dlperf-dgx1-v100-hybrid-cube-mesh-fenced-legend",
        "icon-juwels-booster-a100-topo-mp-hash-commented-tabs",
        "go-gpuallocator-17-8x-rtx4090-all-sys-tabs",
        "nersc-cgpu-v100-hash-commented-mlx4-mlx5",
    ],
)
def test_topo_same_result_with_windows_line_endings(name: str) -> None:
    plain = topo(name)
    crlf = nvidia_smi.parse_topo_matrix(text("nvidia-smi-topo", name).replace("\n", "\r\n"))
    assert crlf.cells == plain.cells and crlf.rows == plain.rows


# --------------------------------------------------------------------------- nvlink


def test_a100_nvlink_status_tab_space_indent_and_dots() -> None:
    gpus = nvidia_smi.parse_nvlink(
        text("nvlink", "nccl-tests-228-a100-sxm4-80gb-nvlink-status-tab-space-dots")
    )
    assert [g.index for g in gpus] == [0, 1, 2]
    assert gpus[0].name == "NVIDIA A100-SXM4-80GB"
    assert gpus[1].uuid == "GPU-0c512562-871f-8257-6187-b5ae1b986d5e"
    assert [len(g.active_links) for g in gpus] == [12, 12, 1]
    assert {lk.speed_gbps for g in gpus for lk in g.links} == {25.0}


def test_v100_nvlink_s_inactive_links_redacted_uuid() -> None:
    gpus = nvidia_smi.parse_nvlink(
        text("nvlink", "azhpc-diagnostics-73-v100-nvlink-s-inactive-redacted-uuid")
    )
    assert len(gpus) == 1 and gpus[0].index == 3
    assert gpus[0].name == "Tesla V100-SXM2-32GB"
    assert [lk.link for lk in gpus[0].links if not lk.active] == [3, 5]
    assert [lk.speed_gbps for lk in gpus[0].active_links] == [25.781] * 4


# --------------------------------------------------------------------------- RDMA


def ports(parser: object, name: str) -> dict[tuple[str, int], rdma.RdmaPort]:
    assert callable(parser)
    return {(p.device, p.port): p for p in parser(text("rdma", name))}


def test_cx7_roce_200g_ibstat_and_cut_cx6dx_record() -> None:
    got = ports(rdma.parse_ibstat, "mooncake-1999-cx7-roce-200g-ibstat-partial")
    assert sorted(got) == [("mlx5_0", 1), ("mlx5_1", 1), ("mlx5_10", 1)]
    for dev in ("mlx5_0", "mlx5_1"):
        p = got[(dev, 1)]
        assert (p.state, p.phys_state, p.rate_gbps, p.link_layer) == (
            "ACTIVE",
            "LinkUp",
            200.0,
            "Ethernet",
        )
        assert p.ca_type == "MT4129" and p.fw_version == "28.39.1002"
    assert got[("mlx5_1", 1)].node_guid == "0x58a2e10300dae627"
    assert (got[("mlx5_10", 1)].state, got[("mlx5_10", 1)].phys_state) == ("DOWN", "Disabled")


def test_ibstat_after_log_banner_two_roce_100g() -> None:
    got = ports(rdma.parse_ibstat, "l2fwd-nv-6-cx6dx-roce-100g-ibstat-log-header")
    assert sorted(got) == [("mlx5_0", 1), ("mlx5_1", 1)]
    assert {(p.state, p.rate_gbps, p.link_layer, p.ca_type) for p in got.values()} == {
        ("ACTIVE", 100.0, "Ethernet", "MT4125")
    }


def test_ibstat_with_ibwarn_debug_lines_two_port_mlx4() -> None:
    got = ports(rdma.parse_ibstat, "rdma-core-847-mlx4-2port-ibstat-with-ibwarn-debug-partial")
    assert sorted(got) == [("mlx4_0", 1), ("mlx4_0", 2)]
    p1, p2 = got[("mlx4_0", 1)], got[("mlx4_0", 2)]
    assert (p1.state, p1.phys_state, p1.rate_gbps, p1.link_layer) == (
        "DOWN",
        "Disabled",
        10.0,
        "InfiniBand",
    )
    assert p1.lid == 38 and p1.ca_type == "MT4099"
    assert (p2.state, p2.phys_state, p2.rate_gbps) == ("ACTIVE", "LinkUp", 56.0)


def test_ibstat_with_redacted_fields_and_ibpanic_line() -> None:
    got = ports(rdma.parse_ibstat, "gpud-752-ibstat-redacted-fields-ibpanic")
    assert list(got) == [("mlx5_7", 1)]  # mlx5_8 only appears in the ibpanic error
    p = got[("mlx5_7", 1)]
    assert (p.state, p.rate_gbps, p.link_layer, p.lid) == ("ACTIVE", 200.0, "InfiniBand", 13305)
    assert p.node_guid is None  # "Node GUID: ..." is not a GUID


def test_ibstat_h20_down_roce_ports_and_cut_port() -> None:
    got = ports(rdma.parse_ibstat, "sglang-6823-h20-3e-ibstat-mixed-cx6dx-cx7-partial")
    for dev in ("mlx5_0", "mlx5_1"):
        p = got[(dev, 1)]
        assert (p.state, p.phys_state, p.rate_gbps, p.link_layer) == (
            "DOWN",
            "Disabled",
            40.0,
            "Ethernet",
        )
    cut = got.get(("mlx5_10", 1))
    assert cut is None or cut.state is None  # "Port 1:" with nothing after it


def test_ibv_devinfo_port_down_roce_and_hca_without_port() -> None:
    got = ports(rdma.parse_ibv_devinfo, "deepep-60-ibv-devinfo-cx6dx-roce-down-partial")
    p = got[("mlx5_12", 1)]
    assert (p.state, p.link_layer, p.lid, p.fw_version) == ("DOWN", "Ethernet", 0, "22.38.1900")
    assert p.node_guid == "0xa088c20300309a0d" and p.ca_type == "MT4125"
    assert ("mlx5_13", 1) not in got  # the paste stops before its port section


def test_ibv_devinfo_azure_renamed_hca_after_prompt() -> None:
    got = ports(rdma.parse_ibv_devinfo, "azhpc-images-44-azure-vm-ibv-devinfo-renamed-hca-partial")
    p = got[("rdmaP23800p0s2", 1)]
    assert (p.state, p.link_layer, p.fw_version) == ("ACTIVE", "Ethernet", "14.25.8102")
    assert p.node_guid == "0x000d3afffeac5a53"


def test_ibv_devinfo_soft_roce_without_link_layer_line() -> None:
    got = ports(rdma.parse_ibv_devinfo, "softroce-rxe-46-rxe0-ibv-devinfo-no-link-layer")
    p = got[("rxe0", 1)]
    assert p.state == "ACTIVE" and p.link_layer is None and p.fw_version == "0.0.0"
    assert p.node_guid == "0x428d5cfffe35bb12"


def test_rdma_link_show_between_prompts_with_trailing_spaces() -> None:
    got = ports(rdma.parse_rdma_link, "3fs-283-cx6dx-rdma-link-show-prompts")
    assert sorted(got) == [("mlx5_0", 1), ("mlx5_1", 1)]
    assert got[("mlx5_0", 1)].netdev == "p1p1" and got[("mlx5_1", 1)].netdev == "p1p2"
    assert {(p.state, p.phys_state) for p in got.values()} == {("ACTIVE", "LinkUp")}


# --------------------------------------------------------------------------- NUMA / lscpu


def test_numactl_threadripper_nps4_nodes_with_cpus_but_no_memory() -> None:
    nodes = numa.parse_numactl_hardware(
        text("numa", "numactl-165-threadripper-3960x-nps4-memoryless-cpu-nodes")
    )
    assert [n.node_id for n in nodes] == [0, 1, 2, 3]
    assert nodes[0].cpus == (0, 1, 2, 3, 4, 5, 24, 25, 26, 27, 28, 29)
    assert [n.memory_mb for n in nodes] == [0, 64307, 64472, 0]
    assert [n.free_mb for n in nodes] == [0, 19214, 27945, 0]
    assert not any(n.cpuless for n in nodes)  # memory-less, not CPU-less
    assert nodes[2].distances == (12, 12, 10, 12)


def test_numactl_hardware_after_command_banner_c5n() -> None:
    nodes = numa.parse_numactl_hardware(
        text("numa", "aws-c-s3-403-c5n-18xlarge-numactl-hardware-command-prefix")
    )
    assert [len(n.cpus) for n in nodes] == [36, 36]
    assert nodes[1].cpus[:3] == (18, 19, 20) and nodes[1].cpus[-1] == 71
    assert nodes[0].memory_mb == 94590 and nodes[1].free_mb == 79679
    assert nodes[0].distances == (10, 21)


def test_numactl_eight_nodes_cut_after_node2() -> None:
    nodes = numa.parse_numactl_hardware(text("numa", "sonar-358-8-node-numactl-H-partial"))
    assert [n.node_id for n in nodes] == [0, 1, 2]
    assert nodes[1].cpus == tuple(range(16, 32)) and nodes[2].free_mb == 58687
    assert all(n.distances is None for n in nodes)


def test_lscpu_from_jira_html_with_blank_lines() -> None:
    info = numa.parse_lscpu(text("numa", "fdio-csit-2553-lscpu-jira-html-blank-lines"))
    assert (info.sockets, info.cores_per_socket, info.threads_per_core) == (2, 12, 1)
    assert info.online_cpus == tuple(range(24))
    assert info.numa_nodes == {0: tuple(range(12)), 1: tuple(range(12, 24))}
    assert info.model_name is None  # that lscpu printed no "Model name"


def test_lscpu_a64fx_quoted_markdown_socket_dash() -> None:
    info = numa.parse_lscpu(text("numa", "libxsmm-737-a64fx-lscpu-quoted-socket-dash"))
    assert info.model_name == "A64FX"
    assert info.sockets is None and info.cores_per_socket is None  # "Core(s) per cluster"
    assert info.online_cpus == tuple(range(48))
    assert {k: (v[0], v[-1]) for k, v in info.numa_nodes.items()} == {
        0: (0, 11),
        1: (12, 23),
        2: (24, 35),
        3: (36, 47),
    }


def test_lscpu_interleaved_numa_cpu_lists() -> None:
    info = numa.parse_lscpu(
        text("numa", "pizza-19-k8s-node6-e5-2696v4-lscpu-interleaved-numa-partial")
    )
    assert info.model_name == "Intel(R) Xeon(R) CPU E5-2696 v4 @ 2.20GHz"
    assert (info.sockets, info.cores_per_socket, info.threads_per_core) == (2, 22, 2)
    assert info.numa_nodes[0] == tuple(range(0, 88, 2))
    assert info.numa_nodes[1] == tuple(range(1, 88, 2))


def test_lscpu_single_socket_eight_numa_nodes() -> None:
    info = numa.parse_lscpu(text("numa", "kepler-1288-amd-epyc-8434p-siena-nps8-lscpu-partial"))
    assert info.model_name == "AMD EPYC 8434P 48-Core Processor"
    assert (info.sockets, info.cores_per_socket, info.threads_per_core) == (1, 48, 2)
    assert len(info.numa_nodes) == 8
    assert info.numa_nodes[7] == (42, 43, 44, 45, 46, 47, 90, 91, 92, 93, 94, 95)


# --------------------------------------------------------------------------- lspci, k8s


def test_lspci_t_am5_switch_tree_after_markdown_notes() -> None:
    tree = lspci.parse_lspci_tree(text("lspci", "club-3090-1120-am5-2gpu-switch-lspci-t"))
    assert tree.roots == ["0000:00"]
    assert "0000:03:00.0" in tree.devices and "0000:08:00.0" in tree.devices
    # 03:00.0 and 04:00.0 sit under two downstream ports of the switch on bus 02
    assert tree.path_type("0000:03:00.0", "0000:04:00.0") == "PIX"
    # 0a:00.0 hangs off root port 03.1: reaching 03:00.0 crosses the host bridge
    assert tree.path_type("0000:03:00.0", "0000:0a:00.0") == "PHB"
    assert [f"0000:0d:00.{f}" in tree.devices for f in (0, 1, 3, 4)] == [True] * 4


def test_describe_node_annotations_are_not_labels() -> None:
    nodes = k8s.parse_node_labels(text("k8s", "hami-314-k3s-a100-describe-node-no-gfd-partial"))
    assert [n.name for n in nodes] == ["416a100"]
    labels = nodes[0].labels
    assert len(labels) == 11
    assert labels["gpu"] == "on" and labels["node-role.kubernetes.io/master"] == "true"
    assert not any(k.startswith(("flannel", "hami.io")) for k in labels)
    gpu = k8s.interpret_gpu_labels(nodes[0])
    assert gpu.product is None and gpu.count is None  # no GFD on this node


def test_describe_node_nfd_labels_after_prompt() -> None:
    nodes = k8s.parse_node_labels(text("k8s", "gfd-76-g5-xlarge-describe-node-nfd-labels-partial"))
    assert [n.name for n in nodes] == ["ip-192-168-87-217.us-west-2.compute.internal"]
    labels = nodes[0].labels
    assert len(labels) == 16
    assert labels["beta.kubernetes.io/instance-type"] == "g5.xlarge"
    assert labels["feature.node.kubernetes.io/cpu-cpuid.AVX2"] == "true"


def test_get_nodes_show_labels_with_empty_values() -> None:
    nodes = k8s.parse_node_labels(
        text("k8s", "k8s-device-plugin-607-get-nodes-show-labels-akash-partial")
    )
    assert [n.name for n in nodes] == ["node1", "node10"]
    assert len(nodes[0].labels) == 11 and len(nodes[1].labels) == 9
    assert nodes[0].labels["node-role.kubernetes.io/control-plane"] == ""
    h100 = "akash.network/capabilities.gpu.vendor.nvidia.model.h100"
    assert nodes[0].labels[h100] == "8"
    assert nodes[1].labels["kubernetes.io/hostname"] == "node10"
