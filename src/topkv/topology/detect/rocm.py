"""Parser for AMD ``rocm-smi --showtopo`` (and its single-section forms ``--showtopoweight``,
``--showtopohops``, ``--showtopotype``, ``--showtoponuma``, and ``--showtopo --json``).

The text form has one ``=== <title> ===`` banner per section; matrix sections (weight, hops,
link type) have a ``GPU0 GPU1 ...`` header and one row per GPU, the NUMA section has lines
``GPU[0]  : (Topology) Numa Node: 0``. Matrices are kept per ordered pair as printed (both
``(i, j)`` and ``(j, i)``), diagonal cells are dropped, cells that are not numbers (``N/A``)
are skipped. ``numa`` prefers "Numa Node" over "Numa Affinity" and drops negative values
(``-1`` = no affinity). Unknown sections are ignored. Empty input raises :class:`ParseError`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from topkv.topology.detect.errors import ParseError

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\x1b[()][0-9A-Za-z]")
_BANNER = re.compile(r"^\s*=+\s*(.*?)\s*=+\s*$")
_MATRIX_HEADER = re.compile(r"^\s*((?:GPU\s*\[?\d+\]?\s*)+)$", re.IGNORECASE)
_MATRIX_ROW = re.compile(r"^\s*GPU\s*\[?(\d+)\]?\s+(.*)$", re.IGNORECASE)
_NUMA_LINE = re.compile(
    r"^\s*GPU\s*\[\s*(\d+)\s*\]\s*:\s*(?:\(Topology\)\s*)?Numa\s+(Node|Affinity)\s*:\s*(-?\d+)",
    re.IGNORECASE,
)
_MAX_GPU = 4096


@dataclass(frozen=True)
class RocmTopology:
    """GPU-GPU link type (``XGMI``/``PCIE``), hop count and weight, and each GPU's NUMA node."""

    gpus: tuple[int, ...]
    link_types: dict[tuple[int, int], str] = field(default_factory=dict)
    hops: dict[tuple[int, int], int] = field(default_factory=dict)
    weights: dict[tuple[int, int], int] = field(default_factory=dict)
    numa: dict[int, int] = field(default_factory=dict)


#: Link-type cells that name no link: none, not available, the diagonal's ``X``.
_NO_LINK = frozenset({"", "0", "N/A", "X"})


@dataclass
class _Found:
    """What one parse has found so far; the text and the JSON form both fill one."""

    gpus: set[int] = field(default_factory=set)
    link_types: dict[tuple[int, int], str] = field(default_factory=dict)
    hops: dict[tuple[int, int], int] = field(default_factory=dict)
    weights: dict[tuple[int, int], int] = field(default_factory=dict)
    numa_node: dict[int, int] = field(default_factory=dict)
    numa_affinity: dict[int, int] = field(default_factory=dict)

    def pair(self, kind: str, a: int, b: int, text: str) -> None:
        """The ``kind`` section's value for ``a`` -> ``b`` (a link type, hops or a weight);
        values that name no link or are not numbers are skipped."""
        self.gpus.update((a, b))
        if kind == "link type":
            if text not in _NO_LINK:
                self.link_types[(a, b)] = text.upper()
        elif re.fullmatch(r"\d{1,9}", text):
            (self.hops if kind == "hops" else self.weights)[(a, b)] = int(text)

    def numa(self, gpu: int, node: bool, value: int | None) -> None:
        """GPU ``gpu``'s "Numa Node" (``node``) or "Numa Affinity"; None: not a usable one."""
        self.gpus.add(gpu)
        if value is not None:
            (self.numa_node if node else self.numa_affinity)[gpu] = value

    def topology(self) -> RocmTopology | None:
        if not self.gpus:
            return None
        return RocmTopology(
            gpus=tuple(sorted(self.gpus)),
            link_types=self.link_types,
            hops=self.hops,
            weights=self.weights,
            numa={**self.numa_affinity, **self.numa_node},
        )


def _gpu_id(value: str) -> int:
    gpu = int(value)
    if gpu > _MAX_GPU:
        raise ParseError(f"rocm-smi: GPU index {gpu} is implausible")
    return gpu


def _section_kind(title: str) -> str | None:
    title = title.lower()
    for kind in ("weight", "hops", "link type", "numa"):
        if kind in title:
            return kind
    return None


def _json_topology(data: Any) -> RocmTopology | None:
    """``rocm-smi --showtopo --json``: keys like "(Topology) Link type between DRM devices 0
    and 1" under "system", and "(Topology) Numa Node" under "card0"."""
    if not isinstance(data, dict):
        return None
    pair_key = re.compile(
        r"(weight|hops|link type)\s+between\s+.*?(\d+)\s+and\s+(\d+)\s*$", re.IGNORECASE
    )
    found = _Found()
    for section, content in data.items():
        if not isinstance(content, dict):
            continue
        card = re.fullmatch(r"card(\d+)", str(section))
        for key, value in content.items():
            text = str(value).strip()
            if m := pair_key.search(str(key)):
                a, b = _gpu_id(m.group(2)), _gpu_id(m.group(3))
                found.pair(m.group(1).lower(), a, b, text)
            elif card and re.search(r"numa (node|affinity)", str(key), re.IGNORECASE):
                number = int(text) if re.fullmatch(r"\d{1,6}", text) else None
                found.numa(_gpu_id(card.group(1)), "node" in str(key).lower(), number)
    return found.topology()


def parse_rocm_smi_showtopo(text: str) -> RocmTopology:
    """Parse ``rocm-smi --showtopo`` text (or ``--json``) into a :class:`RocmTopology`."""
    text = _ANSI.sub("", text)
    stripped = text.strip()
    if not stripped:
        raise ParseError("rocm-smi: empty output")
    if stripped.startswith("{"):
        try:
            from_json = _json_topology(json.loads(stripped))
        except (ValueError, RecursionError):
            from_json = None
        if from_json is not None:
            return from_json
    found = _Found()
    kind: str | None = None
    columns: list[int] | None = None
    for raw in text.replace("\r", "\n").split("\n"):
        line = raw.rstrip()
        if m := _BANNER.match(line):
            kind, columns = _section_kind(m.group(1)), None
            continue
        if m := _NUMA_LINE.match(line):
            gpu, value = _gpu_id(m.group(1)), int(m.group(3))
            found.numa(gpu, m.group(2).lower() == "node", value if 0 <= value <= _MAX_GPU else None)
            continue
        if m := _MATRIX_HEADER.match(line):
            columns = [_gpu_id(x) for x in re.findall(r"\d+", m.group(1))]
            found.gpus.update(columns)
            continue
        if columns is None or kind not in {"weight", "hops", "link type"}:
            continue
        if not (m := _MATRIX_ROW.match(line)):
            continue
        row = _gpu_id(m.group(1))
        found.gpus.add(row)
        for col, cell in zip(columns, m.group(2).split(), strict=False):
            if col != row:
                found.pair(kind, row, col, cell)
    topology = found.topology()
    if topology is None:
        first = stripped.splitlines()[0]
        raise ParseError(f"rocm-smi: no GPU topology found (first line: {first[:60]!r})")
    return topology
