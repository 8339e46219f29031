"""Readers of the Linux sysfs topology files.

Each reader takes the filesystem ``root`` (default ``/``) so tests can build a fake tree
under ``tmp_path``. A missing directory means "none of those here" and gives an empty result
(no RDMA stack, a kernel without NUMA); a file whose content makes no sense raises
:class:`ParseError` naming the file.

- :func:`read_infiniband`: ``/sys/class/infiniband/<dev>/ports/<n>/{state,phys_state,rate,
  link_layer,lid}``, ``<dev>/{node_guid,fw_ver,hca_type}`` and the netdev from
  ``<dev>/device/net/<ifname>`` (matched to the port by ``dev_port`` when a PCI function
  carries several ports).
- :func:`read_pci_devices` / :func:`read_pci_numa`: ``/sys/bus/pci/devices/<bdf>/
  {vendor,device,class,numa_node}``.
- :func:`read_numa_nodes`: ``/sys/devices/system/node/node<N>/{cpulist,meminfo,distance}``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from topkv.topology.detect.errors import ParseError
from topkv.topology.detect.numa import NumaNodeInfo, parse_cpu_list
from topkv.topology.detect.rdma import (
    RdmaPort,
    normalize_guid,
    normalize_link_layer,
    normalize_phys_state,
    normalize_state,
    parse_rate_gbps,
)

ROOT = Path("/")
NVIDIA_VENDOR = 0x10DE
AMD_VENDOR = 0x1002
GPU_VENDORS = frozenset({NVIDIA_VENDOR, AMD_VENDOR})
# PCI base class/subclass (class >> 8): VGA 0x0300, 3D 0x0302, other display 0x0380 (some
# AMD Instinct), processing accelerator 0x1200 (AMD MI300-class).
GPU_CLASSES = frozenset({0x0300, 0x0302, 0x0380, 0x1200})
NIC_CLASSES = frozenset({0x0200, 0x0207})  # Ethernet, InfiniBand


def _read(path: Path) -> str | None:
    """A sysfs attribute's text without the trailing newline; ``None`` if unreadable."""
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def _sorted_dirs(path: Path, pattern: str) -> list[Path]:
    try:
        entries = [p for p in path.glob(pattern) if p.is_dir()]
    except OSError:
        return []
    return sorted(
        entries, key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]
    )


def _hex(path: Path) -> int:
    text = _read(path)
    if text is None:
        raise ParseError(f"sysfs: cannot read {path}")
    try:
        return int(text, 16)
    except ValueError:
        raise ParseError(f"sysfs: {path} holds {text[:30]!r}, not a hex number") from None


# --------------------------------------------------------------------------- InfiniBand


def _netdevs_by_port(device_dir: Path) -> dict[int, str]:
    """Map port number -> netdev for an RDMA device's PCI function."""
    net_dir = device_dir / "device" / "net"
    found: dict[int, str] = {}
    netdevs = sorted(p.name for p in _sorted_dirs(net_dir, "*"))
    for name in netdevs:
        dev_port = _read(net_dir / name / "dev_port")
        port = int(dev_port) + 1 if dev_port and dev_port.isdigit() else 1
        found.setdefault(port, name)
    return found


def read_infiniband(root: Path = ROOT) -> list[RdmaPort]:
    """Every RDMA port under ``/sys/class/infiniband`` (``[]`` when there is none)."""
    base = root / "sys" / "class" / "infiniband"
    ports: list[RdmaPort] = []
    for device_dir in _sorted_dirs(base, "*"):
        netdevs = _netdevs_by_port(device_dir)
        for port_dir in _sorted_dirs(device_dir / "ports", "*"):
            if not port_dir.name.isdigit():
                continue
            port = int(port_dir.name)
            lid = _read(port_dir / "lid")
            try:
                lid_value = int(lid, 0) if lid else None
            except ValueError:
                lid_value = None
            ports.append(
                RdmaPort(
                    device=device_dir.name,
                    port=port,
                    state=normalize_state(_read(port_dir / "state")),
                    phys_state=normalize_phys_state(_read(port_dir / "phys_state")),
                    link_layer=normalize_link_layer(_read(port_dir / "link_layer")),
                    rate_gbps=parse_rate_gbps(_read(port_dir / "rate")),
                    netdev=netdevs.get(port),
                    node_guid=normalize_guid(_read(device_dir / "node_guid")),
                    lid=lid_value,
                    fw_version=_read(device_dir / "fw_ver") or None,
                    ca_type=_read(device_dir / "hca_type") or None,
                )
            )
    return ports


# --------------------------------------------------------------------------- PCI


@dataclass(frozen=True)
class SysfsPciDevice:
    """One PCI function: ``bdf`` like ``0000:17:00.0``, IDs as integers, full 24-bit class."""

    bdf: str
    vendor: int
    device: int
    pci_class: int
    numa_node: int | None  # None: the kernel reports -1 (no affinity) or nothing

    @property
    def is_gpu(self) -> bool:
        """An NVIDIA or AMD display/3D controller or accelerator."""
        return self.vendor in GPU_VENDORS and (self.pci_class >> 8) in GPU_CLASSES

    @property
    def is_nic(self) -> bool:
        """An Ethernet or InfiniBand controller."""
        return (self.pci_class >> 8) in NIC_CLASSES


def read_pci_devices(root: Path = ROOT) -> list[SysfsPciDevice]:
    """All functions under ``/sys/bus/pci/devices``, sorted by BDF."""
    base = root / "sys" / "bus" / "pci" / "devices"
    devices: list[SysfsPciDevice] = []
    for dev_dir in _sorted_dirs(base, "*"):
        numa_text = _read(dev_dir / "numa_node")
        numa: int | None = None
        if numa_text:
            try:
                numa = int(numa_text)
            except ValueError:
                raise ParseError(
                    f"sysfs: {dev_dir / 'numa_node'} holds {numa_text[:30]!r}"
                ) from None
        devices.append(
            SysfsPciDevice(
                bdf=dev_dir.name,
                vendor=_hex(dev_dir / "vendor"),
                device=_hex(dev_dir / "device"),
                pci_class=_hex(dev_dir / "class"),
                numa_node=numa if numa is not None and numa >= 0 else None,
            )
        )
    return sorted(devices, key=lambda d: d.bdf)


def read_pci_numa(root: Path = ROOT) -> dict[str, int]:
    """BDF -> NUMA node for every PCI function with a known node (``-1`` ones are left out)."""
    return {d.bdf: d.numa_node for d in read_pci_devices(root) if d.numa_node is not None}


# --------------------------------------------------------------------------- NUMA

_MEMINFO = re.compile(r"^Node\s+\d+\s+(MemTotal|MemFree):\s+(\d+)\s*kB", re.MULTILINE)


def read_numa_nodes(root: Path = ROOT) -> list[NumaNodeInfo]:
    """NUMA nodes from ``/sys/devices/system/node`` (``[]`` on a kernel without NUMA)."""
    base = root / "sys" / "devices" / "system" / "node"
    nodes: list[NumaNodeInfo] = []
    for node_dir in _sorted_dirs(base, "node*"):
        m = re.fullmatch(r"node(\d+)", node_dir.name)
        if not m:
            continue
        cpulist = _read(node_dir / "cpulist")
        try:
            cpus = parse_cpu_list(cpulist or "")
        except ParseError as exc:
            raise ParseError(f"sysfs: {node_dir / 'cpulist'}: {exc}") from None
        meminfo = {
            k: int(v) // 1024 for k, v in _MEMINFO.findall(_read(node_dir / "meminfo") or "")
        }
        distance_text = _read(node_dir / "distance")
        distances: tuple[int, ...] | None = None
        if distance_text:
            if not re.fullmatch(r"\d+(\s+\d+)*", distance_text):
                raise ParseError(f"sysfs: {node_dir / 'distance'} holds {distance_text[:40]!r}")
            distances = tuple(int(x) for x in distance_text.split())
        nodes.append(
            NumaNodeInfo(
                node_id=int(m.group(1)),
                cpus=cpus,
                memory_mb=meminfo.get("MemTotal"),
                free_mb=meminfo.get("MemFree"),
                distances=distances,
            )
        )
    return sorted(nodes, key=lambda n: n.node_id)
