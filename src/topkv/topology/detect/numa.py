"""Parsers for ``numactl -H`` / ``numactl --hardware`` and ``lscpu``, plus the kernel's
CPU-list syntax (``0-3,8,10-11``).

Both tools always print something on a working Linux host, so empty input raises
:class:`ParseError`, as does ``numactl``'s "No NUMA available on this system" (callers fall
back to sysfs, see :mod:`topkv.topology.sysfs`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from topkv.topology.detect.errors import ParseError
from topkv.topology.detect.paste import strip_paste_wrapping

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\x1b[()][0-9A-Za-z]")
MAX_CPU_ID = 65535  # well above the kernel's NR_CPUS limit (8192); guards absurd ranges


def _clean_lines(text: str) -> list[str]:
    text = _ANSI.sub("", text).replace("\r\n", "\n").replace("\r", "\n")
    return [line.rstrip() for line in strip_paste_wrapping(text.split("\n"))]


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """CPU ids of a kernel CPU list: ``"0-3,8,10-11"`` -> ``(0, 1, 2, 3, 8, 10, 11)``.

    Commas and/or whitespace separate items (so numactl's ``"0 1 2"`` works too); the
    kernel's group form ``"0-15:2/4"`` (first 2 of every 4) is accepted. Empty text gives
    ``()``. The result is sorted and without duplicates.
    """
    cpus: set[int] = set()
    for item in re.split(r"[,\s]+", text.strip()):
        if not item:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+)/(\d+))?)?", item)
        if not m:
            raise ParseError(f"CPU list {text.strip()[:60]!r}: {item[:20]!r} is not N or N-M")
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) else first
        step = int(m.group(3)) if m.group(3) else 1
        group = int(m.group(4)) if m.group(4) else 1
        if last > MAX_CPU_ID:
            raise ParseError(f"CPU list {text.strip()[:60]!r}: CPU id {last} is implausible")
        if last < first or step == 0 or group == 0 or step > group:
            raise ParseError(f"CPU list {text.strip()[:60]!r}: bad range {item!r}")
        # "a-b:u/g": in each group of g CPUs starting at a, take the first u.
        cpus.update(c for c in range(first, last + 1) if (c - first) % group < step)
    return tuple(sorted(cpus))


# --------------------------------------------------------------------------- numactl -H


@dataclass(frozen=True)
class NumaNodeInfo:
    """One NUMA node: its CPUs, memory in MB and its row of the distance table."""

    node_id: int
    cpus: tuple[int, ...]
    memory_mb: int | None
    free_mb: int | None
    distances: tuple[int, ...] | None

    @property
    def cpuless(self) -> bool:
        """A memory-only node (CXL memory, or GPU memory such as GH200 HBM)."""
        return not self.cpus


_NODE_LINE = re.compile(r"^\s*node\s+(\d+)\s+(cpus|size|free)\s*:\s*(.*?)\s*$", re.IGNORECASE)
_AVAILABLE = re.compile(r"^\s*available\s*:\s*(\d+)\s+nodes?", re.IGNORECASE)
_DIST_HEADER = re.compile(r"^\s*node((?:\s+\d+)+)\s*$", re.IGNORECASE)
_DIST_ROW = re.compile(r"^\s*(\d+)\s*:((?:\s+\d+)+)\s*$")
_MEMORY = re.compile(r"^(\d+)\s*([KMGT]?i?B)?$", re.IGNORECASE)
_MB_PER_UNIT = {
    "": 1.0,
    "b": 1 / (1024 * 1024),
    "kb": 1 / 1024,
    "mb": 1.0,
    "gb": 1024.0,
    "tb": 1024.0 * 1024,
}


def _memory_mb(value: str, node: int) -> int:
    m = _MEMORY.match(value.strip())
    if not m:
        raise ParseError(f"numactl: node {node} memory {value[:40]!r} is not '<number> MB'")
    unit = (m.group(2) or "").lower().replace("i", "")
    return int(int(m.group(1)) * _MB_PER_UNIT[unit])


def parse_numactl_hardware(text: str) -> list[NumaNodeInfo]:
    """Parse ``numactl -H``. Nodes are returned sorted by id; ``distances`` follows the
    column order of the distance table (``None`` when the table is missing or cut)."""
    lines = _clean_lines(text)
    if not any(line.strip() for line in lines):
        raise ParseError("numactl: empty output")
    if any("no numa available" in line.lower() for line in lines):
        raise ParseError("numactl: 'No NUMA available on this system' (use sysfs instead)")
    cpus: dict[int, tuple[int, ...]] = {}
    size: dict[int, int] = {}
    free: dict[int, int] = {}
    columns: list[int] | None = None
    distances: dict[int, tuple[int, ...]] = {}
    for line in lines:
        if m := _NODE_LINE.match(line):
            node, kind, value = int(m.group(1)), m.group(2).lower(), m.group(3)
            if node > MAX_CPU_ID:
                raise ParseError(f"numactl: node id {node} is implausible")
            if kind == "cpus":
                cpus[node] = parse_cpu_list(value)
            elif kind == "size":
                size[node] = _memory_mb(value, node)
            else:
                free[node] = _memory_mb(value, node)
        elif m := _DIST_HEADER.match(line):
            columns = [int(x) for x in m.group(1).split()]
        elif columns is not None and (m := _DIST_ROW.match(line)):
            row = tuple(int(x) for x in m.group(2).split())
            if len(row) == len(columns):
                distances[int(m.group(1))] = row
    node_ids = sorted(set(cpus) | set(size) | set(free))
    if not node_ids:
        first = next(line.strip() for line in lines if line.strip())
        raise ParseError(f"numactl: no 'node N cpus/size' lines found (first line: {first[:60]!r})")
    return [
        NumaNodeInfo(
            node_id=node,
            cpus=cpus.get(node, ()),
            memory_mb=size.get(node),
            free_mb=free.get(node),
            distances=distances.get(node),
        )
        for node in node_ids
    ]


# --------------------------------------------------------------------------- lscpu


@dataclass(frozen=True)
class LscpuInfo:
    """What ``lscpu`` says about the CPUs and their NUMA nodes (``None``: not reported)."""

    model_name: str | None
    sockets: int | None
    cores_per_socket: int | None
    threads_per_core: int | None
    online_cpus: tuple[int, ...]
    offline_cpus: tuple[int, ...]
    numa_nodes: dict[int, tuple[int, ...]] = field(default_factory=dict)


_LSCPU_FIELD = re.compile(r"^\s*([A-Za-z][\w ()/.-]*?)\s*:\s*(.*?)\s*$")
_NUMA_NODE_KEY = re.compile(r"^NUMA node\s*(\d+) CPU\(s\)$", re.IGNORECASE)


def _lscpu_pairs_from_json(text: str) -> list[tuple[str, str]] | None:
    """``lscpu -J``: ``{"lscpu": [{"field": "CPU(s):", "data": "8", "children": [...]}]}``."""
    try:
        data: Any = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("lscpu"), list):
        return None
    pairs: list[tuple[str, str]] = []
    stack: list[Any] = list(reversed(data["lscpu"]))
    while stack:
        item = stack.pop()
        if not isinstance(item, dict):
            continue
        key, value = item.get("field"), item.get("data")
        if isinstance(key, str):
            pairs.append((key.strip().rstrip(":").strip(), value if isinstance(value, str) else ""))
        children = item.get("children")
        if isinstance(children, list):
            stack.extend(reversed(children))
    return pairs


def _lscpu_pairs(lines: list[str]) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    for line in lines:
        if m := _LSCPU_FIELD.match(line):
            pairs.append((re.sub(r"\s+", " ", m.group(1)), m.group(2)))
        # Lines without "key:" are wrapped continuations (Flags) or noise: ignored.
    return pairs


def _count(key: str, value: str) -> int | None:
    value = value.strip()
    if value in {"", "-"}:
        return None  # e.g. "Socket(s): -" on some ARM servers
    if not value.isdigit() or len(value) > 7:
        raise ParseError(f"lscpu: {key} {value[:30]!r} is not a count")
    return int(value)


def parse_lscpu(text: str) -> LscpuInfo:
    """Parse ``lscpu`` (flat old format, grouped new format, a pasted section, or ``-J``).

    CPU-less NUMA nodes (``NUMA node1 CPU(s):`` with nothing after it) map to ``()``.
    ``online_cpus`` is ``()`` when the "On-line CPU(s) list" line is absent.
    """
    stripped = _ANSI.sub("", text).strip()
    if not stripped:
        raise ParseError("lscpu: empty output")
    pairs = _lscpu_pairs_from_json(stripped) if stripped.startswith("{") else None
    if pairs is None:
        pairs = _lscpu_pairs(_clean_lines(text))
    values: dict[str, str] = {}
    numa: dict[int, tuple[int, ...]] = {}
    for key, value in pairs:
        if m := _NUMA_NODE_KEY.match(key):
            node = int(m.group(1))
            if node > MAX_CPU_ID:
                raise ParseError(f"lscpu: NUMA node id {node} is implausible")
            numa.setdefault(node, parse_cpu_list(value))
        else:
            values.setdefault(key.lower(), value)  # first wins (big.LITTLE: first model)
    known = {"model name", "socket(s)", "on-line cpu(s) list", "cpu(s)", "architecture"}
    if not numa and not known & values.keys() and "numa node(s)" not in values:
        first = stripped.splitlines()[0]
        raise ParseError(f"lscpu: no known fields found (first line: {first[:60]!r})")
    return LscpuInfo(
        model_name=values.get("model name") or None,
        sockets=_count("Socket(s)", values.get("socket(s)", "")),
        cores_per_socket=_count("Core(s) per socket", values.get("core(s) per socket", "")),
        threads_per_core=_count("Thread(s) per core", values.get("thread(s) per core", "")),
        online_cpus=parse_cpu_list(values.get("on-line cpu(s) list", "")),
        offline_cpus=parse_cpu_list(values.get("off-line cpu(s) list", "")),
        numa_nodes=dict(sorted(numa.items())),
    )
