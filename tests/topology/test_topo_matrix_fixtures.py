"""Every nvidia-smi topo -m fixture parses into the right content (or the right error)."""

from __future__ import annotations

from pathlib import Path

import pytest

from topkv.topology.build import discover_from_files
from topkv.topology.detect.errors import NoUsableDriverError, ParseError
from topkv.topology.detect.nvidia_smi import parse_topo_matrix
from topkv.topology.paths import nearest_nics

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TOPO = FIXTURES / "nvidia-smi-topo"

# file -> (GPU count, NIC names, {(a, b): type}, {gpu: nearest NIC names}, NVL8 member count)
EXPECTED: dict[
    str, tuple[int, list[str], dict[tuple[str, str], str], dict[int, list[str]], int]
] = {
    "a100-sxm40g-8gpu-epyc7742-nps4-10nic-nv12.txt": (
        8,
        [f"mlx5_{i}" for i in range(10)],
        {("GPU0", "GPU7"): "NV12", ("GPU0", "mlx5_0"): "PXB", ("GPU7", "mlx5_9"): "SYS"},
        {0: ["mlx5_0", "mlx5_1"], 6: ["mlx5_6", "mlx5_7"]},
        8,
    ),
    "arthurchiao-8x-h20-nv18-2nic-cx6lx.txt": (
        8,
        ["NIC0", "NIC1"],
        {("GPU0", "GPU1"): "NV18", ("GPU6", "NIC0"): "PHB", ("GPU0", "NIC1"): "SYS"},
        {6: ["NIC0", "NIC1"], 4: ["NIC0", "NIC1"]},
        8,
    ),
    "asus-esc8000a-e12-4x-rtx6000ada-4nic.txt": (
        4,
        ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"],
        {("GPU0", "GPU1"): "NODE", ("GPU0", "GPU2"): "SYS", ("GPU3", "mlx5_3"): "NODE"},
        {0: ["mlx5_0", "mlx5_1"], 2: ["mlx5_2", "mlx5_3"]},
        0,
    ),
    "deepep-128-8gpu-pcie-no-nvlink-10nic-partial.txt": (
        8,
        [f"NIC{i}" for i in range(10)],
        {("GPU0", "GPU1"): "SYS", ("GPU5", "NIC5"): "PIX", ("GPU6", "GPU5"): "SYS"},
        {0: ["NIC0"], 5: ["NIC5"]},
        0,
    ),
    "nccl-1453-h100-8gpu-nv18-9nic-partial.txt": (
        8,
        [f"NIC{i}" for i in range(9)],
        {("GPU0", "GPU7"): "NV18", ("GPU0", "NIC0"): "SYS", ("GPU0", "NIC8"): "PIX"},
        {0: ["NIC8"], 7: ["NIC1"], 3: ["NIC5"]},
        8,
    ),
    "nccl-tests-78-dgx2-16gpu-nv6-10nic-partial.txt": (
        16,
        [f"mlx5_{i}" for i in range(10)],
        {("GPU0", "GPU15"): "NV6", ("GPU2", "mlx5_1"): "PIX", ("GPU0", "mlx5_2"): "NODE"},
        {0: ["mlx5_0"], 2: ["mlx5_1"]},
        16,
    ),
    "puget-wrx90-2x-rtx6000ada-phb-2nic.txt": (
        2,
        ["mlx5_0", "mlx5_1"],
        {("GPU0", "GPU1"): "PHB", ("GPU1", "mlx5_1"): "NODE"},
        {0: ["mlx5_0", "mlx5_1"]},
        0,
    ),
    "rtx6kpro-asus-8x-rtxpro6000-blackwell-pix-pairs-raw-ansi.txt": (
        8,
        [],
        {("GPU0", "GPU1"): "PIX", ("GPU0", "GPU2"): "NODE", ("GPU3", "GPU4"): "SYS"},
        {},
        0,
    ),
    "rtx6kpro-wrx90-8x-rtxpro6000-3-switchtec-pix-pxb-edited.txt": (
        8,
        [],
        {("GPU0", "GPU1"): "PIX", ("GPU0", "GPU2"): "PXB", ("GPU0", "GPU4"): "NODE"},
        {},
        0,
    ),
    "sglang-24413-h100-pcie-single-gpu-kvm-1nic.txt": (
        1,
        ["mlx5_0"],
        {("GPU0", "mlx5_0"): "PHB"},
        {0: ["mlx5_0"]},
        0,
    ),
    "sglang-30401-h100-8gpu-nv18-8nic.txt": (
        8,
        [f"mlx5_{i}" for i in range(8)],
        {("GPU0", "GPU1"): "NV18", ("GPU0", "mlx5_0"): "PIX", ("GPU4", "mlx5_0"): "SYS"},
        {i: [f"mlx5_{i}"] for i in range(8)},
        8,
    ),
    "stas-2gpu-nvlink-bridge-nv2.txt": (2, [], {("GPU0", "GPU1"): "NV2"}, {}, 2),
    "stas-h100-8gpu-nv18-hyperthreads-no-nic.txt": (8, [], {("GPU3", "GPU4"): "NV18"}, {}, 8),
    "unsloth-3872-b200-8gpu-9nic-4numa-partial.txt": (
        8,
        [f"NIC{i}" for i in range(9)],
        {("GPU0", "GPU7"): "NV18", ("GPU4", "NIC4"): "PIX", ("GPU0", "NIC8"): "NODE"},
        {0: ["NIC0"], 4: ["NIC4"]},
        8,
    ),
    "vllm-16336-b200-gpu2-without-nvlink-rows-only.txt": (
        8,
        [f"NIC{i}" for i in range(12)],
        {("GPU0", "GPU1"): "NV18", ("GPU0", "GPU2"): "NODE", ("GPU2", "GPU4"): "SYS"},
        {0: ["NIC0"], 2: ["NIC2"], 4: ["NIC4"]},
        7,
    ),
    "vllm-24139-b200-2-visible-gpus-16nic-partial.txt": (
        2,
        [f"NIC{i}" for i in range(16)],
        {("GPU0", "GPU1"): "NV18", ("GPU0", "NIC4"): "PXB", ("GPU1", "NIC7"): "PXB"},
        {0: ["NIC4"], 1: ["NIC7"]},
        2,
    ),
}

ERRORS = {
    "error-cfregly-8-topo-m-with-i-flag.txt": "-i",
    "error-wsl-13027-unable-to-determine-device-handle.txt": "device handle",
    "error-wsl-9134-nvidia-smi-failed-driver-not-loaded.txt": "driver",
}


def test_every_fixture_is_listed() -> None:
    names = {p.name for p in TOPO.iterdir()}
    covered = set(EXPECTED) | set(ERRORS) | {"rocm-smi-lib-108-4gpu-pcie-showtopo-partial.txt"}
    assert names == covered


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_topo_fixture_content(name: str) -> None:
    n_gpu, nic_names, pairs, nearest, nvl8 = EXPECTED[name]
    node = discover_from_files({"nvidia-smi-topo": TOPO / name})
    assert len(node.gpus) == n_gpu
    assert [n.name for n in node.nics] == nic_names
    for (a, b), t in pairs.items():
        link = node.link(a, b)
        assert link is not None, (a, b)
        assert link.type == t
    for gpu, names in nearest.items():
        assert [n.name for n in nearest_nics(node, gpu)] == names
    domains = [d for d in node.nvlink_domains if d.kind == "NVL8"]
    assert sum(len(d.members) for d in domains) == nvl8


def test_one_link_per_unordered_pair_in_complete_matrix() -> None:
    node = discover_from_files({"nvidia-smi-topo": TOPO / "sglang-30401-h100-8gpu-nv18-8nic.txt"})
    gpu_gpu = [lk for lk in node.links if lk.b.startswith("GPU")]
    gpu_nic = [lk for lk in node.links if not lk.b.startswith("GPU")]
    assert len(gpu_gpu) == 28 and len(gpu_nic) == 64
    assert len({frozenset((lk.a, lk.b)) for lk in node.links}) == len(node.links)


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_error_fixtures_raise_no_usable_driver(name: str) -> None:
    with pytest.raises(NoUsableDriverError, match=ERRORS[name]):
        parse_topo_matrix((TOPO / name).read_text())


def test_rocm_output_in_topo_dir_is_refused_with_a_pointer() -> None:
    text = (TOPO / "rocm-smi-lib-108-4gpu-pcie-showtopo-partial.txt").read_text()
    with pytest.raises(ParseError, match="rocm"):
        parse_topo_matrix(text)
    node = discover_from_files(
        {"rocm-smi": TOPO / "rocm-smi-lib-108-4gpu-pcie-showtopo-partial.txt"}
    )
    assert len(node.gpus) == 4 and all(g.vendor == "amd" for g in node.gpus)
    link = node.link("GPU0", "GPU3")
    assert link is not None and link.type == "PCIE" and link.transport == "pcie"


def test_affinity_columns() -> None:
    m = parse_topo_matrix((TOPO / "a100-sxm40g-8gpu-epyc7742-nps4-10nic-nv12.txt").read_text())
    assert m.rows[0].cpu_affinity[:2] == [48, 49] and m.rows[0].numa_affinity == [3]
    assert m.rows[4].numa_affinity == [7] and m.rows[0].gpu_numa_id is None
    ansi = parse_topo_matrix(
        (TOPO / "rtx6kpro-asus-8x-rtxpro6000-blackwell-pix-pairs-raw-ansi.txt").read_text()
    )
    assert 239 not in ansi.rows[7].cpu_affinity and 238 in ansi.rows[7].cpu_affinity
    dgx2 = parse_topo_matrix((TOPO / "nccl-tests-78-dgx2-16gpu-nv6-10nic-partial.txt").read_text())
    assert dgx2.rows[0].numa_affinity == [] and dgx2.rows[0].cpu_affinity_text == "0-23,48-71"


def test_headerless_matrix_is_inferred_and_noted() -> None:
    m = parse_topo_matrix((TOPO / "vllm-16336-b200-gpu2-without-nvlink-rows-only.txt").read_text())
    assert m.gpu_indices == list(range(8)) and len(m.nics) == 12
    assert any("header line missing" in w for w in m.warnings)
    assert m.rows[4].cpu_affinity_text == "56-111,168-223" and m.rows[4].numa_affinity == [1]


def test_bandwidths_follow_the_ladder() -> None:
    node = discover_from_files(
        {"nvidia-smi-topo": TOPO / "sglang-30401-h100-8gpu-nv18-8nic.txt"}, gpu_name="H100"
    )
    nv = node.link("GPU0", "GPU1")
    assert nv is not None and nv.bandwidth_gbps == 450.0 and nv.transport == "nvlink"
    b200 = discover_from_files(
        {"nvidia-smi-topo": TOPO / "unsloth-3872-b200-8gpu-9nic-4numa-partial.txt"},
        gpu_name="NVIDIA B200",
    )
    link = b200.link("GPU0", "GPU1")
    assert link is not None and link.bandwidth_gbps == 900.0
    pcie = discover_from_files(
        {"nvidia-smi-topo": TOPO / "asus-esc8000a-e12-4x-rtx6000ada-4nic.txt"}
    )
    got = {t: pcie.link("GPU0", x) for t, x in (("NODE", "GPU1"), ("SYS", "GPU2"))}
    assert got["NODE"] is not None and got["NODE"].bandwidth_gbps == 15.75
    assert got["SYS"] is not None and got["SYS"].bandwidth_gbps == 7.88
