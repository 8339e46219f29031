"""Path classification: pair -> path type, transport class, bandwidth and latency.

The ladder follows NCCL's ``src/graph`` (LOC < NVL < NVB < C2C < PIX < PXB < P2C < PXN < PHB
< SYS < NET) restricted to what ``nvidia-smi topo -m`` prints: ``NV#`` < PIX < PXB < PHB <
NODE < SYS. Figures (GB/s, one direction) and their sources are listed in docs/topology.md:

* NVLink: bonded link count x per-link rate of the generation (NVLink 1: 20, NVLink 2/3/4:
  25, NVLink 5: 50 GB/s per link per direction), so H100 NV18 -> 450, B200 NV18 -> 900.
* PCIe, from the SPEC's fallback table: PIX/PXB/PHB 31.5 (PCIe Gen4 x16 after 128b/130b),
  NODE 15.75, SYS 7.88.
* Across nodes: same NVL72 domain -> 900 (NVLink 5, 18 links); RDMA -> NIC rate / 8 x 0.5
  (the SPEC's "400 Gb/s NDR with overhead = 25 GB/s"), 25 GB/s when the rate is unknown;
  otherwise TCP 10 GB/s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from topkv.topology.model import NIC, Cluster, GpuRef, Link, Node, TopologyError, Transport

NVLINK_PER_LINK_GBPS: dict[int, float] = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}
DEFAULT_NVLINK_GENERATION = 4
PCIE_BANDWIDTH_GBPS: dict[str, float] = {
    "PIX": 31.5,
    "PXB": 31.5,
    "PHB": 31.5,
    "NODE": 15.75,
    "SYS": 7.88,
    "SOC": 7.88,  # name of SYS in nvidia-smi before driver ~384
}
UNKNOWN_PCIE_BANDWIDTH_GBPS = PCIE_BANDWIDTH_GBPS["SYS"]
LATENCY_S: dict[Transport, float] = {
    Transport.NVLINK: 1e-6,
    Transport.NVSWITCH: 1e-6,
    Transport.XGMI: 1e-6,
    Transport.PCIE: 2e-6,
    Transport.RDMA: 5e-6,
    Transport.TCP: 100e-6,
}
NVL72_BANDWIDTH_GBPS = 18 * NVLINK_PER_LINK_GBPS[5]
RDMA_DEFAULT_GBPS = 25.0
RDMA_EFFICIENCY = 0.5
TCP_BANDWIDTH_GBPS = 10.0
# AMD Infinity Fabric (xGMI) per link, MI300X: 64 GB/s per direction (AMD CDNA3 white paper).
XGMI_PER_LINK_GBPS = 64.0

# Lower is closer. NV# ranks 0; unknown types rank after SYS.
_RANK: dict[str, int] = {"PIX": 1, "PXB": 2, "PHB": 3, "NODE": 4, "SYS": 5, "SOC": 5}
_UNKNOWN_RANK = 6
_NV_RE = re.compile(r"^NV(\d+)$")

# GPU product name -> NVLink generation. Order matters (first match wins).
_GENERATIONS: list[tuple[re.Pattern[str], int]] = [
    (re.compile(r"\b(G?B[123]00|GB300|RTX PRO 6000 Blackwell)\b", re.I), 5),
    (re.compile(r"\b(G?H100|H200|H800|H20|GH200)\b", re.I), 4),
    (re.compile(r"\b(A100|A800|A30|A40|RTX A\d000|RTX 3090)\b", re.I), 3),
    (re.compile(r"\bV100\b", re.I), 2),
    (re.compile(r"\bP100\b", re.I), 1),
]


@dataclass(frozen=True)
class PathInfo:
    """What a path type string means."""

    type: str
    transport: Transport
    bandwidth_gbps: float
    latency_s: float
    rank: int
    nvlink_count: int | None = None


def nvlink_generation_for(gpu_name: str | None) -> int | None:
    """NVLink generation of a GPU product name, or None when the name is not recognised."""
    if not gpu_name:
        return None
    for pattern, gen in _GENERATIONS:
        if pattern.search(gpu_name):
            return gen
    return None


def nvlink_count(path_type: str) -> int | None:
    m = _NV_RE.match(path_type.strip())
    return int(m.group(1)) if m else None


def nvlink_bandwidth_gbps(count: int, generation: int | None) -> float:
    gen = generation if generation in NVLINK_PER_LINK_GBPS else DEFAULT_NVLINK_GENERATION
    return count * NVLINK_PER_LINK_GBPS[gen]


def path_rank(path_type: str) -> int:
    """Position on the ladder: NV# 0, PIX 1, PXB 2, PHB 3, NODE 4, SYS 5, anything else 6."""
    if nvlink_count(path_type) is not None:
        return 0
    return _RANK.get(path_type.strip().upper(), _UNKNOWN_RANK)


def classify(path_type: str, nvlink_generation: int | None = None) -> PathInfo:
    """Map a path type string as printed by nvidia-smi to transport, bandwidth and latency."""
    count = nvlink_count(path_type)
    if count is not None:
        return PathInfo(
            type=path_type,
            transport=Transport.NVLINK,
            bandwidth_gbps=nvlink_bandwidth_gbps(count, nvlink_generation),
            latency_s=LATENCY_S[Transport.NVLINK],
            rank=0,
            nvlink_count=count,
        )
    if path_type.upper().startswith("XGMI"):
        return PathInfo(
            type=path_type,
            transport=Transport.XGMI,
            bandwidth_gbps=XGMI_PER_LINK_GBPS,
            latency_s=LATENCY_S[Transport.XGMI],
            rank=0,
        )
    bw = PCIE_BANDWIDTH_GBPS.get(path_type.upper(), UNKNOWN_PCIE_BANDWIDTH_GBPS)
    return PathInfo(
        type=path_type,
        transport=Transport.PCIE,
        bandwidth_gbps=bw,
        latency_s=LATENCY_S[Transport.PCIE],
        rank=path_rank(path_type),
    )


def make_link(a: str, b: str, path_type: str, nvlink_generation: int | None, source: str) -> Link:
    info = classify(path_type, nvlink_generation)
    return Link(
        a=a,
        b=b,
        type=path_type,
        transport=info.transport,
        bandwidth_gbps=info.bandwidth_gbps,
        latency_s=info.latency_s,
        nvlink_count=info.nvlink_count,
        source=source,
    )


def nearest_nics(node: Node, gpu_index: int) -> list[NIC]:
    """The NICs closest to a GPU on the ladder PIX < PXB < PHB < NODE < SYS; ties are kept.

    Without a GPU-NIC matrix, falls back to NUMA locality (same NUMA node ranks as NODE,
    another as SYS); with no information at all, every NIC ties.
    """
    gpu = node.gpu(gpu_index)
    ranked: list[tuple[int, NIC]] = []
    for nic in node.nics:
        link = node.link(gpu.label, nic.name)
        if link is not None:
            ranked.append((path_rank(link.type), nic))
        elif gpu.numa is not None and nic.numa is not None:
            ranked.append((_RANK["NODE"] if nic.numa == gpu.numa else _RANK["SYS"], nic))
        else:
            ranked.append((_UNKNOWN_RANK, nic))
    if not ranked:
        return []
    best = min(rank for rank, _ in ranked)
    return [nic for rank, nic in ranked if rank == best]


def loopback_link(name: str) -> Link:
    """A GPU to itself: no transfer needed; bandwidth is the SPEC's HBM3 figure."""
    return Link(
        a=name,
        b=name,
        type="X",
        transport=Transport.NVLINK,
        bandwidth_gbps=3350.0,
        latency_s=0.0,
        source="self",
    )


def _rdma_bandwidth(nics: list[NIC]) -> float:
    rates = [n.rate_gbps for n in nics if n.rate_gbps]
    if not rates:
        return RDMA_DEFAULT_GBPS
    return min(rates) / 8.0 * RDMA_EFFICIENCY


def link_between(cluster: Cluster, a: GpuRef, b: GpuRef) -> Link:
    """The path GPU ``a`` -> GPU ``b``; across nodes: NVL72 fabric, else RDMA, else TCP."""
    if a == b:
        cluster.gpu(*a)
        return loopback_link(f"{a[0]}/GPU{a[1]}")
    ga, gb = cluster.gpu(*a), cluster.gpu(*b)
    if a[0] == b[0]:
        link = cluster.node(a[0]).link(ga.label, gb.label)
        if link is None:
            raise TopologyError(
                f"no discovered path between GPU{a[1]} and GPU{b[1]} on {a[0]!r} "
                "(the tool output did not include that pair)"
            )
        return link
    return inter_node_link(cluster, a, b)


def inter_node_link(cluster: Cluster, a: GpuRef, b: GpuRef) -> Link:
    """Path between GPUs on two different nodes."""
    if a[0] == b[0]:
        raise TopologyError("inter_node_link needs GPUs on two different nodes")
    na, nb = cluster.node(a[0]), cluster.node(b[0])
    ga, gb = na.gpu(a[1]), nb.gpu(b[1])
    name_a, name_b = f"{na.name}/{ga.label}", f"{nb.name}/{gb.label}"

    def link(type_: str, transport: Transport, bandwidth_gbps: float, source: str) -> Link:
        return Link(
            a=name_a,
            b=name_b,
            type=type_,
            transport=transport,
            bandwidth_gbps=bandwidth_gbps,
            latency_s=LATENCY_S[transport],
            source=source,
        )

    domains = {d.id: d for d in cluster.nvlink_domains}
    dom = domains.get(ga.nvlink_domain or "")
    if dom is not None and dom.kind == "NVL72" and ga.nvlink_domain == gb.nvlink_domain:
        return link("MNNVL", Transport.NVSWITCH, NVL72_BANDWIDTH_GBPS, f"NVLink domain {dom.id}")
    nics_a, nics_b = nearest_nics(na, a[1]), nearest_nics(nb, b[1])
    usable_a = [n for n in nics_a if n.state is None or n.active]
    usable_b = [n for n in nics_b if n.state is None or n.active]
    if usable_a and usable_b:
        bandwidth = _rdma_bandwidth(usable_a + usable_b)
        return link("NET", Transport.RDMA, bandwidth, f"{usable_a[0].name} -> {usable_b[0].name}")
    return link("TCP", Transport.TCP, TCP_BANDWIDTH_GBPS, "no RDMA NIC on one side")
