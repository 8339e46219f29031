"""Parser for ``lsblk``: the default tree, ``-o COLUMNS`` tables and ``-J`` JSON.

What the KV disk tier needs of each block device: its name, type (disk, part, lvm, raid1,
...), size in bytes, whether it spins, its transport (nvme, sata, ...) and mount points.
Text sizes are lsblk's binary units (``477G``, ``124.9G``, ``0B``); ``-b`` prints bytes.

Text columns are found from the header: a value belongs to the header column it overlaps
(left-aligned columns such as NAME, TYPE, MOUNTPOINT start under their header; right-aligned
ones such as SIZE, RM end under it), so empty cells in the middle of a row (HCTL of an md
device) do not shift the columns after them. A row with an empty NAME continues the row
above (a second mount point in ``MOUNTPOINTS``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from topkv.topology.detect.errors import ParseError
from topkv.topology.detect.numa import _clean_lines

_TREE = re.compile(r"^[\s├└│─`|-]*")
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)([BKMGTPE]?)(?:i?B)?$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_UNITS["e"] = 1 << 60
_MAX_DEVICES = 100_000


@dataclass(frozen=True)
class BlockDevice:
    """One row of lsblk (``None``: the column was not printed)."""

    name: str
    type: str | None = None
    size_bytes: int | None = None
    rotational: bool | None = None
    transport: str | None = None
    model: str | None = None
    mountpoints: tuple[str, ...] = ()
    parent: str | None = None

    @property
    def is_disk(self) -> bool:
        return self.type == "disk"

    @property
    def is_nvme(self) -> bool:
        return self.transport == "nvme" or self.name.startswith("nvme")


def parse_size(text: str) -> int:
    """``"477G"`` -> 512,174,278,656; ``"124.9G"``, ``"0B"``, ``"274877906944"`` (``-b``)."""
    m = _SIZE.match(text.strip())
    if not m:
        raise ParseError(f"lsblk: size {text.strip()[:30]!r} is not a number with a unit")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _flag(value: Any, what: str) -> bool | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true"):
        return True
    if text in ("0", "false"):
        return False
    raise ParseError(f"lsblk: {what} {str(value)[:20]!r} is not 0/1")


def _text(value: Any) -> str | None:
    if value is None:
        return None
    text = str(value).strip()
    return text or None


# --------------------------------------------------------------------------- JSON


def _from_json(data: Any) -> list[BlockDevice]:
    if not isinstance(data, dict) or not isinstance(data.get("blockdevices"), list):
        raise ParseError("lsblk -J: no 'blockdevices' list")
    out: list[BlockDevice] = []
    stack: list[tuple[Any, str | None]] = [(d, None) for d in reversed(data["blockdevices"])]
    while stack:
        item, parent = stack.pop()
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ParseError("lsblk -J: a block device without a 'name'")
        if len(out) >= _MAX_DEVICES:
            raise ParseError(f"lsblk -J: more than {_MAX_DEVICES} block devices")
        size = item.get("size")
        mounts = item.get("mountpoints", [item.get("mountpoint")])
        if not isinstance(mounts, list):
            raise ParseError(f"lsblk -J: {item['name'][:40]!r} mountpoints is not a list")
        out.append(
            BlockDevice(
                name=_TREE.sub("", item["name"]),
                type=_text(item.get("type")),
                size_bytes=None if size is None else parse_size(str(size)),
                rotational=_flag(item.get("rota"), "ROTA"),
                transport=_text(item.get("tran")),
                model=_text(item.get("model")),
                mountpoints=tuple(m for m in (mounts or []) if isinstance(m, str) and m),
                parent=parent,
            )
        )
        children = item.get("children") or []
        if not isinstance(children, list):
            raise ParseError(f"lsblk -J: {item['name']!r} children is not a list")
        stack.extend((c, out[-1].name) for c in reversed(children))
    return out


# --------------------------------------------------------------------------- text


def _spans(line: str) -> list[tuple[int, int, str]]:
    return [(m.start(), m.end(), m.group()) for m in re.finditer(r"\S+", line)]


def _cells(line: str, header: list[tuple[int, int, str]]) -> dict[str, str]:
    """Each token of ``line`` joins the header column it overlaps (else the nearest)."""
    cells: dict[str, list[str]] = {}
    for start, end, token in _spans(line):

        def distance(col: tuple[int, int, str], s: int = start, e: int = end) -> int:
            return max(0, col[0] - e, s - col[1])

        col = min(header, key=distance)
        cells.setdefault(col[2], []).append(token)
    return {k: " ".join(v) for k, v in cells.items()}


def _row_device(cells: dict[str, str], parent: str | None) -> BlockDevice:
    name = cells["NAME"]
    size = cells.get("SIZE")
    mount = cells.get("MOUNTPOINTS", cells.get("MOUNTPOINT"))
    return BlockDevice(
        name=name,
        type=cells.get("TYPE"),
        size_bytes=None if size is None else parse_size(size),
        rotational=_flag(cells.get("ROTA"), "ROTA"),
        transport=cells.get("TRAN"),
        model=cells.get("MODEL"),
        mountpoints=(mount,) if mount else (),
        parent=parent,
    )


def _from_text(lines: list[str]) -> list[BlockDevice]:
    rows = [line for line in lines if line.strip()]
    if not rows:
        raise ParseError("lsblk: no output lines")
    header = _spans(rows[0])
    if not header or header[0][2] != "NAME":
        raise ParseError(f"lsblk: first line {rows[0][:60]!r} is not a header starting NAME")
    out: list[BlockDevice] = []
    parents: list[tuple[int, str]] = []  # (depth, name) of the rows above
    for line in rows[1:]:
        if len(out) >= _MAX_DEVICES:
            raise ParseError(f"lsblk: more than {_MAX_DEVICES} block devices")
        prefix = _TREE.match(line)
        depth = prefix.end() if prefix else 0
        # The tree drawing joins no column; the first token is the name when it starts
        # before the second column, else the row continues the one above.
        body = " " * depth + line[depth:]
        tokens = _spans(body)
        if not tokens:
            continue  # tree drawing alone (a cut line)
        first = tokens[0]
        if len(header) > 1 and first[0] >= header[1][0]:
            if not out:
                raise ParseError(f"lsblk: row {line.strip()[:60]!r} has no device name")
            cells = _cells(body, header)
            more = cells.get("MOUNTPOINTS", cells.get("MOUNTPOINT", " ".join(cells.values())))
            out[-1] = replace(out[-1], mountpoints=(*out[-1].mountpoints, more))
            continue
        cells = _cells(" " * first[1] + body[first[1] :], header[1:]) if len(header) > 1 else {}
        cells["NAME"] = first[2]
        while parents and parents[-1][0] >= depth:
            parents.pop()
        out.append(_row_device(cells, parents[-1][1] if parents and depth else None))
        parents.append((depth, cells["NAME"]))
    return out


def parse_lsblk(text: str) -> list[BlockDevice]:
    """Every block device lsblk printed, parents before children (``-J`` or text)."""
    stripped = text.strip()
    if not stripped:
        raise ParseError("lsblk: empty output")
    if stripped.startswith("{"):
        try:
            data = json.loads(stripped)
        except (ValueError, RecursionError) as exc:
            raise ParseError(f"lsblk -J: not JSON ({exc})") from None
        return _from_json(data)
    return _from_text(_clean_lines(text))
