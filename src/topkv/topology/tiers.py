"""What KV memory tiers this host has: GPU memory, host DRAM, CXL (CPU-less NUMA) and disks.

Sources, each with a fallback:

* GPU memory: NVML (``probe_nvml``), else torch (``torch.cuda.mem_get_info``), else none;
* NUMA nodes: ``numactl -H``, else ``/sys/devices/system/node``; a CPU-less node with memory
  is a CXL candidate, except the GPU-memory nodes the caller names (GH200/GB200 expose HBM
  as NUMA nodes; :mod:`topkv.topology.build` tells them apart);
* disks: ``lsblk -J -b``, else ``/sys/block/<dev>/{size,queue/rotational}``.

The inventory is data only; the worker (:mod:`topkv.service.tiers.config`) checks what a tier
configuration asks for against it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from topkv.topology.detect.errors import ParseError
from topkv.topology.detect.lsblk import BlockDevice, parse_lsblk
from topkv.topology.detect.numa import NumaNodeInfo, parse_numactl_hardware
from topkv.topology.probes import CommandRunner, LocalRunner, probe_nvml
from topkv.topology.sysfs import ROOT, read_numa_nodes

T = TypeVar("T")
LSBLK_ARGV = ("lsblk", "-J", "-b", "-o", "NAME,TYPE,SIZE,ROTA,TRAN,MODEL,MOUNTPOINT")
NUMACTL_ARGV = ("numactl", "-H")
_MB = 1 << 20


@dataclass(frozen=True)
class MemoryNode:
    """A NUMA node's memory: total and free bytes, and whether it has CPUs."""

    node_id: int
    total_bytes: int
    free_bytes: int | None
    cpuless: bool


@dataclass(frozen=True)
class TierInventory:
    """Everything a tier configuration is checked against, with where each fact came from."""

    gpu_memory_bytes: tuple[int, ...] = ()
    gpu_free_bytes: tuple[int, ...] = ()
    numa: tuple[MemoryNode, ...] = ()
    host_total_bytes: int = 0
    host_available_bytes: int = 0
    disks: tuple[BlockDevice, ...] = ()
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def cxl_nodes(self) -> tuple[MemoryNode, ...]:
        """CPU-less NUMA nodes with memory: CXL (or GPU memory the caller excluded)."""
        return tuple(n for n in self.numa if n.cpuless and n.total_bytes > 0)

    @property
    def nvme(self) -> tuple[BlockDevice, ...]:
        return tuple(d for d in self.disks if d.is_disk and d.is_nvme)


def memory_nodes(
    nodes: list[NumaNodeInfo], skip: frozenset[int] = frozenset()
) -> tuple[MemoryNode, ...]:
    """NUMA nodes as memory records (``skip``: node ids that are GPU memory, not CXL)."""
    return tuple(
        MemoryNode(
            n.node_id,
            (n.memory_mb or 0) * _MB,
            None if n.free_mb is None else n.free_mb * _MB,
            n.cpuless,
        )
        for n in nodes
        if n.node_id not in skip
    )


def read_block_devices(root: Path = ROOT) -> list[BlockDevice]:
    """Whole disks from ``/sys/block`` (``[]`` when absent): size, rotational, nvme or not."""
    base = root / "sys" / "block"
    try:
        entries = sorted(p for p in base.iterdir() if p.is_dir())
    except OSError:
        return []
    out = []
    for dev in entries:
        size_text = _read(dev / "size")
        if size_text is None:
            continue
        if not size_text.isdigit():
            raise ParseError(f"sysfs: {dev / 'size'} holds {size_text[:30]!r}, not sectors")
        rota = _read(dev / "queue" / "rotational")
        kind = "loop" if dev.name.startswith(("loop", "ram", "zram")) else "disk"
        out.append(
            BlockDevice(
                name=dev.name,
                type=kind,
                size_bytes=int(size_text) * 512,  # the kernel counts 512-byte sectors
                rotational=None if rota not in ("0", "1") else rota == "1",
                transport="nvme" if dev.name.startswith("nvme") else None,
            )
        )
    return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def _meminfo(root: Path) -> tuple[int, int]:
    text = _read(root / "proc" / "meminfo") or ""
    found = dict(re.findall(r"^(MemTotal|MemAvailable):\s+(\d+)\s*kB", text, re.MULTILINE))
    return int(found.get("MemTotal", 0)) * 1024, int(found.get("MemAvailable", 0)) * 1024


def _gpu_memory(use_nvml: bool) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    if use_nvml:
        snap, _ = probe_nvml()
        if snap is not None and snap.gpus and all(g.memory_mb for g in snap.gpus):
            total = tuple((g.memory_mb or 0) * _MB for g in snap.gpus)
            return total, total, "nvml"
    try:
        import torch  # optional: the model extra

        if torch.cuda.is_available():
            pairs = [torch.cuda.mem_get_info(i) for i in range(torch.cuda.device_count())]
            return tuple(t for _, t in pairs), tuple(f for f, _ in pairs), "torch"
    except ImportError:
        pass
    return (), (), "none (no NVML GPU, no torch with CUDA)"


def _tool_then_sysfs(
    runner: CommandRunner,
    argv: tuple[str, ...],
    parse: Callable[[str], list[T]],
    sysfs: Callable[[], list[T]],
    what: str,
    sources: dict[str, str],
) -> list[T]:
    """The tool's parsed output, else sysfs's; ``sources[what]`` says which was used."""
    tool = " ".join(argv[:3]) if argv[0] == "lsblk" else " ".join(argv)
    got = runner.run(argv)
    found: list[T] = []
    if got.status == "ok":
        try:
            found = parse(got.text)
            sources[what] = tool
        except ParseError as exc:
            sources[what] = f"{tool} unusable ({exc}); sysfs"
    if not found:
        found = sysfs()
        sources.setdefault(what, "sysfs" if found else "none")
    return found


def discover_tier_inventory(
    runner: CommandRunner | None = None,
    root: Path = ROOT,
    *,
    use_nvml: bool = True,
    gpu_memory_nodes: frozenset[int] = frozenset(),
) -> TierInventory:
    """Probe this host (tools first, then sysfs)."""
    runner = runner or LocalRunner()
    sources: dict[str, str] = {}
    nodes = _tool_then_sysfs(
        runner, NUMACTL_ARGV, parse_numactl_hardware, lambda: read_numa_nodes(root), "numa",
        sources,
    )  # fmt: skip
    disks = _tool_then_sysfs(
        runner, LSBLK_ARGV, parse_lsblk, lambda: read_block_devices(root), "disks", sources
    )
    total, available = _meminfo(root)
    if not total:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    gpu_total, gpu_free, sources["gpu"] = _gpu_memory(use_nvml)
    return TierInventory(
        gpu_memory_bytes=gpu_total,
        gpu_free_bytes=gpu_free,
        numa=memory_nodes(nodes, gpu_memory_nodes),
        host_total_bytes=total,
        host_available_bytes=available,
        disks=tuple(disks),
        sources=sources,
    )
