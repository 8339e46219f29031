"""Parsers for ``lspci -tv`` / ``lspci -t`` (the PCIe tree) and ``lspci [-vvv]`` listings.

The tree gives each device's chain of bridges up to its root complex, which is enough to
classify a pair the way nvidia-smi does: PIX (at most one switch/bridge between them), PXB
(several bridges, no host bridge), PHB (through the host bridge of one root complex), and
NODE/SYS (different root complexes; SYS when their NUMA nodes differ).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from topkv.topology.detect.errors import ParseError
from topkv.topology.detect.nvidia_smi import clean_text, normalise_bus_id

_TOKEN_RE = re.compile(
    r"\[(?:(?P<dom>[0-9a-fA-F]{4,8}):)?(?P<bus>[0-9a-fA-F]{2})(?:-[0-9a-fA-F]{2})?\]"
    r"|(?P<dev>[0-9a-fA-F]{2}\.[0-7])"
)
_DESC_SPLIT_RE = re.compile(r"([0-9a-fA-F]{2}\.[0-7])  +(\S.*)$")
_GPU_DESC_RE = re.compile(
    r"(NVIDIA|\[10de:|10de:).*?(VGA|3D|GPU|Tesla|H100|H200|H20|A100|B200|RTX|GeForce|Quadro|"
    r"Device [0-9a-f]{4}|G[A-Z]?\d{3}|AD\d{3}|GB\d{3})"
    r"|AMD/ATI.*(Instinct|MI\d{3}|Aqua Vanjaram|Radeon)"
    r"|^(10de|1002):[0-9a-f]{4}",
    re.I,
)
_NOT_GPU_RE = re.compile(r"Audio|NVSwitch|USB|bridge|Switch|SMBus|\bLPC\b", re.I)
_NIC_DESC_RE = re.compile(
    r"Mellanox|ConnectX|BlueField|Infiniband|Ethernet|Network controller|NetXtreme|bnxt|"
    r"Pensando|\[15b3:|^15b3:|^14e4:16d",
    re.I,
)

_RDMA_DESC_RE = re.compile(
    r"Mellanox|ConnectX|BlueField|Infiniband|bnxt|BCM57[45]|Pensando|\[15b3:|^15b3:", re.I
)


@dataclass
class PciDevice:
    """One device (function) in the tree."""

    bus_id: str
    description: str | None
    parent: str | None  # bus id of the bridge above, None when on a root bus
    root: str  # "dddd:bb" of the root bus
    children: list[str] = field(default_factory=list)

    @property
    def is_gpu(self) -> bool:
        d = self.description or ""
        return bool(_GPU_DESC_RE.search(d)) and not _NOT_GPU_RE.search(d)

    @property
    def is_nic(self) -> bool:
        return bool(_NIC_DESC_RE.search(self.description or ""))

    @property
    def is_rdma_nic(self) -> bool:
        return bool(_RDMA_DESC_RE.search(self.description or ""))


@dataclass
class PciTree:
    """The PCIe hierarchy from ``lspci -t[v]``."""

    devices: dict[str, PciDevice]
    roots: list[str]

    def gpus(self) -> list[PciDevice]:
        return sorted((d for d in self.devices.values() if d.is_gpu), key=lambda d: d.bus_id)

    def nics(self) -> list[PciDevice]:
        return sorted((d for d in self.devices.values() if d.is_nic), key=lambda d: d.bus_id)

    def bridges_above(self, bus_id: str) -> list[str]:
        """Bridges from the device's parent up to the root port (nearest first)."""
        out: list[str] = []
        dev = self.devices[normalise_bus_id(bus_id)]
        while dev.parent is not None:
            out.append(dev.parent)
            dev = self.devices[dev.parent]
        return out

    def path_type(self, a: str, b: str, numa_of_root: dict[str, int] | None = None) -> str:
        """nvidia-smi style path type between two devices of this tree."""
        a, b = normalise_bus_id(a), normalise_bus_id(b)
        if a not in self.devices or b not in self.devices:
            missing = a if a not in self.devices else b
            raise ParseError(f"lspci: device {missing} is not in the tree")
        if a == b:
            return "X"
        da, db = self.devices[a], self.devices[b]
        if da.root != db.root:
            if numa_of_root is not None:
                na, nb = numa_of_root.get(da.root), numa_of_root.get(db.root)
                if na is not None and nb is not None and na != nb:
                    return "SYS"
            return "NODE"
        up_a, up_b = self.bridges_above(a), self.bridges_above(b)
        common = [x for x in up_a if x in set(up_b)]
        if not common:
            return "PHB"
        lca = common[0]
        hops = up_a.index(lca) + up_b.index(lca)
        # Same bridge (hops 0) or two ports of one switch (upstream -> two downstream): PIX.
        return "PIX" if hops <= 2 else "PXB"


def parse_lspci_tree(text: str) -> PciTree:
    """Parse ``lspci -tv`` or ``lspci -t`` (also ``-tvnn``)."""
    text = clean_text(text)
    devices: dict[str, PciDevice] = {}
    roots: list[str] = []
    branch: dict[int, tuple[str, str | None]] = {}  # column -> (root-bus "dddd:bb", parent)
    for raw in text.split("\n"):
        line = raw.rstrip()
        if not line.strip():
            continue
        desc_match = _DESC_SPLIT_RE.search(line)
        struct = line[: desc_match.start(2)] if desc_match else line
        description = desc_match.group(2).strip() if desc_match else None
        bus_ctx: tuple[str, str] | None = None  # (domain, bus) for the next device
        parent: str | None = None
        root_key: str | None = None
        last_dev: str | None = None
        first = True
        for m in _TOKEN_RE.finditer(struct):
            after = struct[m.end() :]
            if m.group("bus") is not None:
                if first:
                    dom = (m.group("dom") or "0000")[-4:].lower()
                    root_key = f"{dom}:{m.group('bus').lower()}"
                    if root_key not in roots:
                        roots.append(root_key)
                    bus_ctx, parent = (dom, m.group("bus").lower()), None
                else:
                    if last_dev is None:
                        break
                    dom = last_dev.split(":")[0]
                    bus_ctx, parent = (dom, m.group("bus").lower()), last_dev
                fork = re.match(r"-+\+", after)
                if fork and root_key is not None:
                    col = m.end() + fork.end() - 1
                    branch[col] = (f"{bus_ctx[0]}:{bus_ctx[1]}|{root_key}", parent)
                first = False
                continue
            # a device token
            if bus_ctx is None:
                if not first:
                    break
                col = m.start() - 2
                if col not in branch:
                    raise ParseError(
                        f"lspci -t: cannot place device {m.group('dev')} at column {col + 1} "
                        f"(no branch above it): {line.strip()[:80]!r}"
                    )
                ctx, parent = branch[col]
                busdom, root_key = ctx.split("|")
                dom, bus = busdom.split(":")
                bus_ctx = (dom, bus)
            assert root_key is not None
            bdf = f"{bus_ctx[0]}:{bus_ctx[1]}:{m.group('dev').lower()}"
            is_last_on_line = _TOKEN_RE.search(after) is None
            dev = devices.get(bdf)
            if dev is None:
                dev = PciDevice(
                    bus_id=bdf,
                    description=description if is_last_on_line else None,
                    parent=parent,
                    root=root_key,
                )
                devices[bdf] = dev
                if parent is not None and parent in devices:
                    devices[parent].children.append(bdf)
            last_dev, bus_ctx, first = bdf, None, False
    if not devices:
        raise ParseError(
            "lspci -t: no devices found (expected a tree like '-[0000:00]-+-00.0  ...')"
        )
    return PciTree(devices=devices, roots=roots)


# --------------------------------------------------------------------------- lspci [-vvv]


@dataclass
class PciDeviceDetail:
    """One device from ``lspci`` / ``lspci -vvv`` (fields absent in plain output stay None)."""

    bus_id: str
    device_class: str
    description: str
    numa_node: int | None = None
    port_type: str | None = None
    secondary_bus: str | None = None
    subordinate_bus: str | None = None
    link_cap_gts: float | None = None
    link_cap_width: int | None = None
    link_speed_gts: float | None = None
    link_width: int | None = None
    link_downgraded: bool = False
    driver: str | None = None

    @property
    def is_bridge(self) -> bool:
        return "bridge" in self.device_class.lower()

    @property
    def is_gpu(self) -> bool:
        cls = self.device_class.lower()
        return ("vga" in cls or "3d" in cls or "display" in cls or "processing accel" in cls) and (
            "nvidia" in self.description.lower() or "amd" in self.description.lower()
        )

    @property
    def link_cap_gbps(self) -> float | None:
        """Usable one-direction bandwidth of the link capability (GB/s)."""
        if self.link_cap_gts is None or self.link_cap_width is None:
            return None
        return pcie_lane_gbps(self.link_cap_gts) * self.link_cap_width


_HEAD_RE = re.compile(
    r"^((?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\s+([^:]+?)\s*:\s*(.*?)\s*$"
)
_LNK_RE = re.compile(r"Speed\s+([\d.]+)GT/s(\s*\(downgraded\))?,\s*Width\s+x(\d+)", re.I)


def pcie_lane_gbps(gts: float) -> float:
    """GB/s per lane per direction after line coding (8b/10b to Gen2, 128b/130b from Gen3)."""
    if gts <= 5.0:
        return gts * 0.8 / 8.0
    return gts * 128.0 / 130.0 / 8.0


def parse_lspci_listing(text: str) -> list[PciDeviceDetail]:
    """Parse plain ``lspci`` or ``lspci -vvv`` (any subset of devices, excerpts welcome)."""
    text = clean_text(text)
    out: list[PciDeviceDetail] = []
    cur: PciDeviceDetail | None = None
    for raw in text.split("\n"):
        line = raw.rstrip()
        if not line.strip():
            continue
        head = _HEAD_RE.match(line) if not line[0].isspace() else None
        if head:
            cur = PciDeviceDetail(
                bus_id=normalise_bus_id(head.group(1)),
                device_class=head.group(2).strip(),
                description=head.group(3),
            )
            out.append(cur)
            continue
        if cur is None:
            continue
        s = line.strip()
        if s.startswith("NUMA node:"):
            value = s.split(":", 1)[1].strip()
            cur.numa_node = int(value) if re.fullmatch(r"-?\d{1,4}", value) else None
            if cur.numa_node is not None and cur.numa_node < 0:
                cur.numa_node = None
        elif s.startswith("Bus:"):
            sec = re.search(r"secondary=([0-9a-fA-F]{2})", s)
            sub = re.search(r"subordinate=([0-9a-fA-F]{2})", s)
            cur.secondary_bus = sec.group(1).lower() if sec else None
            cur.subordinate_bus = sub.group(1).lower() if sub else None
        elif "Express (" in s and s.startswith("Capabilities:"):
            pt = re.search(r"Express \(v\d\)\s+(.*?)(?:\s*\(|,|$)", s)
            cur.port_type = pt.group(1).strip() if pt else None
        elif s.startswith(("LnkCap:", "LnkSta:")):
            lm = _LNK_RE.search(s)
            if lm:
                speed, width = float(lm.group(1)), int(lm.group(3))
                if s.startswith("LnkCap:"):
                    cur.link_cap_gts, cur.link_cap_width = speed, width
                else:
                    cur.link_speed_gts, cur.link_width = speed, width
                    cur.link_downgraded = lm.group(2) is not None
        elif s.startswith("Kernel driver in use:"):
            cur.driver = s.split(":", 1)[1].strip() or None
    if not out:
        raise ParseError(
            "lspci: no device lines found (expected '01:00.0 3D controller: NVIDIA ...')"
        )
    return out


@dataclass(frozen=True)
class PcieSwitch:
    """A PCIe switch: its upstream port and the downstream ports below it."""

    upstream: str
    downstream: list[str]
    description: str


def switches_from_listing(devices: list[PciDeviceDetail]) -> list[PcieSwitch]:
    """Group bridges into switches.

    With ``-vvv`` (``Bus: secondary=``), a switch is an upstream-port bridge and the bridges
    on its secondary bus. Without it (plain ``lspci``), bridges with the same description on
    bus N+1 are taken as the downstream ports of the one on bus N (the common layout).
    """
    bridges = [d for d in devices if d.is_bridge]
    by_bus: dict[str, list[PciDeviceDetail]] = {}
    for d in bridges:
        by_bus.setdefault(d.bus_id.rsplit(":", 1)[0], []).append(d)
    out: list[PcieSwitch] = []
    for d in bridges:
        dom = d.bus_id.split(":")[0]
        if d.secondary_bus is not None:
            if d.port_type is not None and "upstream" not in d.port_type.lower():
                continue
            below = by_bus.get(f"{dom}:{d.secondary_bus}", [])
        else:
            bus = int(d.bus_id.split(":")[1], 16)
            if int(d.bus_id.split(":")[2].split(".")[0], 16) != 0:
                continue
            below = [
                x for x in by_bus.get(f"{dom}:{bus + 1:02x}", []) if x.description == d.description
            ]
        if below:
            out.append(
                PcieSwitch(
                    upstream=d.bus_id,
                    downstream=[x.bus_id for x in below],
                    description=d.description,
                )
            )
    return out
