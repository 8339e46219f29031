"""The simulated cluster: nodes, GPUs in NVLink domains, NICs, PCIe, pools of instances.

A :class:`ClusterSpec` is a static description (named builders, a YAML file, or an adapter
from the discovered :class:`topkv.topology.model.Cluster`). :class:`SimCluster` turns it
into GPUs and tensor-parallel instances split into prefill and decode pools, and gives
each (source GPU, destination GPU) pair the :class:`~topkv.policy.view.PairView` the shared
policies read, plus the simulated links each candidate path occupies.

Link model (one direction each, so a full-duplex port is two links):

* each GPU's NVLink port (``tx``/``rx``) at the domain's per-GPU NVLink bandwidth, shared
  by all NVLink transfers of that GPU (a non-blocking NVSwitch between ports);
* each GPU's PCIe link (``tx``/``rx``) for GPU-to-GPU copies inside a node;
* each RDMA NIC (``tx``/``rx``); GPU ``i`` uses the NIC of its rail (``i * nics //
  gpus``), as with GPUDirect RDMA on rail-optimised fabrics; the fabric between NICs is
  non-blocking;
* each node's TCP networking (``tx``/``rx``).

Link ids follow :mod:`topkv.policy.pairs` so the load the policies see is the load on the
simulated links.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from topkv.inputs import InputFileError, load_json, load_yaml
from topkv.planner.transports import DEFAULT_TRANSPORTS, TransportSpec
from topkv.policy.pairs import gpu_port, host_network, nic_port, pair_view_from_facts
from topkv.policy.view import Endpoint, PairView
from topkv.sim.compute import GPU_SPECS
from topkv.sim.errors import ClusterSpecError
from topkv.sim.links import LinkNetwork, SimLink

GB = 1e9
#: A cluster file is a few lines; anything larger is not one.
MAX_CLUSTER_FILE_BYTES = 1 << 20
#: Most GPUs (and NICs) a simulated cluster may have, so a short file cannot ask for
#: unbounded memory.
MAX_CLUSTER_GPUS = 1 << 16


class NodeGroup(BaseModel):
    """``count`` identical nodes. Bandwidths are one direction, GB/s (10**9 bytes/s)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    count: int = Field(ge=1)
    gpu: str
    gpus_per_node: int = Field(ge=1)
    nvlink: Literal["none", "node", "rack"] = "node"
    nodes_per_domain: int = Field(default=1, ge=1, description="nodes per NVLink rack domain")
    nvlink_gb_s: float = Field(default=450.0, gt=0)
    pcie_gb_s: float = Field(default=50.0, gt=0)
    nics_per_node: int = Field(default=0, ge=0)
    nic_gb_s: float = Field(default=25.0, gt=0)
    tcp_gb_s: float = Field(default=10.0, gt=0)

    @model_validator(mode="after")
    def _known_gpu(self) -> NodeGroup:
        if self.gpu not in GPU_SPECS:
            raise ValueError(f"unknown gpu {self.gpu!r}; known: {', '.join(GPU_SPECS)}")
        return self


class ClusterSpec(BaseModel):
    """A cluster: node groups plus per-transport setup latencies (seconds per chunk)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = "custom"
    node_groups: list[NodeGroup] = Field(min_length=1)
    setup_latency_s: dict[str, float] = Field(
        default_factory=lambda: {k: v.setup_latency_s for k, v in DEFAULT_TRANSPORTS.items()}
    )

    @model_validator(mode="after")
    def _bounded(self) -> ClusterSpec:
        for what, count in (
            ("GPUs", sum(g.count * g.gpus_per_node for g in self.node_groups)),
            ("NICs", sum(g.count * g.nics_per_node for g in self.node_groups)),
        ):
            if count > MAX_CLUSTER_GPUS:
                raise ValueError(f"{count:,} {what}, more than the {MAX_CLUSTER_GPUS:,} simulated")
        if any(v < 0 for v in self.setup_latency_s.values()):
            raise ValueError("setup latencies must be >= 0 s")
        return self


def _builtin() -> dict[str, ClusterSpec]:
    return {
        "4x-dgx-h100": ClusterSpec(
            name="4x-dgx-h100",
            node_groups=[
                NodeGroup(
                    count=4,
                    gpu="H100",
                    gpus_per_node=8,
                    nvlink="node",
                    nvlink_gb_s=450,
                    pcie_gb_s=50,
                    nics_per_node=8,
                    nic_gb_s=25,
                    tcp_gb_s=10,
                )
            ],
        ),
        "2x-gb200-nvl72": ClusterSpec(
            name="2x-gb200-nvl72",
            node_groups=[
                NodeGroup(
                    count=36,
                    gpu="GB200",
                    gpus_per_node=4,
                    nvlink="rack",
                    nodes_per_domain=18,
                    nvlink_gb_s=900,
                    pcie_gb_s=50,
                    nics_per_node=4,
                    nic_gb_s=25,
                    tcp_gb_s=10,
                )
            ],
        ),
        "8x-l40s-pcie": ClusterSpec(
            name="8x-l40s-pcie",
            node_groups=[
                NodeGroup(
                    count=8,
                    gpu="L40S",
                    gpus_per_node=8,
                    nvlink="none",
                    pcie_gb_s=31.5,
                    nics_per_node=2,
                    nic_gb_s=25,
                    tcp_gb_s=10,
                )
            ],
        ),
    }


BUILTIN_CLUSTERS: tuple[str, ...] = tuple(_builtin())


def scaled_cluster(name: str, gpus: int) -> ClusterSpec:
    """``4x-dgx-h100``-style cluster of DGX H100 nodes with ``gpus`` GPUs (multiple of 8)."""
    if gpus < 8 or gpus % 8:
        raise ClusterSpecError(f"{name}: GPU count must be a multiple of 8, got {gpus}")
    if gpus > MAX_CLUSTER_GPUS:
        raise ClusterSpecError(f"{name}: at most {MAX_CLUSTER_GPUS:,} GPUs, got {gpus:,}")
    return ClusterSpec(
        name=name,
        node_groups=[NodeGroup(count=gpus // 8, gpu="H100", gpus_per_node=8, nics_per_node=8)],
    )


def load_cluster_spec(name_or_path: str) -> ClusterSpec:
    """A builtin name (``4x-dgx-h100``, ``2x-gb200-nvl72``, ``8x-l40s-pcie``,
    ``dgx-h100:<gpus>``) or a YAML file with the :class:`ClusterSpec` fields."""
    builtin = _builtin()
    if name_or_path in builtin:
        return builtin[name_or_path]
    if name_or_path.startswith("dgx-h100:"):
        count = name_or_path.split(":", 1)[1]
        if not count.isdigit():
            raise ClusterSpecError(f"{name_or_path!r}: expected dgx-h100:<number of GPUs>")
        return scaled_cluster(name_or_path, int(count))
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        return read_cluster_yaml(path)
    raise ClusterSpecError(
        f"unknown cluster {name_or_path!r}; use one of {', '.join(builtin)}, "
        "dgx-h100:<gpus>, or a YAML file"
    )


def read_cluster_yaml(path: Path) -> ClusterSpec:
    """Parse and validate a cluster YAML file."""
    what = "a cluster YAML file (node_groups: ...)"
    try:
        if path.suffix == ".json":
            data = load_json(path, what=what, limit=MAX_CLUSTER_FILE_BYTES)
        else:
            data = load_yaml(path, what=what, limit=MAX_CLUSTER_FILE_BYTES)
    except InputFileError as exc:
        raise ClusterSpecError(str(exc)) from None
    if not isinstance(data, dict):
        raise ClusterSpecError(f"{path}: expected a mapping with node_groups")
    data.setdefault("name", path.stem)
    try:
        return ClusterSpec.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ClusterSpecError(f"{path}: {where or 'top level'}: {first['msg']}") from None


def spec_from_topology(topology: Any, name: str = "discovered") -> ClusterSpec:
    """Adapter from the discovered topology model (:class:`topkv.topology.model.Cluster`).

    Each node becomes a one-node group; GPU type from the GPU name, NVLink domain kind
    from the node's domains (NVL72 -> rack), NIC count and rate from the active NICs, and
    link figures from the node's discovered links where present.
    """
    groups: list[NodeGroup] = []
    nvl72_members: dict[str, int] = {}
    for node in topology.nodes:
        for dom in node.nvlink_domains:
            if dom.kind == "NVL72":
                nvl72_members[dom.id] = len({m.split("/")[0] for m in dom.members})
    for node in topology.nodes:
        if not node.gpus:
            continue
        gpu_name = (node.gpus[0].name or "").upper()
        gpu_type = next((k for k in GPU_SPECS if k.upper() in gpu_name), None)
        if gpu_type is None:
            raise ClusterSpecError(
                f"node {node.name}: GPU {node.gpus[0].name!r} is not one of {', '.join(GPU_SPECS)}"
            )
        kinds = {d.kind for d in node.nvlink_domains}
        nvlink: Literal["none", "node", "rack"] = (
            "rack" if "NVL72" in kinds else "node" if "NVL8" in kinds else "none"
        )
        nvl_bw = [lk.bandwidth_gbps for lk in node.links if lk.transport in ("nvlink", "nvswitch")]
        pcie_bw = [lk.bandwidth_gbps for lk in node.links if lk.transport == "pcie"]
        nics = [n for n in node.nics if n.rate_gbps]
        per_domain = max(nvl72_members.values(), default=1) if nvlink == "rack" else 1
        groups.append(
            NodeGroup(
                count=1,
                gpu=gpu_type,
                gpus_per_node=len(node.gpus),
                nvlink=nvlink,
                nodes_per_domain=per_domain,
                nvlink_gb_s=max(nvl_bw, default=450.0),
                pcie_gb_s=min(pcie_bw, default=50.0),
                nics_per_node=len(nics),
                nic_gb_s=(min(n.rate_gbps for n in nics) / 8.0) if nics else 25.0,
            )
        )
    if not groups:
        raise ClusterSpecError("the topology has no GPUs")
    return ClusterSpec(name=name, node_groups=groups)


# -- instantiated cluster ------------------------------------------------------------


@dataclass(frozen=True)
class SimGPU:
    """One GPU: its node, index, NVLink domain (or None), and node-group parameters."""

    node: str
    index: int
    domain: str | None
    group: NodeGroup
    nic: str | None

    endpoint: Endpoint = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "endpoint", Endpoint(self.node, self.index))


@dataclass
class Instance:
    """A tensor-parallel serving instance (prefill or decode) on ``gpus``."""

    iid: int
    role: Literal["prefill", "decode"]
    gpus: tuple[SimGPU, ...]

    @property
    def name(self) -> str:
        return f"{self.role[0]}{self.iid}@{self.gpus[0].node}/GPU{self.gpus[0].index}"


@dataclass
class SimCluster:
    """GPUs and instances of a :class:`ClusterSpec` with a given TP and P:D ratio."""

    spec: ClusterSpec
    tp: int
    pd_ratio: tuple[int, int]
    gpus: list[SimGPU] = field(default_factory=list)
    prefill: list[Instance] = field(default_factory=list)
    decode: list[Instance] = field(default_factory=list)
    _pair_cache: dict[tuple[Endpoint, Endpoint], PairView] = field(default_factory=dict)

    @classmethod
    def build(cls, spec: ClusterSpec, tp: int, pd_ratio: tuple[int, int] = (1, 1)) -> SimCluster:
        if pd_ratio[0] < 1 or pd_ratio[1] < 1:
            raise ClusterSpecError(f"P:D ratio needs both parts >= 1, got {pd_ratio}")
        cluster = cls(spec, tp, pd_ratio)
        node_no = 0
        instance_gpus: list[tuple[SimGPU, ...]] = []
        for g_index, group in enumerate(spec.node_groups):
            if group.gpus_per_node % tp:
                raise ClusterSpecError(
                    f"tensor parallelism {tp} does not divide {group.gpus_per_node} GPUs per "
                    f"node (node group {g_index}); instances stay inside a node"
                )
            for n in range(group.count):
                node = f"node{node_no}"
                if group.nvlink == "node":
                    domain: str | None = f"{node}/nvl"
                elif group.nvlink == "rack":
                    domain = f"g{g_index}-rack{n // group.nodes_per_domain}"
                else:
                    domain = None
                node_gpus = []
                for i in range(group.gpus_per_node):
                    nic = None
                    if group.nics_per_node:
                        nic = f"nic{i * group.nics_per_node // group.gpus_per_node}"
                    node_gpus.append(SimGPU(node, i, domain, group, nic))
                cluster.gpus.extend(node_gpus)
                for start in range(0, group.gpus_per_node, tp):
                    instance_gpus.append(tuple(node_gpus[start : start + tp]))
                node_no += 1
        p, d = pd_ratio
        if len(instance_gpus) < 2:
            raise ClusterSpecError(
                f"{spec.name}: {len(instance_gpus)} instance(s) of TP {tp}; need at least "
                "one prefill and one decode instance"
            )
        for k, gpus in enumerate(instance_gpus):
            role: Literal["prefill", "decode"] = "prefill" if k % (p + d) < p else "decode"
            pool = cluster.prefill if role == "prefill" else cluster.decode
            pool.append(Instance(len(pool), role, gpus))
        if not cluster.prefill or not cluster.decode:
            raise ClusterSpecError(
                f"{spec.name}: P:D {p}:{d} with {len(instance_gpus)} instances leaves a pool "
                "empty; lower the TP or change the ratio"
            )
        return cluster

    # -- pairs -----------------------------------------------------------------------

    def _specs(self, group: NodeGroup) -> Mapping[str, TransportSpec]:
        lat = self.spec.setup_latency_s
        return {
            "nvlink": TransportSpec("nvlink", group.nvlink_gb_s, lat.get("nvlink", 1e-6)),
            "nvswitch": TransportSpec("nvswitch", group.nvlink_gb_s, lat.get("nvswitch", 1e-6)),
            "pcie": TransportSpec("pcie", group.pcie_gb_s, lat.get("pcie", 2e-6)),
            "rdma": TransportSpec("rdma", group.nic_gb_s, lat.get("rdma", 5e-6)),
            "tcp": TransportSpec("tcp", group.tcp_gb_s, lat.get("tcp", 100e-6)),
        }

    def pair_view(self, src: SimGPU, dst: SimGPU) -> PairView:
        """The policies' view of a pair (cached)."""
        key = (src.endpoint, dst.endpoint)
        view = self._pair_cache.get(key)
        if view is None:
            same_domain = src.domain is not None and src.domain == dst.domain
            rack = src.group.nvlink == "rack"
            view = pair_view_from_facts(
                src.endpoint,
                dst.endpoint,
                same_nvlink_domain=same_domain,
                rdma_available=src.nic is not None and dst.nic is not None,
                tcp_available=True,
                nvlink_transport="nvswitch" if rack else "nvlink",
                src_nics=(src.nic,) if src.nic else (),
                dst_nics=(dst.nic,) if dst.nic else (),
                specs=self._specs(src.group),
            )
            self._pair_cache[key] = view
        return view


class LinkMap:
    """Simulated directed links for every policy link id of a cluster."""

    def __init__(self, cluster: SimCluster, network: LinkNetwork) -> None:
        self.tx: dict[str, SimLink] = {}
        self.rx: dict[str, SimLink] = {}
        seen_nodes: set[str] = set()
        for gpu in cluster.gpus:
            group = gpu.group
            ep = gpu.endpoint
            if gpu.domain is not None:
                self._add(network, gpu_port(ep, "nvlink"), "nvlink", group.nvlink_gb_s)
            self._add(network, gpu_port(ep, "pcie"), "pcie", group.pcie_gb_s)
            if gpu.node not in seen_nodes:
                seen_nodes.add(gpu.node)
                self._add(network, host_network(gpu.node), "tcp", group.tcp_gb_s)
                for n in range(group.nics_per_node):
                    self._add(network, nic_port(gpu.node, f"nic{n}"), "rdma", group.nic_gb_s)

    def _add(self, network: LinkNetwork, link_id: str, kind: str, gb_s: float) -> None:
        self.tx[link_id] = network.add_link(f"{link_id}:tx", kind, gb_s * GB)
        self.rx[link_id] = network.add_link(f"{link_id}:rx", kind, gb_s * GB)

    def path(self, link_ids: tuple[str, ...]) -> tuple[SimLink, ...]:
        """Directed links of a candidate path.

        :func:`topkv.policy.pairs.pair_view_from_facts` lists the source side's link id
        first and the destination's second; a single id (same node's TCP, NIC loopback)
        is crossed out and back, so it uses both directions.
        """
        if len(link_ids) == 1:
            return (self.tx[link_ids[0]], self.rx[link_ids[0]])
        return (self.tx[link_ids[0]], *(self.rx[i] for i in link_ids[1:]))
