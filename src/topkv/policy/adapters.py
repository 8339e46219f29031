"""From the discovered topology model to the policies' :class:`PairView`.

This is the only module of :mod:`topkv.policy` that reads :mod:`topkv.topology`; the policies
themselves see only the resulting view. :func:`pair_view_from_cluster` lists a GPU pair's
candidate paths (GPU fabric, PCIe, RDMA through the nearest NICs, TCP) with figures from the
topology's path ladder (:mod:`topkv.topology.paths`) and the links each occupies;
:func:`cluster_from_json` reads a saved topology. The candidates: docs/policies.md ("The
snapshot", where views come from).
"""

from __future__ import annotations

from pydantic import ValidationError

from topkv.errors import ConfigError
from topkv.inputs import parse_json
from topkv.policy.pairs import assemble_view, gpu_port, host_network, nic_pairs, nic_port
from topkv.policy.view import Endpoint, PairView, PathCandidate
from topkv.topology import paths
from topkv.topology.model import NIC, Cluster, Node, Transport

_FABRIC = (Transport.NVLINK, Transport.NVSWITCH, Transport.XGMI)


def _unique(*links: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(links))


def _usable_nics(cluster: Cluster, endpoint: Endpoint) -> list[NIC]:
    nearest = paths.nearest_nics(cluster.node(endpoint.node), endpoint.gpu)
    return [n for n in nearest if n.state is None or n.active]


def _nic_gbps(nic: NIC) -> float:
    if not nic.rate_gbps:
        return paths.RDMA_DEFAULT_GBPS
    return nic.rate_gbps / 8.0 * paths.RDMA_EFFICIENCY


def _gpu_to_nic_gbps(cluster: Cluster, endpoint: Endpoint, nic: NIC) -> float | None:
    node = cluster.node(endpoint.node)
    link = node.link(node.gpu(endpoint.gpu).label, nic.name)
    return None if link is None else link.bandwidth_gbps


def _rdma_gbps(cluster: Cluster, src: Endpoint, nic: NIC, dst: Endpoint, peer: NIC) -> float:
    """GPUDirect RDMA: the slower NIC, and each GPU's PCIe path to its NIC when known."""
    figures = [_nic_gbps(nic), _nic_gbps(peer)]
    for endpoint, port in ((src, nic), (dst, peer)):
        pcie = _gpu_to_nic_gbps(cluster, endpoint, port)
        if pcie is not None:
            figures.append(pcie)
    return min(figures)


def _pcie_type_for_nvlink_pair(cluster: Cluster, src: Endpoint, dst: Endpoint) -> str:
    ga, gb = cluster.gpu(src.node, src.gpu), cluster.gpu(dst.node, dst.gpu)
    if ga.numa is not None and ga.numa == gb.numa:
        return "NODE"
    return "SYS"


def pair_view_from_cluster(cluster: Cluster, src: Endpoint, dst: Endpoint) -> PairView:
    """The policies' view of ``src`` -> ``dst`` in a discovered cluster.

    Raises :class:`topkv.topology.model.TopologyError` when a node or GPU is missing or the
    model has no path between two GPUs of one node.
    """
    a, b = (src.node, src.gpu), (dst.node, dst.gpu)
    link = paths.link_between(cluster, a, b)  # validates both GPUs
    same_node = src.node == dst.node
    same_domain = cluster.same_nvlink_domain(a, b)
    candidates: list[PathCandidate] = []
    pcie_ports = (gpu_port(src, "pcie"), gpu_port(dst, "pcie"))

    if link.transport in _FABRIC:
        candidates.append(
            PathCandidate(
                link.transport.value,
                link.bandwidth_gbps,
                link.latency_s,
                _unique(gpu_port(src, "nvlink"), gpu_port(dst, "nvlink")),
            )
        )
    if same_node:
        if link.transport == Transport.PCIE:
            pcie = paths.classify(link.type)
        else:
            pcie = paths.classify(_pcie_type_for_nvlink_pair(cluster, src, dst))
        candidates.append(
            PathCandidate("pcie", pcie.bandwidth_gbps, pcie.latency_s, _unique(*pcie_ports))
        )

    src_nics, dst_nics = _usable_nics(cluster, src), _usable_nics(cluster, dst)
    rdma_available = bool(src_nics and dst_nics)
    if rdma_available:
        for nic, peer in nic_pairs(src_nics, dst_nics):
            nics = (nic_port(src.node, nic.name), nic_port(dst.node, peer.name))
            gbps = _rdma_gbps(cluster, src, nic, dst, peer)
            latency = paths.LATENCY_S[Transport.RDMA]
            candidates.append(PathCandidate("rdma", gbps, latency, _unique(*nics, *pcie_ports)))
    hosts = (host_network(src.node), host_network(dst.node))
    tcp_links = _unique(*hosts, *pcie_ports)
    candidates.append(
        PathCandidate("tcp", paths.TCP_BANDWIDTH_GBPS, paths.LATENCY_S[Transport.TCP], tcp_links)
    )
    return assemble_view(
        src,
        dst,
        candidates,
        same_nvlink_domain=same_domain,
        rdma_available=rdma_available,
        tcp_available=True,
    )


def cluster_from_json(text: str, origin: str = "topology JSON") -> Cluster:
    """Parse a topology written by ``topkv discover --json``: a cluster, or a single node.

    Raises :class:`topkv.errors.ConfigError` naming the first problem when the text is not
    a topology.
    """
    data = parse_json(text, origin, invalid="not JSON")
    if isinstance(data, dict) and "cluster" in data and "nodes" not in data:
        data = data["cluster"]
    try:
        if isinstance(data, dict) and "nodes" not in data and "gpus" in data:
            return Cluster(nodes=[Node.model_validate(data)])
        cluster = Cluster.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])[:80] or "top level"
        raise ConfigError(
            f"{origin}: not a topology (at {where}: {first['msg']}); "
            "write one with `topkv discover --json`"
        ) from None
    if not cluster.nodes:
        raise ConfigError(
            f"{origin}: the topology has no nodes; write one with `topkv discover --json`"
        )
    return cluster
