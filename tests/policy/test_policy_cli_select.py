"""``topkv select`` end to end: a real process reading a topology file."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from topkv.cli.select import parse_byte_size, parse_in_flight
from topkv.errors import ConfigError
from topkv.jsonout import loads_strict
from topkv.topology.model import Cluster

H100_NV18 = "sglang-30401-h100-8gpu-nv18-8nic.txt"


def topkv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from topkv.cli.main import app; app()", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def topology_file(tmp_path: Path, two_node_cluster: Callable[[str, str], Cluster]) -> Path:
    path = tmp_path / "topology.json"
    path.write_text(two_node_cluster(H100_NV18, "NVIDIA H100 80GB HBM3").model_dump_json())
    return path


def test_select_json_lists_every_candidate(topology_file: Path) -> None:
    common = ["select", "--topology", str(topology_file), "--bytes", "1.34GB", "--json"]
    local = topkv(*common, "--src", "node-0:0", "--dst", "node-0:1")
    assert local.returncode == 0, local.stderr
    data = loads_strict(local.stdout)
    assert (data["policy"], data["choice"], data["bytes"]) == ("cost", "nvlink", 1_340_000_000)
    assert sorted(c["transport"] for c in data["candidates"]) == ["nvlink", "pcie", "rdma", "tcp"]
    estimates = [c["estimated_s"] for c in data["candidates"]]
    assert estimates == sorted(estimates)
    remote = topkv(*common, "--src", "node-0:0", "--dst", "node-1:0", "--policy", "paper")
    assert loads_strict(remote.stdout)["choice"] == "rdma"
    busy = topkv(
        *common,
        "--src",
        "node-0:0",
        "--dst",
        "node-1:0",
        "--in-flight",
        "node-0:mlx5_0=20GB",
        "--in-flight",
        "node-0:mlx5_0=20GB",
    )
    data = loads_strict(busy.stdout)
    assert data["choice"] == "tcp"
    assert data["candidates"][1]["bottleneck_link"] == "node-0:mlx5_0"


def test_select_table(topology_file: Path) -> None:
    result = topkv(
        "select",
        "-t",
        str(topology_file),
        "--src",
        "node-0:0",
        "--dst",
        "node-0:4",
        "--bytes",
        "256MiB",
        "--chunks",
        "80",
    )
    assert result.returncode == 0, result.stderr
    # GPU0 -> GPU4 cross sockets: PCIe is SYS (7.88 GB/s), so NIC loopback (25 GB/s) ranks
    # above it as the first fallback
    assert "choice: nvlink" in result.stdout
    assert "fallbacks:" in result.stdout
    assert " ".join(result.stdout.split("fallbacks:")[1].split()) == "rdma, pcie, tcp"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bytes", "1.34XB"], "is not a byte count"),
        (["--bytes", "1GB", "--override", "nvlink"], "has no nvlink path"),
        (["--bytes", "1GB", "--policy", "fastest"], "unknown selection policy"),
    ],
)
def test_select_errors_are_one_line(topology_file: Path, args: list[str], message: str) -> None:
    result = topkv(
        "select", "-t", str(topology_file), "--src", "node-0:0", "--dst", "node-1:0", *args
    )
    assert result.returncode == 2
    assert result.stderr.startswith("topkv: error:") and message in result.stderr
    assert "Traceback" not in result.stderr


def test_select_missing_topology_file(tmp_path: Path) -> None:
    result = topkv(
        "select",
        "-t",
        str(tmp_path / "none.json"),
        "--src",
        "a:0",
        "--dst",
        "b:0",
        "--bytes",
        "1GB",
    )
    assert result.returncode == 2 and "cannot read topology file" in result.stderr


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1340000000", 1_340_000_000),
        ("1.34GB", 1_340_000_000),
        ("256MiB", 268_435_456),
        ("4 KiB", 4096),
        ("0", 0),
    ],
)
def test_byte_sizes(text: str, expected: int) -> None:
    assert parse_byte_size(text) == expected


@given(st.integers(min_value=0, max_value=2**60), st.sampled_from(["", "B", "KiB", "MB", "GiB"]))
def test_byte_size_scales_by_unit(value: int, unit: str) -> None:
    factor = {"": 1, "B": 1, "KiB": 1024, "MB": 10**6, "GiB": 2**30}[unit]
    assert parse_byte_size(f"{value}{unit}") == value * factor


@given(st.text(max_size=20))
def test_byte_size_parses_or_refuses_cleanly(text: str) -> None:
    try:
        assert parse_byte_size(text) >= 0
    except ConfigError as exc:
        assert "byte count" in str(exc)


def test_in_flight_items() -> None:
    load = parse_in_flight(["n0:nic0=1GB", "n0:nic0=1GB", "n1:tcp=5"])
    assert (load.bytes_on("n0:nic0"), load.flows_on("n0:nic0")) == (2 * 10**9, 2)
    with pytest.raises(ConfigError, match="LINK=SIZE"):
        parse_in_flight(["nic0"])
