"""KV tier discovery: the lsblk parser (real outputs, fuzzed), /sys/block, the inventory."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from fuzzing import fuzz_arbitrary_text, fuzz_mutated_fixtures
from hypothesis import given
from hypothesis import strategies as st

from topkv.topology.detect.errors import ParseError
from topkv.topology.detect.lsblk import parse_lsblk, parse_size
from topkv.topology.detect.numa import parse_numactl_hardware
from topkv.topology.probes import CommandResult, FixtureRunner
from topkv.topology.tiers import (
    LSBLK_ARGV,
    NUMACTL_ARGV,
    discover_tier_inventory,
    memory_nodes,
    read_block_devices,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LSBLK = FIXTURES / "lsblk"
ALL_TEXTS = [p.read_text() for p in sorted(LSBLK.iterdir())]
ALPHABET = st.sampled_from(list('nvmesdab0123456789 :GMKTB.├└─│\n/-_{}[]",'))


def test_nvme_host_default_columns() -> None:
    devs = parse_lsblk((LSBLK / "bucardo-boxinfo-6-nvme0n1-lsblk.txt").read_text())
    assert [d.name for d in devs] == ["nvme0n1", "nvme0n1p1", "nvme0n1p2"]
    disk, boot, root = devs
    assert disk.is_disk and disk.is_nvme and disk.size_bytes == 477 << 30
    assert boot.parent == "nvme0n1" and boot.mountpoints == ("/boot",)
    assert root.size_bytes == int(124.9 * (1 << 30)) and root.type == "part"


def test_raid_lvm_tree_with_empty_middle_cells() -> None:
    devs = parse_lsblk((LSBLK / "amitkumardas-decisions-238-md-raid-lvm-lsblk-o.txt").read_text())
    by = {d.name: d for d in devs}
    assert list(by) == [
        "sda",
        "md126",
        "md126p1",
        "md126p2",
        "kube--storage--01--vg-root",
        "kube--storage--01--vg-swap_1",
        "sdb",
    ]
    assert by["md126"].type == "raid1" and by["md126"].parent == "sda"
    assert by["kube--storage--01--vg-root"].mountpoints == ("/",)
    assert by["kube--storage--01--vg-root"].parent == "md126p2"
    assert by["kube--storage--01--vg-swap_1"].mountpoints == ()
    assert by["sda"].model == "INTEL_SSDSC2BB15" and by["sdb"].parent is None
    assert by["md126p1"].mountpoints == ("/boot/efi",)


def test_text_and_json_of_one_host_agree() -> None:
    text = parse_lsblk((LSBLK / "topkv-dev-vm-virtio-lsblk.txt").read_text())
    js = parse_lsblk((LSBLK / "topkv-dev-vm-virtio-lsblk-J-b.json").read_text())
    assert [(d.name, d.size_bytes) for d in text] == [(d.name, d.size_bytes) for d in js]
    assert text[1].mountpoints == ("/run/netns", "/")  # the continuation row
    assert js[1].rotational is True and js[0].rotational is False


@pytest.mark.parametrize(
    ("text", "size"),
    [("477G", 477 << 30), ("0B", 0), ("127M", 127 << 20), ("1.8T", int(1.8 * (1 << 40)))],
)
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(
    "text",
    ["", "   \n", "hello world", '{"blockdevices": 3}', '{"blockdevices": [{"size": 1}]}', "{oops"],
)
def test_bad_output_is_a_parse_error(text: str) -> None:
    with pytest.raises(ParseError, match="lsblk"):
        parse_lsblk(text)


def test_bad_size_names_the_value() -> None:
    with pytest.raises(ParseError, match="'12Q'"):
        parse_lsblk("NAME SIZE TYPE\nsda   12Q disk\n")


@given(
    st.lists(
        st.tuples(
            st.from_regex(r"[a-z][a-z0-9]{0,8}", fullmatch=True),
            st.integers(0, 1 << 50),
            st.sampled_from(["disk", "part", "lvm"]),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_json_round_trip(rows: list[tuple[str, int, str]]) -> None:
    doc = {"blockdevices": [{"name": n, "size": s, "type": t, "rota": "0"} for n, s, t in rows]}
    devs = parse_lsblk(json.dumps(doc))
    assert [(d.name, d.size_bytes, d.type) for d in devs] == rows


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["name", "size", "type", "rota", "tran", "mountpoints", "mountpoint",
                         "children", "model"]), inner, max_size=6),
    max_leaves=20,
)  # fmt: skip


@given(st.lists(JSON, max_size=4))
def test_arbitrary_json_parses_or_raises_parse_error(devices: list[object]) -> None:
    with contextlib.suppress(ParseError):
        parse_lsblk(json.dumps({"blockdevices": devices}))


@fuzz_arbitrary_text(ALPHABET)
def test_arbitrary_text_parses_or_raises_parse_error(text: str) -> None:
    with contextlib.suppress(ParseError):
        parse_lsblk(text)


@fuzz_mutated_fixtures(ALL_TEXTS, ALPHABET)
def test_mutated_fixtures_parse_or_raise_parse_error(text: str) -> None:
    try:
        for dev in parse_lsblk(text):
            assert dev.name and (dev.size_bytes is None or dev.size_bytes >= 0)
    except ParseError:
        pass


@pytest.mark.skipif(shutil.which("lsblk") is None, reason="lsblk not installed here")
def test_this_hosts_lsblk() -> None:
    out = subprocess.run(LSBLK_ARGV, capture_output=True, text=True, check=True).stdout
    assert any(d.is_disk for d in parse_lsblk(out))


# --------------------------------------------------------------------------- sysfs, inventory


def _sysfs_disk(root: Path, name: str, sectors: str, rota: str) -> None:
    d = root / "sys" / "block" / name
    (d / "queue").mkdir(parents=True)
    (d / "size").write_text(sectors + "\n")
    (d / "queue" / "rotational").write_text(rota + "\n")


def test_sys_block(tmp_path: Path) -> None:
    _sysfs_disk(tmp_path, "nvme0n1", "7501476528", "0")
    _sysfs_disk(tmp_path, "loop0", "0", "0")
    _sysfs_disk(tmp_path, "sda", "1953525168", "1")
    devs = {d.name: d for d in read_block_devices(tmp_path)}
    assert devs["nvme0n1"].is_nvme and devs["nvme0n1"].size_bytes == 7501476528 * 512
    assert devs["nvme0n1"].rotational is False and devs["sda"].rotational is True
    assert devs["loop0"].type == "loop" and not devs["sda"].is_nvme
    assert read_block_devices(tmp_path / "none") == []


def test_sys_block_garbage_names_the_file(tmp_path: Path) -> None:
    _sysfs_disk(tmp_path, "sda", "lots", "1")
    with pytest.raises(ParseError, match="sda/size"):
        read_block_devices(tmp_path)


class _Canned(FixtureRunner):
    """Answers numactl -H and lsblk from fixture files; nothing else."""

    def __init__(self, numactl: Path | None, lsblk: Path | None) -> None:
        self.files = {NUMACTL_ARGV: numactl, LSBLK_ARGV: lsblk}

    def run(self, argv: object, timeout_s: float = 15.0) -> CommandResult:
        path = self.files.get(tuple(argv))  # type: ignore[arg-type]
        if path is None:
            return CommandResult(tuple(argv), "not-found")  # type: ignore[arg-type]
        return CommandResult(tuple(argv), "ok", path.read_text())  # type: ignore[arg-type]


def test_inventory_from_real_outputs(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text("MemTotal: 1048576 kB\nMemAvailable: 524288 kB\n")
    numactl = FIXTURES / "numa" / "rtx6kpro-asus-epyc9575f-2s-numactl-H-cpu239-offline.txt"
    inv = discover_tier_inventory(
        _Canned(numactl, LSBLK / "bucardo-boxinfo-6-nvme0n1-lsblk.txt"), tmp_path, use_nvml=False
    )
    assert inv.sources["numa"] == "numactl -H" and inv.sources["disks"] == "lsblk -J -b"
    assert [n.node_id for n in inv.numa] == [0, 1] and not inv.cxl_nodes
    assert inv.numa[0].total_bytes > 0 and [d.name for d in inv.nvme] == ["nvme0n1"]
    assert inv.host_total_bytes == 1 << 30 and inv.host_available_bytes == 1 << 29


def test_inventory_falls_back_to_sysfs(tmp_path: Path) -> None:
    _sysfs_disk(tmp_path, "nvme0n1", "2048", "0")
    node = tmp_path / "sys" / "devices" / "system" / "node"
    for nid, cpus, kb in ((0, "0-3", 4194304), (1, "", 134217728)):
        (node / f"node{nid}").mkdir(parents=True)
        (node / f"node{nid}" / "cpulist").write_text(cpus + "\n")
        (node / f"node{nid}" / "meminfo").write_text(f"Node {nid} MemTotal: {kb} kB\n")
    inv = discover_tier_inventory(_Canned(None, None), tmp_path, use_nvml=False)
    assert inv.sources["numa"] == "sysfs" and inv.sources["disks"] == "sysfs"
    assert [(n.node_id, n.total_bytes) for n in inv.cxl_nodes] == [(1, 128 << 30)]
    skipped = memory_nodes(
        parse_numactl_hardware(
            "node 0 cpus: 0\nnode 0 size: 10 MB\nnode 1 cpus:\nnode 1 size: 20 MB\n"
        ),
        frozenset({1}),
    )
    assert [n.node_id for n in skipped] == [0]


def test_this_host_inventory() -> None:
    inv = discover_tier_inventory(use_nvml=False)
    assert inv.host_total_bytes > 0 and inv.sources["gpu"]
