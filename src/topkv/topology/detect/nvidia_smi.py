"""Parsers for nvidia-smi output: ``topo -m``, ``nvlink --status/-s/-R`` and ``-q`` (Fabric).

Pure functions, text in and records out. They accept the messy variants people paste:
tabs or spaces, ANSI escapes, trailing spaces, CRLF, a header that lost its indentation or
is missing, old ``mlx5_N`` column names, affinity columns present/absent/empty, and
truncated output. nvidia-smi's own failure messages raise :class:`NoUsableDriverError`;
anything else that cannot be read raises :class:`ParseError`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from topkv.topology.detect.errors import NoUsableDriverError, ParseError
from topkv.topology.detect.paste import strip_paste_wrapping

_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")

# (pattern, message) for nvidia-smi failure texts.
_DRIVER_ERRORS: list[tuple[re.Pattern[str], str]] = [
    (
        re.compile(r"must be used in conjunction with", re.I),
        "nvidia-smi rejected the command line (`topo -m` takes no -i); "
        "rerun plain `nvidia-smi topo -m`",
    ),
    (
        re.compile(r"couldn't communicate with the NVIDIA driver|Driver Not Loaded", re.I),
        "no usable NVIDIA driver: nvidia-smi could not communicate with the driver",
    ),
    (
        re.compile(r"Failed to initialize NVML|NVML library version mismatch", re.I),
        "no usable NVIDIA driver: NVML failed to initialise",
    ),
    (
        re.compile(r"Unable to determine the device handle", re.I),
        "no usable NVIDIA GPU: nvidia-smi could not open the GPU device handle(s)",
    ),
    (re.compile(r"No devices were found", re.I), "no usable NVIDIA GPU: no devices were found"),
    (
        re.compile(r"nvidia-smi: (command )?not found|No such file or directory", re.I),
        "no usable NVIDIA driver: nvidia-smi is not installed",
    ),
]

_CELL_RE = re.compile(r"^(X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC|NVB|C2C|P2C|PXN)$")
_MULTIWORD_COLUMNS = [
    (re.compile(r"GPU\s+NUMA\s+ID", re.I), "GPU_NUMA_ID"),
    (re.compile(r"CPU\s+Affinity", re.I), "CPU_AFFINITY"),
    (re.compile(r"NUMA\s+Affinity", re.I), "NUMA_AFFINITY"),
]
_EXTRA_COLUMNS = {"CPU_AFFINITY", "NUMA_AFFINITY", "GPU_NUMA_ID"}
_GPU_LABEL_RE = re.compile(r"^GPU(\d+)$")
_DEVICE_LABEL_RE = re.compile(r"^(GPU\d+|NIC\d+|[A-Za-z][A-Za-z0-9_]*\d+)$")
_LEGEND_NIC_RE = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")


def clean_text(text: str) -> str:
    """Strip ANSI escapes, carriage returns, NULs and other control characters but tab/LF,
    and the block-quote/comment/HTML wrapping of pasted output (see ``detect.paste``)."""
    text = _ANSI_RE.sub("", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = "".join(ch for ch in text if ch in "\t\n" or (ch >= " " and ch != "\x7f"))
    return "\n".join(strip_paste_wrapping(text.split("\n")))


def raise_if_driver_error(text: str, tool: str = "nvidia-smi") -> None:
    """Raise NoUsableDriverError when ``text`` is one of nvidia-smi's failure messages."""
    for pattern, message in _DRIVER_ERRORS:
        if pattern.search(text):
            first = next((ln.strip() for ln in text.splitlines() if pattern.search(ln)), "")
            raise NoUsableDriverError(f"{tool}: {message} (tool said: {first[:160]!r})")


def parse_cpu_list(text: str) -> list[int]:
    """Parse a Linux CPU list like ``0-47,96-143``; ``N/A``/empty -> []."""
    text = text.strip()
    if not text or text.upper() == "N/A":
        return []
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None:
            raise ParseError(f"bad CPU list {text!r}: {part!r} is not N or N-M")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        if hi < lo or hi - lo > 1_000_000:
            raise ParseError(f"bad CPU list {text!r}: range {part!r} is reversed or too large")
        cpus.extend(range(lo, hi + 1))
    return cpus


# --------------------------------------------------------------------------- topo -m


@dataclass(frozen=True)
class TopoGpuRow:
    """Per-GPU affinity columns of one ``topo -m`` row."""

    index: int
    cpu_affinity: list[int] = field(default_factory=list)
    cpu_affinity_text: str | None = None
    numa_affinity: list[int] = field(default_factory=list)
    gpu_numa_id: int | None = None


@dataclass(frozen=True)
class TopoNic:
    """One NIC column: its label in the matrix and the device name from the legend."""

    label: str
    device: str | None

    @property
    def name(self) -> str:
        return self.device or self.label


@dataclass
class TopoMatrix:
    """Parsed ``nvidia-smi topo -m``: devices, their pairwise path types, affinities."""

    gpu_indices: list[int]
    nics: list[TopoNic]
    rows: dict[int, TopoGpuRow]
    cells: dict[tuple[str, str], str]
    header_present: bool = True
    warnings: list[str] = field(default_factory=list)

    def path(self, a: str, b: str) -> str | None:
        """Path type between two matrix labels (GPU0, NIC3, mlx5_0), either row order."""
        got = self.cells.get((a, b))
        return got if got is not None else self.cells.get((b, a))

    def gpu_pairs(self) -> list[tuple[int, int, str]]:
        out = []
        for i, ga in enumerate(self.gpu_indices):
            for gb in self.gpu_indices[i + 1 :]:
                t = self.path(f"GPU{ga}", f"GPU{gb}")
                if t is not None:
                    out.append((ga, gb, t))
        return out

    def gpu_nic_pairs(self) -> list[tuple[int, str, str]]:
        """(gpu index, NIC name (legend device name when known), path type)."""
        out = []
        for g in self.gpu_indices:
            for nic in self.nics:
                t = self.path(f"GPU{g}", nic.label)
                if t is not None:
                    out.append((g, nic.name, t))
        return out


def _normalise_header(line: str) -> list[str]:
    for pattern, token in _MULTIWORD_COLUMNS:
        line = pattern.sub(token, line)
    return line.split()


def _is_header(tokens: list[str]) -> bool:
    if not tokens or not any(_GPU_LABEL_RE.match(t) for t in tokens):
        return False
    if any(_CELL_RE.match(t) for t in tokens):
        return False
    return all(t in _EXTRA_COLUMNS or _DEVICE_LABEL_RE.match(t) for t in tokens)


def _is_row(tokens: list[str]) -> bool:
    return len(tokens) >= 2 and _DEVICE_LABEL_RE.match(tokens[0]) is not None and "X" in tokens[1:]


def _parse_int(text: str) -> int | None:
    return int(text) if re.fullmatch(r"\d{1,6}", text) else None


def _extras(gidx: int, names: list[str], values: list[str], warnings: list[str]) -> TopoGpuRow:
    cpu_text: str | None = None
    cpus: list[int] = []
    numa: list[int] = []
    gpu_numa: int | None = None
    # nvidia-smi leaves empty cells blank, so whitespace splitting shifts values left; the
    # columns are filled in order (CPU, NUMA, GPU NUMA ID) and missing trailing ones stay empty.
    pairs = list(zip(names, values, strict=False))
    for name, value in pairs:
        try:
            if name == "CPU_AFFINITY":
                cpu_text = value
                cpus = parse_cpu_list(value)
            elif name == "NUMA_AFFINITY":
                numa = parse_cpu_list(value)
            elif name == "GPU_NUMA_ID":
                gpu_numa = _parse_int(value)
        except ParseError as exc:
            warnings.append(f"GPU{gidx}: ignored {name.lower()} value {value!r}: {exc}")
    return TopoGpuRow(
        index=gidx,
        cpu_affinity=cpus,
        cpu_affinity_text=cpu_text,
        numa_affinity=numa,
        gpu_numa_id=gpu_numa,
    )


def parse_topo_matrix(text: str) -> TopoMatrix:
    """Parse ``nvidia-smi topo -m`` (also ``-mp``) output."""
    text = clean_text(text)
    raise_if_driver_error(text)
    if "ROCm System Management Interface" in text or "between two GPUs" in text:
        raise ParseError("nvidia-smi topo -m: this is rocm-smi output; parse it with detect.rocm")
    lines = text.split("\n")
    header: list[str] | None = None
    rows: list[list[str]] = []
    legend: dict[str, str] = {}
    in_legend = False
    for line in lines:
        stripped = line.strip()
        if not stripped:
            continue
        if re.match(r"^(NIC\s+)?Legend\s*:?$", stripped, re.I):
            in_legend = True
            continue
        m = _LEGEND_NIC_RE.match(line)
        if m:
            legend[m.group(1)] = m.group(2)
            continue
        if in_legend:
            continue
        tokens = _normalise_header(stripped)
        if header is None and not rows and _is_header(tokens):
            header = tokens
            continue
        if _is_row(tokens):
            rows.append(tokens)
    if header is None and not rows:
        raise ParseError(
            "nvidia-smi topo -m: no GPU matrix found (expected a header with GPU0 ... and "
            "rows like 'GPU0  X  NV18 ...')"
        )
    warnings: list[str] = []
    if header is None:
        header = _infer_header(rows, warnings)
    return _build_matrix(header, rows, legend, warnings)


def _infer_header(rows: list[list[str]], warnings: list[str]) -> list[str]:
    """Rebuild the column list of a matrix whose header line is missing."""
    width = max(sum(1 for t in r[1:] if _CELL_RE.match(t)) for r in rows)
    gpu_rows = [r for r in rows if _GPU_LABEL_RE.match(r[0])]
    n_gpu = len(gpu_rows)
    nic_rows = [r for r in rows if not _GPU_LABEL_RE.match(r[0])]
    for r in gpu_rows:
        for pos, tok in enumerate(r[1 : width + 1]):
            if tok.startswith("NV") and tok != "NVB":
                n_gpu = max(n_gpu, pos + 1)
    for r in nic_rows:
        cells = r[1 : width + 1]
        if "X" in cells:
            nic_pos = cells.index("X")
            label = r[0]
            m = re.match(r"^NIC(\d+)$", label)
            k = int(m.group(1)) if m else 0
            n_gpu = max(n_gpu, nic_pos - k)
            break
    n_gpu = min(n_gpu, width)
    header = [f"GPU{i}" for i in range(n_gpu)] + [f"NIC{j}" for j in range(width - n_gpu)]
    # trailing values of GPU rows are the affinity columns, in nvidia-smi's fixed order
    n_extra = max((len(r) - 1 - width for r in gpu_rows), default=0)
    header += ["CPU_AFFINITY", "NUMA_AFFINITY", "GPU_NUMA_ID"][: max(0, n_extra)]
    warnings.append(
        f"header line missing: inferred {n_gpu} GPU and {width - n_gpu} NIC columns from the rows"
    )
    return header


def _build_matrix(
    header: list[str], rows: list[list[str]], legend: dict[str, str], warnings: list[str]
) -> TopoMatrix:
    devices = [t for t in header if t not in _EXTRA_COLUMNS]
    extras = [t for t in header if t in _EXTRA_COLUMNS]
    if len(set(devices)) != len(devices):
        raise ParseError(f"nvidia-smi topo -m: duplicate column names in header {devices}")
    gpu_indices = [int(m.group(1)) for t in devices if (m := _GPU_LABEL_RE.match(t))]
    nics = [TopoNic(label=t, device=legend.get(t)) for t in devices if not _GPU_LABEL_RE.match(t)]
    cells: dict[tuple[str, str], str] = {}
    gpu_rows: dict[int, TopoGpuRow] = {}
    width = len(devices)
    seen_rows: set[str] = set()
    for tokens in rows:
        label = tokens[0]
        if label not in devices:
            warnings.append(f"row {label!r} is not a column of the header; ignored")
            continue
        if label in seen_rows:
            warnings.append(f"row {label!r} appears twice; kept the first")
            continue
        seen_rows.add(label)
        values = tokens[1:]
        matrix_part = values[:width]
        if len(matrix_part) < width:
            warnings.append(f"row {label} has {len(matrix_part)} of {width} cells (truncated)")
        self_pos = devices.index(label)
        if self_pos < len(matrix_part) and matrix_part[self_pos] != "X":
            warnings.append(f"row {label}: expected X at its own column")
        for col, value in zip(devices, matrix_part, strict=False):
            if col == label or value == "X":
                continue
            if not re.fullmatch(r"[A-Z][A-Z0-9]{1,7}", value):
                warnings.append(f"row {label}: unreadable cell {value!r} under {col}")
                continue
            cells[(label, col)] = value
        m = _GPU_LABEL_RE.match(label)
        if m:
            gidx = int(m.group(1))
            gpu_rows[gidx] = _extras(gidx, extras, values[width:], warnings)
    for a, b in list(cells):
        back = cells.get((b, a))
        if back is not None and back != cells[(a, b)]:
            warnings.append(f"asymmetric matrix: {a}->{b} {cells[(a, b)]} but {b}->{a} {back}")
    missing = [d for d in devices if d not in seen_rows]
    if missing:
        warnings.append(f"partial output: no rows for {', '.join(missing)}")
    if not gpu_indices:
        raise ParseError("nvidia-smi topo -m: the matrix has no GPU columns")
    return TopoMatrix(
        gpu_indices=gpu_indices,
        nics=nics,
        rows=gpu_rows,
        cells=cells,
        header_present=True,
        warnings=warnings,
    )


# --------------------------------------------------------------------------- nvlink


@dataclass(frozen=True)
class NvlinkLink:
    """One NVLink of one GPU."""

    link: int
    active: bool
    speed_gbps: float | None = None
    remote_bus_id: str | None = None
    remote_link: int | None = None


@dataclass
class NvlinkGpu:
    """The NVLinks of one GPU from ``nvidia-smi nvlink --status`` / ``-s`` / ``-R``."""

    index: int
    name: str | None = None
    uuid: str | None = None
    links: list[NvlinkLink] = field(default_factory=list)
    note: str | None = None

    @property
    def active_links(self) -> list[NvlinkLink]:
        return [lk for lk in self.links if lk.active]


_GPU_HEAD_RE = re.compile(r"^\s*GPU\s+(\d{1,4})\s*:(?:\s+(.*?))?\s*(?:\(UUID:\s*([^)]*)\))?\s*$")
_LINK_RE = re.compile(r"^\s*Link\s+(\d+)\s*:\s*(.*?)\s*$", re.I)
_SPEED_RE = re.compile(r"([\d.]+)\s*([GM])B/s", re.I)
_REMOTE_RE = re.compile(
    r"Remote\s+Device\s+((?:[0-9A-Fa-f]{4,8}:)?[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])"
    r"(?:\s*:\s*Link\s+(\d+))?",
    re.I,
)


def normalise_bus_id(bus_id: str) -> str:
    """``00000000:07:00.0`` / ``0000:07:00.0`` / ``07:00.0`` -> ``0000:07:00.0`` (lower case)."""
    bus_id = bus_id.strip().lower()
    parts = bus_id.split(":")
    if len(parts) == 2:
        return f"0000:{bus_id}"
    if len(parts) == 3:
        dom = parts[0][-4:].rjust(4, "0")
        return f"{dom}:{parts[1]}:{parts[2]}"
    return bus_id


def parse_nvlink(text: str) -> list[NvlinkGpu]:
    """Parse ``nvidia-smi nvlink --status``/``-s`` (speeds) or ``-R`` (remote ends)."""
    text = clean_text(text)
    raise_if_driver_error(text, "nvidia-smi nvlink")
    gpus: list[NvlinkGpu] = []
    current: NvlinkGpu | None = None
    for line in text.split("\n"):
        if not line.strip():
            continue
        head = _GPU_HEAD_RE.match(line)
        if head:
            current = NvlinkGpu(
                index=int(head.group(1)),
                name=head.group(2) or None,
                uuid=(head.group(3) or "").strip() or None,
            )
            gpus.append(current)
            continue
        link = _LINK_RE.match(line)
        if link and current is not None:
            current.links.append(_parse_link(int(link.group(1)), link.group(2)))
            continue
        if current is not None and re.search(r"inactive|not supported|unable", line, re.I):
            current.note = line.strip()
    if not gpus:
        raise ParseError(
            "nvidia-smi nvlink: no 'GPU N: <name>' lines found (expected --status, -s or -R output)"
        )
    return gpus


def _parse_link(number: int, body: str) -> NvlinkLink:
    remote = _REMOTE_RE.search(body)
    if remote:
        return NvlinkLink(
            link=number,
            active=True,
            remote_bus_id=normalise_bus_id(remote.group(1)),
            remote_link=int(remote.group(2)) if remote.group(2) else None,
        )
    if re.search(r"inactive|disabled|down|not active|N/A", body, re.I):
        return NvlinkLink(link=number, active=False)
    speed = _SPEED_RE.search(body)
    if speed:
        try:
            value = float(speed.group(1))
        except ValueError:
            return NvlinkLink(link=number, active=False)
        if speed.group(2).upper() == "M":
            value /= 1000.0
        return NvlinkLink(link=number, active=value > 0, speed_gbps=value)
    return NvlinkLink(link=number, active=False)


def merge_nvlink(*reports: Iterable[NvlinkGpu]) -> list[NvlinkGpu]:
    """Merge ``--status`` and ``-R`` reports of the same GPUs link by link."""
    by_index: dict[int, NvlinkGpu] = {}
    for report in reports:
        for g in report:
            have = by_index.get(g.index)
            if have is None:
                by_index[g.index] = NvlinkGpu(g.index, g.name, g.uuid, list(g.links), g.note)
                continue
            links = {lk.link: lk for lk in have.links}
            for lk in g.links:
                old = links.get(lk.link)
                if old is None:
                    links[lk.link] = lk
                else:
                    links[lk.link] = NvlinkLink(
                        link=lk.link,
                        active=old.active or lk.active,
                        speed_gbps=old.speed_gbps if old.speed_gbps is not None else lk.speed_gbps,
                        remote_bus_id=old.remote_bus_id or lk.remote_bus_id,
                        remote_link=old.remote_link
                        if old.remote_link is not None
                        else lk.remote_link,
                    )
            have.links = [links[k] for k in sorted(links)]
            have.name = have.name or g.name
            have.uuid = have.uuid or g.uuid
    return [by_index[k] for k in sorted(by_index)]


# --------------------------------------------------------------------------- -q Fabric


@dataclass(frozen=True)
class FabricInfo:
    """The Fabric section of ``nvidia-smi -q`` for one GPU (bus id None when not shown)."""

    bus_id: str | None
    state: str | None
    status: str | None
    clique_id: str | None
    cluster_uuid: str | None
    health: str | None = None
    product_name: str | None = None

    @property
    def in_mnnvl_domain(self) -> bool:
        """True only for a registered fabric: status Success and a non-zero ClusterUUID."""
        if self.status is None or self.status.strip().lower() != "success":
            return False
        if self.state is not None and self.state.strip().lower() not in {"completed", "success"}:
            return False
        uuid = (self.cluster_uuid or "").strip().lower()
        return bool(uuid) and uuid != "n/a" and set(uuid) - {"0", "-"} != set()

    @property
    def healthy(self) -> bool | None:
        if self.health is None or self.health.upper() == "N/A":
            return None
        return self.health.strip().lower() == "healthy"


@dataclass(frozen=True)
class SmiGpu:
    """One ``GPU <bus id>`` block of ``nvidia-smi -q`` (the fields topology needs)."""

    bus_id: str
    product_name: str | None
    uuid: str | None
    fabric: FabricInfo | None


_KV_RE = re.compile(r"^(\s*)([^:]+?)\s*:\s*(.*?)\s*$")
_GPU_BLOCK_RE = re.compile(
    r"^GPU\s+((?:[0-9A-Fa-f]{4,8}:)?[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s*$"
)


def _indent(line: str) -> int:
    return len(line.expandtabs(4)) - len(line.expandtabs(4).lstrip())


def parse_smi_query(text: str) -> list[SmiGpu]:
    """Per-GPU name, UUID and Fabric section from ``nvidia-smi -q`` (full or grep excerpt).

    A Fabric block that appears without a ``GPU <bus id>`` line above it (grep or pasted
    excerpt) is returned with ``bus_id`` ``""``.
    """
    text = clean_text(text)
    raise_if_driver_error(text, "nvidia-smi -q")
    gpus: list[SmiGpu] = []
    bus: str | None = None
    name: str | None = None
    uuid: str | None = None
    fabric: dict[str, str] | None = None
    fabric_indent = -1
    in_health = False
    found_fabric = False

    def flush() -> None:
        nonlocal fabric
        if bus is None and fabric is None:
            return
        fab = None
        if fabric is not None:
            fab = FabricInfo(
                bus_id=bus,
                state=fabric.get("state"),
                status=fabric.get("status"),
                clique_id=fabric.get("cliqueid"),
                cluster_uuid=fabric.get("clusteruuid"),
                health=fabric.get("summary"),
                product_name=name,
            )
        gpus.append(SmiGpu(bus_id=bus or "", product_name=name, uuid=uuid, fabric=fab))
        fabric = None

    for raw in text.split("\n"):
        line = raw.rstrip()
        if not line.strip() or line.strip() == "--":
            continue
        block = _GPU_BLOCK_RE.match(line.strip()) if _indent(line) == 0 else None
        if block:
            if bus is not None or fabric is not None:
                flush()
            bus, name, uuid = normalise_bus_id(block.group(1)), None, None
            continue
        ind = _indent(line)
        if line.strip() == "Fabric":
            if fabric is not None:
                flush()
            fabric, fabric_indent, in_health, found_fabric = {}, ind, False, True
            continue
        if fabric is not None and ind <= fabric_indent:
            fabric_indent = -1
            if ind == 0 and bus is None:
                flush()
                fabric = None
            else:
                in_health = False
        kv = _KV_RE.match(line)
        key = kv.group(2).strip().lower().replace(" ", "") if kv else line.strip().lower()
        if fabric is not None and fabric_indent >= 0:
            if key == "health" and not (kv and kv.group(3)):
                in_health = True
                continue
            if kv:
                k = key if not in_health else ("summary" if key == "summary" else f"h.{key}")
                fabric.setdefault(k, kv.group(3))
            continue
        if kv and key == "productname" and name is None:
            name = kv.group(3)
        elif kv and key == "gpuuuid" and uuid is None:
            uuid = kv.group(3)
    if bus is not None or fabric is not None:
        flush()
    if not gpus or (not found_fabric and all(g.bus_id == "" for g in gpus)):
        raise ParseError(
            "nvidia-smi -q: found neither a 'GPU <bus id>' block nor a 'Fabric' section"
        )
    return gpus


def parse_fabric(text: str) -> list[FabricInfo]:
    """Just the Fabric sections of ``nvidia-smi -q`` (one per GPU block that has one)."""
    out = [g.fabric for g in parse_smi_query(text) if g.fabric is not None]
    if not out:
        raise ParseError("nvidia-smi -q: no 'Fabric' section found (driver older than R530?)")
    return out
