"""The topology model: cluster -> nodes -> GPUs, NICs, NUMA nodes, memory tiers, links, domains.

Every discovery source (nvidia-smi, NVML, lspci, RDMA tools, sysfs, Kubernetes labels) is
folded into these pydantic models by :mod:`topkv.topology.build`; everything downstream
(transport selection, the simulator, ``topkv discover --json``) reads only these. Models
round-trip through JSON (``Cluster.model_validate_json(c.model_dump_json())``).

Endpoint naming inside a node: GPUs are ``"GPU<index>"``; NICs use their RDMA device name
(``mlx5_0``) when known, otherwise the label the tool printed (``NIC0``).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from topkv.errors import TopKVError


class TopologyError(TopKVError):
    """A topology query named something the model does not contain."""


class Transport(StrEnum):
    """Transport class of a path; the order of the ladder is in :mod:`topkv.topology.paths`."""

    NVLINK = "nvlink"
    NVSWITCH = "nvswitch"
    PCIE = "pcie"
    RDMA = "rdma"
    TCP = "tcp"
    XGMI = "xgmi"


class LinkLayer(StrEnum):
    """RDMA link layer as reported by ibstat/ibv_devinfo/sysfs (``Ethernet`` means RoCE)."""

    IB = "IB"
    ROCE = "RoCE"


DomainKind = Literal["NVL72", "NVL8", "none"]
NumaCandidate = Literal["cxl", "gpu-memory"]

_STRICT = ConfigDict(extra="forbid")


class GPU(BaseModel):
    """One accelerator as seen by its node."""

    model_config = _STRICT

    index: int
    name: str | None = None
    vendor: Literal["nvidia", "amd"] = "nvidia"
    pci_bus_id: str | None = None
    uuid: str | None = None
    numa: int | None = None
    cpu_affinity: list[int] = Field(default_factory=list)
    memory_numa: int | None = Field(
        default=None, description="NUMA node exposing this GPU's memory (GH200/GB200 'GPU NUMA ID')"
    )
    nvlink_domain: str | None = None
    nvlink_generation: int | None = None

    @property
    def label(self) -> str:
        return f"GPU{self.index}"


class NIC(BaseModel):
    """One RDMA-capable (or plain) network port."""

    model_config = _STRICT

    name: str
    label: str | None = Field(default=None, description="column label in the tool (NIC0)")
    port: int | None = None
    netdev: str | None = None
    link_layer: LinkLayer | None = None
    rate_gbps: float | None = Field(default=None, description="link rate in Gb/s (bits)")
    state: str | None = None
    numa: int | None = None
    pci_bus_id: str | None = None

    @property
    def active(self) -> bool:
        return self.state is not None and "ACTIVE" in self.state.upper()


class NumaNode(BaseModel):
    """One NUMA node; CPU-less nodes with memory are flagged as CXL or GPU-memory candidates."""

    model_config = _STRICT

    id: int
    cpus: list[int] = Field(default_factory=list)
    memory_mb: int | None = None
    free_mb: int | None = None
    distances: list[int] = Field(default_factory=list)
    cpuless: bool = False
    candidate: NumaCandidate | None = None


class MemoryTier(BaseModel):
    """A tier a KV cache can live in (HBM, DRAM, CXL, NVMe) with its nominal figures."""

    model_config = _STRICT

    name: Literal["hbm", "dram", "cxl", "nvme"]
    capacity_gb: float | None = None
    latency_ns: float
    bandwidth_gbps: float
    numa: int | None = None
    source: str = Field(description="'spec-default' for SPEC figures, else the probe used")


class Link(BaseModel):
    """A path between two endpoints of one node (or, from ``link_between``, two nodes)."""

    model_config = _STRICT

    a: str
    b: str
    type: str = Field(description="path type exactly as the tool printed it: NV18, PIX, SYS, ...")
    transport: Transport
    bandwidth_gbps: float = Field(description="one direction, GB/s (bytes)")
    latency_s: float
    nvlink_count: int | None = None
    source: str = "nvidia-smi topo -m"

    def joins(self, x: str, y: str) -> bool:
        return {self.a, self.b} == {x, y}


class NVLinkDomain(BaseModel):
    """A set of GPUs that reach each other over NVLink.

    ``NVL72``: rack-scale multi-node NVLink (same MNNVL ClusterUUID and CliqueId);
    ``NVL8``: NVLink within one node; ``none``: recorded only to say a GPU has no peers.
    Members are ``"<node>/GPU<i>"``.
    """

    model_config = _STRICT

    id: str
    kind: DomainKind
    members: list[str] = Field(default_factory=list)
    cluster_uuid: str | None = None
    clique: str | None = None
    healthy: bool | None = None


class Node(BaseModel):
    """One server (or pod's view of it)."""

    model_config = _STRICT

    name: str
    gpus: list[GPU] = Field(default_factory=list)
    nics: list[NIC] = Field(default_factory=list)
    numa_nodes: list[NumaNode] = Field(default_factory=list)
    memory_tiers: list[MemoryTier] = Field(default_factory=list)
    links: list[Link] = Field(default_factory=list)
    nvlink_domains: list[NVLinkDomain] = Field(default_factory=list)
    sources: list[str] = Field(default_factory=list, description="probes that contributed")
    notes: list[str] = Field(default_factory=list, description="what was missing or assumed")

    def gpu(self, index: int) -> GPU:
        for g in self.gpus:
            if g.index == index:
                return g
        raise TopologyError(f"node {self.name!r} has no GPU{index} (it has {len(self.gpus)} GPUs)")

    def nic(self, name: str) -> NIC:
        for n in self.nics:
            if name in (n.name, n.label):
                return n
        raise TopologyError(f"node {self.name!r} has no NIC {name!r}")

    def link(self, a: str, b: str) -> Link | None:
        for lk in self.links:
            if lk.joins(a, b):
                return lk
        return None

    def renamed(self, name: str) -> Node:
        """A deep copy under another name, with domain ids and members rewritten."""
        copy = self.model_copy(deep=True)
        copy.name = name
        prefix_old, prefix_new = f"{self.name}/", f"{name}/"
        for dom in copy.nvlink_domains:
            if dom.kind != "NVL72":
                dom.id = dom.id.replace(prefix_old, prefix_new, 1)
            dom.members = [m.replace(prefix_old, prefix_new, 1) for m in dom.members]
        for g in copy.gpus:
            if g.nvlink_domain is not None and g.nvlink_domain.startswith(prefix_old):
                g.nvlink_domain = g.nvlink_domain.replace(prefix_old, prefix_new, 1)
        return copy


GpuRef = tuple[str, int]


class Cluster(BaseModel):
    """Nodes plus the domains that span them."""

    model_config = _STRICT

    nodes: list[Node] = Field(default_factory=list)

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise TopologyError(f"no node named {name!r} (nodes: {[n.name for n in self.nodes]})")

    def gpu(self, node: str, index: int) -> GPU:
        return self.node(node).gpu(index)

    @property
    def nvlink_domains(self) -> list[NVLinkDomain]:
        """All domains, rack-scale ones merged across nodes by id."""
        merged: dict[str, NVLinkDomain] = {}
        for n in self.nodes:
            for d in n.nvlink_domains:
                if d.id in merged:
                    have = merged[d.id]
                    have.members = sorted(set(have.members) | set(d.members))
                else:
                    merged[d.id] = d.model_copy(deep=True)
        return list(merged.values())

    def same_nvlink_domain(self, a: GpuRef, b: GpuRef) -> bool:
        """True when GPU ``a`` reaches GPU ``b`` over NVLink (in-node or rack-scale)."""
        ga, gb = self.gpu(*a), self.gpu(*b)
        if a[0] == b[0]:
            # Inside a node the tool's matrix is authoritative: in a hybrid cube mesh
            # (DGX-1) two GPUs of one NVLink-connected group may still talk over SYS.
            link = self.node(a[0]).link(ga.label, gb.label)
            if link is not None:
                return link.transport in (Transport.NVLINK, Transport.NVSWITCH)
        return ga.nvlink_domain is not None and ga.nvlink_domain == gb.nvlink_domain

    @classmethod
    def replicate(cls, node: Node, count: int, prefix: str | None = None) -> Cluster:
        """``count`` identical copies of one discovered node (e.g. two 8x H100 NV18 nodes).

        Copies are named ``<prefix><i>`` (default prefix: the node's name plus ``-``).
        """
        if count < 1:
            raise TopologyError(f"replicate needs count >= 1, got {count}")
        base = prefix if prefix is not None else f"{node.name}-"
        return cls(nodes=[node.renamed(f"{base}{i}") for i in range(count)])
