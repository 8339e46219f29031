"""numactl -H / lscpu parsers and the CPU-list helper: fixtures, real output, fuzzing."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from fuzzing import fuzz_arbitrary_text, fuzz_mutated_fixtures
from hypothesis import strategies as st

from topkv.topology.detect.errors import ParseError
from topkv.topology.detect.numa import (
    LscpuInfo,
    NumaNodeInfo,
    parse_cpu_list,
    parse_lscpu,
    parse_numactl_hardware,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "numa"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


# --------------------------------------------------------------------------- cpu lists


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0-3,8,10-11", (0, 1, 2, 3, 8, 10, 11)),
        ("", ()),
        ("5", (5,)),
        ("0 1 2 3", (0, 1, 2, 3)),
        (" 64-66,192-193 \n", (64, 65, 66, 192, 193)),
        ("0-15:2/4", (0, 1, 4, 5, 8, 9, 12, 13)),
        ("3,1,1-2", (1, 2, 3)),
    ],
)
def test_parse_cpu_list(text: str, cpus: tuple[int, ...]) -> None:
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["0-", "a-b", "5-3", "0-99999999", "1;2", "0-7:0/0", "0-7:2"])
def test_parse_cpu_list_rejects_bad_lists(text: str) -> None:
    with pytest.raises(ParseError, match="CPU list"):
        parse_cpu_list(text)


# --------------------------------------------------------------------------- numactl


def test_numactl_asus_two_sockets_no_smt() -> None:
    nodes = parse_numactl_hardware(fixture("asus-esc8000a-e12-epyc9374f-numactl-hardware.txt"))
    assert nodes == [
        NumaNodeInfo(0, tuple(range(32)), 193129, 186031, (10, 32)),
        NumaNodeInfo(1, tuple(range(32, 64)), 193477, 186364, (32, 10)),
    ]
    assert not any(n.cpuless for n in nodes)


def test_numactl_cpu239_offline_trailing_spaces() -> None:
    n0, n1 = parse_numactl_hardware(
        fixture("rtx6kpro-asus-epyc9575f-2s-numactl-H-cpu239-offline.txt")
    )
    assert n0.cpus == tuple(range(64)) + tuple(range(128, 192))
    assert n1.cpus == tuple(range(64, 128)) + tuple(range(192, 239)) + tuple(range(240, 256))
    assert 239 not in n1.cpus and len(n1.cpus) == 127
    assert (n0.memory_mb, n0.free_mb, n1.memory_mb, n1.free_mb) == (773676, 770559, 774030, 770590)
    assert (n0.distances, n1.distances) == ((10, 32), (32, 10))


def test_numactl_cpuless_node_and_sparse_ids() -> None:
    text = (
        "available: 2 nodes (0,2)\nnode 0 cpus: 0 1 2 3\nnode 0 size: 64000 MB\n"
        "node 0 free: 60000 MB\nnode 2 cpus:\nnode 2 size: 98304 MB\nnode 2 free: 98000 MB\n"
        "node distances:\nnode     0    2\n  0:   10   40\n  2:   40   10\n"
    )
    n0, n2 = parse_numactl_hardware(text)
    assert (n0.node_id, n2.node_id) == (0, 2)
    assert n2.cpuless and not n0.cpuless
    assert n2.memory_mb == 98304 and n2.distances == (40, 10)


def test_numactl_truncated_distance_table() -> None:
    text = fixture("asus-esc8000a-e12-epyc9374f-numactl-hardware.txt").rsplit("\n", 2)[0]
    nodes = parse_numactl_hardware(text)
    assert [n.distances for n in nodes] == [(10, 32), None]


@pytest.mark.parametrize(
    ("value", "mb"),
    [
        ("7B", 0),
        ("3145728 B", 3),
        ("2048 kB", 2),
        ("512 MB", 512),
        ("2 GiB", 2048),
        ("1 TB", 1 << 20),
    ],
)
def test_numactl_memory_units(value: str, mb: int) -> None:
    # found by the mutation fuzzer: a bare byte unit ("7B") raised KeyError, not ParseError
    (node,) = parse_numactl_hardware(f"node 0 cpus: 0 1\nnode 0 size: {value}\n")
    assert node.memory_mb == mb


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("No NUMA available on this system\n", "No NUMA"),
        ("Architecture: x86_64\n", "no 'node N"),
        ("node 0 size: lots MB\n", "memory"),
    ],
)
def test_numactl_errors(text: str, message: str) -> None:
    with pytest.raises(ParseError, match=message):
        parse_numactl_hardware(text)


# --------------------------------------------------------------------------- lscpu


def test_lscpu_old_flat_format_eight_nodes_wrapped_flags() -> None:
    info = parse_lscpu(fixture("a100-sxm40g-8gpu-epyc7742-nps4-lscpu.txt"))
    assert info.model_name == "AMD EPYC 7742 64-Core Processor"
    assert (info.sockets, info.cores_per_socket, info.threads_per_core) == (2, 64, 2)
    assert info.online_cpus == tuple(range(256)) and info.offline_cpus == ()
    assert sorted(info.numa_nodes) == list(range(8))
    assert info.numa_nodes[0] == tuple(range(16)) + tuple(range(128, 144))
    assert info.numa_nodes[7] == tuple(range(112, 128)) + tuple(range(240, 256))


def test_lscpu_modern_offline_cpu() -> None:
    info = parse_lscpu(fixture("rtx6kpro-asus-epyc9575f-2s-lscpu-cpu239-offline.txt"))
    assert info.model_name == "AMD EPYC 9575F 64-Core Processor"
    assert (info.sockets, info.cores_per_socket, info.threads_per_core) == (2, 64, 2)
    assert info.offline_cpus == (239,)
    assert len(info.online_cpus) == 255 and 239 not in info.online_cpus
    assert info.numa_nodes == {
        0: tuple(range(64)) + tuple(range(128, 192)),
        1: tuple(range(64, 128)) + tuple(range(192, 239)) + tuple(range(240, 256)),
    }


def test_lscpu_gh200_section_with_cpuless_nodes() -> None:
    info = parse_lscpu(fixture("xpu-perf-129-gh200-lscpu-numa-section-cpuless-nodes.txt"))
    assert info.numa_nodes[0] == tuple(range(72))
    assert sorted(info.numa_nodes) == list(range(9))
    assert all(info.numa_nodes[n] == () for n in range(1, 9))
    assert info == LscpuInfo(None, None, None, None, (), (), info.numa_nodes)


def test_lscpu_json_and_arm_dash_sockets() -> None:
    doc = {
        "lscpu": [
            {"field": "Architecture:", "data": "aarch64"},
            {"field": "On-line CPU(s) list:", "data": "0-71"},
            {
                "field": "Vendor ID:",
                "data": "ARM",
                "children": [
                    {"field": "Model name:", "data": "Neoverse-V2"},
                    {"field": "Thread(s) per core:", "data": "1"},
                    {"field": "Socket(s):", "data": "-"},
                ],
            },
            {"field": "NUMA node0 CPU(s):", "data": "0-71"},
            {"field": "NUMA node1 CPU(s):", "data": ""},
        ]
    }
    info = parse_lscpu(json.dumps(doc))
    assert (info.model_name, info.sockets, info.threads_per_core) == ("Neoverse-V2", None, 1)
    assert info.numa_nodes == {0: tuple(range(72)), 1: ()}


@pytest.mark.skipif(shutil.which("lscpu") is None, reason="lscpu not installed")
@pytest.mark.parametrize("args", [[], ["-J"]])
def test_lscpu_on_this_machine(args: list[str]) -> None:
    out = subprocess.run(["lscpu", *args], capture_output=True, text=True, check=True).stdout
    info = parse_lscpu(out)
    assert info.online_cpus, "this machine has CPUs"
    assert set(info.online_cpus) <= set(range(4096))
    assert all(set(cpus) <= set(info.online_cpus) for cpus in info.numa_nodes.values())


@pytest.mark.parametrize(
    ("text", "message"),
    [("", "empty"), ("hello world\n", "no known fields"), ("Socket(s): two\n", "Socket")],
)
def test_lscpu_errors(text: str, message: str) -> None:
    with pytest.raises(ParseError, match=message):
        parse_lscpu(text)


# --------------------------------------------------------------------------- fuzzing

ALL_TEXTS = [p.read_text() for p in sorted(FIXTURES.iterdir())]
ALPHABET = st.sampled_from(list("nodecpusizfreNUMAC()lst0123456789 \t\n:-,MBkK\x1b"))


def _only_parse_errors(text: str) -> None:
    for parser in (parse_numactl_hardware, parse_lscpu, parse_cpu_list):
        with contextlib.suppress(ParseError):
            parser(text)


@fuzz_arbitrary_text(ALPHABET)
def test_fuzz_arbitrary_text(text: str) -> None:
    _only_parse_errors(text)


@fuzz_mutated_fixtures(ALL_TEXTS, ALPHABET)
def test_fuzz_mutated_fixtures(text: str) -> None:
    _only_parse_errors(text)
