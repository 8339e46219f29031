"""Assembly: fold every available tool output into one :class:`Node`.

Sources, in order of preference for each fact:

* GPUs and GPU-GPU / GPU-NIC path types: ``nvidia-smi topo -m``, else NVML, else
  ``nvidia-smi nvlink -R`` (NVLink pairs) plus the ``lspci -t`` tree (PCIe pairs), else
  ``rocm-smi --showtopo`` (AMD). Names and bus ids from ``nvidia-smi -q``, NVML,
  ``nvlink --status`` headers, lspci (GPUs numbered in bus order, as nvidia-smi does by
  default) and Kubernetes labels.
* NICs: the topo legend, merged by device name with ibstat / ibv_devinfo / ibstatus /
  ibdev2netdev / rdma link / /sys/class/infiniband (netdev, link layer, rate, state).
* NUMA nodes: ``numactl -H``, else ``lscpu``, else /sys/devices/system/node.
* NVLink domains: NV# components in the node (NVL8); a registered MNNVL fabric (Fabric
  Status Success, non-zero ClusterUUID) or the ``nvidia.com/gpu.clique`` label (NVL72).

Whatever was missing or assumed is written to ``Node.notes``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from topkv.topology.detect import k8s, numa, rdma, rocm
from topkv.topology.detect.errors import NoUsableDriverError, ParseError
from topkv.topology.detect.lspci import PciTree, parse_lspci_listing, parse_lspci_tree
from topkv.topology.detect.nvidia_smi import (
    FabricInfo,
    NvlinkGpu,
    TopoMatrix,
    merge_nvlink,
    parse_nvlink,
    parse_smi_query,
    parse_topo_matrix,
)
from topkv.topology.model import (
    GPU,
    NIC,
    LinkLayer,
    MemoryTier,
    Node,
    NumaCandidate,
    NumaNode,
    NVLinkDomain,
)
from topkv.topology.paths import make_link, nvlink_generation_for
from topkv.topology.probes import (
    PROBES,
    CommandRunner,
    NvmlSnapshot,
    probe_nvml,
    read_probe_output,
)

# SPEC "Reference numbers": HBM3 ~100 ns, 3,350 GB/s; CXL 3.0 Type 3 150 ns, 64 GB/s.
_HBM = {"latency_ns": 100.0, "bandwidth_gbps": 3350.0}
_CXL = {"latency_ns": 150.0, "bandwidth_gbps": 64.0}
# Local DRAM is not in the SPEC: ~100 ns load-to-use and one DDR5-4800 channel (38.4 GB/s)
# per memory controller are the conservative figures we assume (labelled "assumed").
_DRAM = {"latency_ns": 100.0, "bandwidth_gbps": 38.4}


@dataclass
class RawOutputs:
    """Tool outputs by kind (keys of :data:`topkv.topology.probes.PROBES`)."""

    texts: dict[str, str] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    nvml: NvmlSnapshot | None = None
    sysfs_root: Path | None = None


def collect(
    runner: CommandRunner,
    kinds: list[str] | None = None,
    timeout_s: float = 15.0,
) -> RawOutputs:
    """Run each probe through ``runner``; failures are recorded, never raised."""
    raw = RawOutputs()
    for kind in kinds if kinds is not None else [k for k, s in PROBES.items() if s.local]:
        spec = PROBES[kind]
        got = runner.run(spec.argv, timeout_s)
        if got.status == "ok" or (got.status == "failed" and got.text.strip()):
            raw.texts[kind] = got.text
            raw.origins[kind] = got.source
        else:
            raw.missing[kind] = f"{got.status} ({got.source})"
    return raw


# --------------------------------------------------------------------------- parsing


@dataclass
class _Parsed:
    topo: TopoMatrix | None = None
    nvlink: list[NvlinkGpu] = field(default_factory=list)
    smi: list[Any] = field(default_factory=list)
    tree: PciTree | None = None
    pci_numa: dict[str, int] = field(default_factory=dict)
    ports: list[rdma.RdmaPort] = field(default_factory=list)
    numa_nodes: list[numa.NumaNodeInfo] = field(default_factory=list)
    lscpu: numa.LscpuInfo | None = None
    rocm: rocm.RocmTopology | None = None
    labels: k8s.GpuNodeLabels | None = None
    k8s_name: str | None = None


_RDMA_PARSERS: dict[str, Callable[[str], list[rdma.RdmaPort]]] = {
    "ibstat": rdma.parse_ibstat,
    "ibv-devinfo": rdma.parse_ibv_devinfo,
    "ibstatus": rdma.parse_ibstatus,
    "ibdev2netdev": rdma.parse_ibdev2netdev,
    "rdma-link": rdma.parse_rdma_link,
}


def _parse_all(raw: RawOutputs, strict: bool, notes: list[str], sources: list[str]) -> _Parsed:
    p = _Parsed()

    def attempt(kind: str, fn: Callable[[str], Any]) -> Any:
        text = raw.texts.get(kind)
        if text is None:
            return None
        try:
            value = fn(text)
        except NoUsableDriverError as exc:
            if strict:
                raise NoUsableDriverError(f"{raw.origins.get(kind, kind)}: {exc}") from None
            notes.append(f"{kind}: {exc}")
            return None
        except ParseError as exc:
            if strict:  # saved outputs: the message starts with the file, then the kind
                raise ParseError(f"{raw.origins.get(kind, kind)}: {exc}") from None
            notes.append(f"{kind}: unusable output: {exc}")
            return None
        sources.append(f"{kind}: {raw.origins.get(kind, 'given')}")
        return value

    p.topo = attempt("nvidia-smi-topo", parse_topo_matrix)
    if p.topo is not None:
        notes.extend(f"nvidia-smi topo -m: {w}" for w in p.topo.warnings)
    reports = [r for k in ("nvlink", "nvlink-remote") if (r := attempt(k, parse_nvlink))]
    p.nvlink = merge_nvlink(*reports) if reports else []
    p.smi = attempt("fabric", parse_smi_query) or []
    p.tree = attempt("lspci", parse_lspci_tree)
    listing = attempt("lspci-vvv", parse_lspci_listing) or []
    p.pci_numa = {d.bus_id: d.numa_node for d in listing if d.numa_node is not None}
    port_lists = [r for k, fn in _RDMA_PARSERS.items() if (r := attempt(k, fn))]
    p.numa_nodes = attempt("numactl", numa.parse_numactl_hardware) or []
    p.lscpu = attempt("lscpu", numa.parse_lscpu)
    p.rocm = attempt("rocm-smi", rocm.parse_rocm_smi_showtopo)
    k8s_nodes = attempt("k8s-node", k8s.parse_node_labels) or []
    if k8s_nodes:
        p.k8s_name = k8s_nodes[0].name
        p.labels = k8s.interpret_gpu_labels(k8s_nodes[0])
        if len(k8s_nodes) > 1:
            notes.append(f"k8s-node: {len(k8s_nodes)} nodes in the input; used the first")
    if raw.sysfs_root is not None:
        _read_sysfs(raw.sysfs_root, p, port_lists, notes, sources)
    p.ports = rdma.merge_ports(*port_lists) if port_lists else []
    return p


def _read_sysfs(
    root: Path,
    p: _Parsed,
    port_lists: list[list[rdma.RdmaPort]],
    notes: list[str],
    sources: list[str],
) -> None:
    from topkv.topology import sysfs

    try:
        ib = sysfs.read_infiniband(root)
        if ib:
            port_lists.append(ib)
            sources.append(f"sysfs: {root / 'sys/class/infiniband'}")
        else:
            notes.append("sysfs: no RDMA devices under /sys/class/infiniband")
        for bdf, node in sysfs.read_pci_numa(root).items():
            p.pci_numa.setdefault(bdf, node)
        if not p.numa_nodes:
            p.numa_nodes = sysfs.read_numa_nodes(root)
            if p.numa_nodes:
                sources.append(f"sysfs: {root / 'sys/devices/system/node'}")
        gpus = [d for d in sysfs.read_pci_devices(root) if d.is_gpu]
        if not gpus:
            notes.append("sysfs: no NVIDIA/AMD GPU on the PCI bus")
    except ParseError as exc:
        notes.append(f"sysfs: {exc}")


# --------------------------------------------------------------------------- assembly


def build_node(
    raw: RawOutputs,
    name: str = "node0",
    strict: bool = True,
    gpu_name: str | None = None,
) -> Node:
    """Assemble one node from whatever ``raw`` holds.

    ``strict``: a given output that cannot be parsed raises (the CLI turns that into one
    line); otherwise it is noted and skipped (local probing, where failures are normal).
    ``gpu_name`` overrides the GPU product name (picks the NVLink generation).
    """
    notes: list[str] = [f"{k}: {why}" for k, why in raw.missing.items()]
    sources: list[str] = []
    p = _parse_all(raw, strict, notes, sources)
    node = Node(name=p.k8s_name if name == "node0" and p.k8s_name else name)
    _add_gpus(node, p, raw.nvml, gpu_name, notes)
    _add_nics(node, p, notes)
    _add_links(node, p, raw.nvml, notes)
    _add_numa(node, p, notes)
    _add_domains(node, p, raw.nvml, notes)
    _add_memory_tiers(node, p)
    if raw.nvml is not None:
        sources.append("NVML")
    if not node.gpus:
        notes.append("no GPU found")
    if not node.nics:
        notes.append("no RDMA NIC found")
    node.sources = sources
    node.notes = list(dict.fromkeys(notes))
    return node


def _add_gpus(
    node: Node, p: _Parsed, nvml: NvmlSnapshot | None, gpu_name: str | None, notes: list[str]
) -> None:
    indices: list[int] = []
    if p.topo is not None:
        indices = list(p.topo.gpu_indices)
    elif nvml is not None:
        indices = [g.index for g in nvml.gpus]
    elif p.nvlink:
        indices = [g.index for g in p.nvlink]
    elif p.rocm is not None:
        indices = list(p.rocm.gpus)
    elif p.smi and any(s.bus_id for s in p.smi):
        indices = list(range(len([s for s in p.smi if s.bus_id])))
    elif p.tree is not None and p.tree.gpus():
        indices = list(range(len(p.tree.gpus())))
    elif p.labels is not None and p.labels.count:
        indices = list(range(p.labels.count))
        notes.append("GPUs counted from Kubernetes labels only (no per-GPU detail)")
    amd = p.rocm is not None and p.topo is None and nvml is None
    vendor: Literal["nvidia", "amd"] = "amd" if amd else "nvidia"
    smi_bus = [s for s in p.smi if s.bus_id]
    tree_gpus = [d.bus_id for d in p.tree.gpus()] if p.tree is not None else []
    for pos, idx in enumerate(indices):
        g = GPU(index=idx, vendor=vendor)
        if p.topo is not None and idx in p.topo.rows:
            row = p.topo.rows[idx]
            g.cpu_affinity = row.cpu_affinity
            g.numa = row.numa_affinity[0] if len(row.numa_affinity) == 1 else None
            g.memory_numa = row.gpu_numa_id
        nv = next((x for x in nvml.gpus if x.index == idx), None) if nvml else None
        if nv is not None:
            g.name, g.pci_bus_id, g.uuid = nv.name, nv.bus_id, nv.uuid
            g.numa = g.numa if g.numa is not None else nv.numa
        link_rep = next((x for x in p.nvlink if x.index == idx), None)
        if link_rep is not None:
            g.name = g.name or link_rep.name
            g.uuid = g.uuid or link_rep.uuid
        if len(smi_bus) == len(indices):
            g.pci_bus_id = g.pci_bus_id or smi_bus[pos].bus_id
            g.name = g.name or smi_bus[pos].product_name
            g.uuid = g.uuid or smi_bus[pos].uuid
        if g.pci_bus_id is None and len(tree_gpus) == len(indices):
            g.pci_bus_id = tree_gpus[pos]
        if p.rocm is not None and idx in p.rocm.numa and g.numa is None:
            g.numa = p.rocm.numa[idx]
        if g.numa is None and g.pci_bus_id in p.pci_numa:
            g.numa = p.pci_numa[g.pci_bus_id]
        if g.name is None and p.labels is not None and p.labels.product:
            g.name = p.labels.product
        if gpu_name:
            g.name = gpu_name
        g.nvlink_generation = (nv.nvlink_version if nv else None) or nvlink_generation_for(g.name)
        node.gpus.append(g)
    if node.gpus and all(g.name is None for g in node.gpus):
        notes.append(
            "GPU model unknown (the matrix does not name it): NVLink generation assumed 4 "
            "(25 GB/s per link); pass --gpu-name or add nvlink/-q output"
        )


def _link_layer(value: str | None) -> LinkLayer | None:
    if value == "InfiniBand":
        return LinkLayer.IB
    if value == "Ethernet":
        return LinkLayer.ROCE
    return None


def _add_nics(node: Node, p: _Parsed, notes: list[str]) -> None:
    by_device: dict[str, list[rdma.RdmaPort]] = {}
    for port in p.ports:
        by_device.setdefault(port.device, []).append(port)
    seen: set[str] = set()
    if p.topo is not None:
        for nic in p.topo.nics:
            entry = NIC(name=nic.name, label=nic.label)
            ports = by_device.get(nic.name, [])
            if ports:
                _apply_port(entry, ports)
            node.nics.append(entry)
            seen.add(nic.name)
        if by_device and not all(n.device for n in p.topo.nics):
            notes.append(
                "NIC legend missing from the matrix: NICs keep their NIC# labels and are not "
                "matched to RDMA devices"
            )
    for device, ports in sorted(by_device.items(), key=lambda kv: _natural(kv[0])):
        if device in seen:
            continue
        entry = NIC(name=device)
        _apply_port(entry, ports)
        node.nics.append(entry)
    for entry in node.nics:
        if entry.pci_bus_id and entry.pci_bus_id in p.pci_numa and entry.numa is None:
            entry.numa = p.pci_numa[entry.pci_bus_id]


def _apply_port(entry: NIC, ports: list[rdma.RdmaPort]) -> None:
    active = [x for x in ports if x.state == "ACTIVE"]
    port = (active or sorted(ports, key=lambda x: x.port))[0]
    entry.port = port.port
    entry.netdev = port.netdev
    entry.link_layer = _link_layer(port.link_layer)
    entry.rate_gbps = port.rate_gbps
    entry.state = port.state


def _natural(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _add_links(node: Node, p: _Parsed, nvml: NvmlSnapshot | None, notes: list[str]) -> None:
    gen = {g.index: g.nvlink_generation for g in node.gpus}
    if p.topo is not None:
        for a, b, t in p.topo.gpu_pairs():
            node.links.append(make_link(f"GPU{a}", f"GPU{b}", t, gen.get(a), "nvidia-smi topo -m"))
        for g, nic, t in p.topo.gpu_nic_pairs():
            node.links.append(make_link(f"GPU{g}", nic, t, gen.get(g), "nvidia-smi topo -m"))
        _nic_numa_from_matrix(node)
        return
    if nvml is not None:
        counts = _nvlink_pair_counts({g.index: (g.bus_id, g.nvlinks) for g in nvml.gpus})
        for (a, b), pcie in sorted(nvml.pcie.items()):
            t = f"NV{counts[(a, b)]}" if counts.get((a, b)) else pcie
            node.links.append(make_link(f"GPU{a}", f"GPU{b}", t, gen.get(a), "NVML"))
        return
    bus = {g.index: g.pci_bus_id for g in node.gpus}
    counts = {}
    if p.nvlink:
        counts = _nvlink_pair_counts(
            {g.index: (bus.get(g.index) or "", g.links) for g in p.nvlink if g.index in bus}
        )
    if p.rocm is not None:
        for (a, b), t in sorted(p.rocm.link_types.items()):
            if a < b:
                node.links.append(make_link(f"GPU{a}", f"GPU{b}", t, None, "rocm-smi --showtopo"))
        return
    root_numa = _root_numa(p)
    idx = [g.index for g in node.gpus]
    for i, a in enumerate(idx):
        for b in idx[i + 1 :]:
            if counts.get((a, b)):
                t, src = f"NV{counts[(a, b)]}", "nvidia-smi nvlink -R"
            elif p.tree is not None and _in_tree(p.tree, bus.get(a), bus.get(b)):
                t = p.tree.path_type(bus[a] or "", bus[b] or "", root_numa)
                src = "lspci -t"
            else:
                continue
            node.links.append(make_link(f"GPU{a}", f"GPU{b}", t, gen.get(a), src))
    if p.tree is not None and not p.topo:
        _nics_from_tree(node, p, root_numa)


def _in_tree(tree: PciTree, a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and a in tree.devices and b in tree.devices


def _root_numa(p: _Parsed) -> dict[str, int] | None:
    if p.tree is None or not p.pci_numa:
        return None
    out: dict[str, int] = {}
    for bdf, n in p.pci_numa.items():
        dev = p.tree.devices.get(bdf)
        if dev is not None:
            out.setdefault(dev.root, n)
    return out or None


def _nics_from_tree(node: Node, p: _Parsed, root_numa: dict[str, int] | None) -> None:
    """GPU-NIC path types from the PCIe tree, for NICs whose bus id is known."""
    assert p.tree is not None
    for nic in node.nics:
        if nic.pci_bus_id is None or nic.pci_bus_id not in p.tree.devices:
            continue
        for g in node.gpus:
            if g.pci_bus_id and g.pci_bus_id in p.tree.devices:
                t = p.tree.path_type(g.pci_bus_id, nic.pci_bus_id, root_numa)
                node.links.append(make_link(g.label, nic.name, t, None, "lspci -t"))


def _nvlink_pair_counts(
    gpus: dict[int, tuple[str, list[Any]]],
) -> dict[tuple[int, int], int]:
    """NV# per GPU pair from each GPU's active links and their remote ends.

    A remote end that is another GPU's bus id is a direct link; any other remote end is an
    NVSwitch, and two GPUs that both reach switches get NV(min of their switch links), the
    way nvidia-smi reports HGX boards.
    """
    by_bus = {b: i for i, (b, _) in gpus.items() if b}
    direct: dict[tuple[int, int], int] = {}
    switched: dict[int, int] = {}
    for i, (_, links) in gpus.items():
        for lk in links:
            if not lk.active or lk.remote_bus_id is None:
                continue
            j = by_bus.get(lk.remote_bus_id)
            if j is not None and j != i:
                direct[(i, j)] = direct.get((i, j), 0) + 1
            elif j is None:
                switched[i] = switched.get(i, 0) + 1
    # each direct link may be reported from both ends: count the better-reported side
    out: dict[tuple[int, int], int] = {}
    for (i, j), v in direct.items():
        key = (min(i, j), max(i, j))
        out[key] = max(out.get(key, 0), v)
    idx = sorted(switched)
    for n, i in enumerate(idx):
        for j in idx[n + 1 :]:
            out[(i, j)] = out.get((i, j), 0) + min(switched[i], switched[j])
    return out


def _nic_numa_from_matrix(node: Node) -> None:
    """A NIC at PIX/PXB/PHB/NODE from a GPU with a known NUMA node is on that node."""
    for nic in node.nics:
        if nic.numa is not None:
            continue
        for g in node.gpus:
            link = node.link(g.label, nic.name)
            if (
                link is not None
                and link.type in {"PIX", "PXB", "PHB", "NODE"}
                and g.numa is not None
            ):
                nic.numa = g.numa
                break


def _add_numa(node: Node, p: _Parsed, notes: list[str]) -> None:
    gpu_memory_nodes = {g.memory_numa for g in node.gpus if g.memory_numa is not None}
    grace = any(g.name and re.search(r"GH200|GB200|GB300", g.name) for g in node.gpus) or bool(
        p.lscpu and p.lscpu.model_name and "Neoverse-V2" in p.lscpu.model_name
    )
    infos: list[tuple[int, list[int], int | None, int | None, list[int]]] = []
    if p.numa_nodes:
        for n in p.numa_nodes:
            infos.append((n.node_id, list(n.cpus), n.memory_mb, n.free_mb, list(n.distances or ())))
    elif p.lscpu is not None and p.lscpu.numa_nodes:
        for nid, node_cpus in sorted(p.lscpu.numa_nodes.items()):
            infos.append((nid, list(node_cpus), None, None, []))
    for nid, cpus, mem, free, dist in infos:
        cpuless = not cpus
        candidate: NumaCandidate | None = None
        if cpuless and (mem is None or mem > 0):
            candidate = "gpu-memory" if nid in gpu_memory_nodes or grace else "cxl"
        node.numa_nodes.append(
            NumaNode(
                id=nid,
                cpus=cpus,
                memory_mb=mem,
                free_mb=free,
                distances=dist,
                cpuless=cpuless,
                candidate=candidate,
            )
        )
    if not infos:
        notes.append("no NUMA information (numactl -H, lscpu or sysfs)")


def _add_domains(node: Node, p: _Parsed, nvml: NvmlSnapshot | None, notes: list[str]) -> None:
    fabrics: dict[int, FabricInfo] = {}
    if nvml is not None:
        fabrics = {g.index: g.fabric for g in nvml.gpus if g.fabric is not None}
    elif p.smi:
        by_bus = {s.bus_id: s.fabric for s in p.smi if s.fabric is not None and s.bus_id}
        loose = [s.fabric for s in p.smi if s.fabric is not None and not s.bus_id]
        for g in node.gpus:
            if g.pci_bus_id in by_bus:
                fabrics[g.index] = by_bus[g.pci_bus_id]
        if loose and not fabrics:
            fabrics = {g.index: loose[0] for g in node.gpus}
            if node.gpus:
                notes.append("Fabric section not tied to a GPU bus id: applied to every GPU")
        if not node.gpus and loose:
            notes.append(f"Fabric section present but no GPU list: {loose[0]}")
    mnnvl: dict[str, NVLinkDomain] = {}
    for g in node.gpus:
        fab = fabrics.get(g.index)
        uuid = clique = None
        healthy: bool | None = None
        if fab is not None:
            if fab.in_mnnvl_domain:
                uuid, clique, healthy = fab.cluster_uuid, fab.clique_id, fab.healthy
            elif fab.status and fab.status.upper() != "N/A":
                notes.append(
                    f"GPU{g.index}: fabric {fab.state}/{fab.status}, ClusterUUID "
                    f"{fab.cluster_uuid}: not in an MNNVL domain"
                )
        elif p.labels is not None and p.labels.clique_cluster_uuid:
            uuid, clique = p.labels.clique_cluster_uuid, p.labels.clique_id
        if uuid is None:
            continue
        did = f"mnnvl:{uuid}:{clique}"
        dom = mnnvl.setdefault(
            did,
            NVLinkDomain(id=did, kind="NVL72", cluster_uuid=uuid, clique=clique, healthy=healthy),
        )
        dom.members.append(f"{node.name}/{g.label}")
        if healthy is False:
            dom.healthy = False
        g.nvlink_domain = did
    node.nvlink_domains.extend(mnnvl.values())
    # In-node NVLink components (NVL8) for GPUs not in a rack-scale domain.
    adj: dict[int, set[int]] = {g.index: set() for g in node.gpus}
    for lk in node.links:
        if lk.nvlink_count and lk.a.startswith("GPU") and lk.b.startswith("GPU"):
            a, b = int(lk.a[3:]), int(lk.b[3:])
            adj[a].add(b)
            adj[b].add(a)
    seen: set[int] = set()
    comp_no = 0
    for g in node.gpus:
        if g.index in seen or not adj[g.index] or g.nvlink_domain is not None:
            continue
        stack, comp = [g.index], set()
        while stack:
            x = stack.pop()
            if x in comp:
                continue
            comp.add(x)
            stack.extend(adj[x] - comp)
        seen |= comp
        did = f"{node.name}/nvl{comp_no}"
        comp_no += 1
        node.nvlink_domains.append(
            NVLinkDomain(id=did, kind="NVL8", members=[f"{node.name}/GPU{i}" for i in sorted(comp)])
        )
        for gg in node.gpus:
            if gg.index in comp:
                gg.nvlink_domain = did
    if p.labels is not None and p.labels.nvlink_domain and not node.nvlink_domains:
        kind = p.labels.nvlink_domain_kind or "NVL8"
        did = p.labels.nvlink_domain
        node.nvlink_domains.append(
            NVLinkDomain(
                id=did,
                kind=kind if kind in ("NVL72", "NVL8", "none") else "NVL8",  # type: ignore[arg-type]
                members=[f"{node.name}/{g.label}" for g in node.gpus],
            )
        )
        for g in node.gpus:
            g.nvlink_domain = did


def _add_memory_tiers(node: Node, p: _Parsed) -> None:
    for g in node.gpus:
        cap = None
        if p.labels is not None and p.labels.memory_mb:
            cap = p.labels.memory_mb / 1024
        elif g.name and (m := re.search(r"(\d+)\s*GB", g.name)):
            cap = float(m.group(1))
        node.memory_tiers.append(
            MemoryTier(
                name="hbm", capacity_gb=cap, numa=g.memory_numa, source="spec-default", **_HBM
            )
        )
    for n in node.numa_nodes:
        cap = n.memory_mb / 1024 if n.memory_mb is not None else None
        if not n.cpuless:
            node.memory_tiers.append(
                MemoryTier(name="dram", capacity_gb=cap, numa=n.id, source="assumed", **_DRAM)
            )
        elif n.candidate == "cxl":
            node.memory_tiers.append(
                MemoryTier(name="cxl", capacity_gb=cap, numa=n.id, source="spec-default", **_CXL)
            )


# --------------------------------------------------------------------------- entry points


def discover_local(
    name: str | None = None,
    runner: CommandRunner | None = None,
    sysfs_root: Path = Path("/"),
    use_nvml: bool = True,
) -> Node:
    """Probe this machine: NVML first, then every tool in PATH, then sysfs."""
    import socket

    from topkv.topology.probes import LocalRunner

    raw = collect(runner or LocalRunner())
    raw.sysfs_root = sysfs_root
    if use_nvml:
        snap, why = probe_nvml()
        raw.nvml = snap
        if snap is None:
            raw.missing["nvml"] = why
    return build_node(raw, name=name or socket.gethostname(), strict=False)


def discover_from_dir(
    directory: Path, name: str | None = None, gpu_name: str | None = None
) -> Node:
    """Build a node from a directory of saved outputs (see :class:`FixtureRunner`)."""
    from topkv.topology.probes import FixtureRunner

    if not directory.is_dir():
        raise ParseError(f"{directory}: not a directory (--from takes a directory of tool outputs)")
    raw = collect(FixtureRunner(directory), kinds=list(PROBES))
    if not raw.texts:
        names = ", ".join(s.files[0] for s in PROBES.values())
        raise ParseError(f"{directory}: no known tool output files in --from (expected: {names})")
    raw.missing.clear()
    return build_node(raw, name=name or directory.name, strict=True, gpu_name=gpu_name)


def discover_from_files(
    files: dict[str, Path], name: str = "node0", gpu_name: str | None = None
) -> Node:
    """Build a node from one file per kind (keys of :data:`PROBES`)."""
    raw = RawOutputs()
    for kind, path in files.items():
        if kind not in PROBES:
            raise ParseError(f"unknown output kind {kind!r}")
        raw.texts[kind] = read_probe_output(path, kind)
        raw.origins[kind] = str(path)
    return build_node(raw, name=name, strict=True, gpu_name=gpu_name)
