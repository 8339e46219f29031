"""Pair views built from plain facts, and the shared-link naming convention.

The simulator and tests describe a pair by a few facts (same node? same NVLink domain?
RDMA NICs?) and get the same :class:`~topkv.policy.view.PairView` shape the topology adapter
produces from a discovered cluster. Link ids name the shared resources a path occupies:

* ``<node>/GPU<i>:nvlink`` and ``<node>/GPU<i>:pcie``: a GPU's NVLink and PCIe ports;
* ``<node>:<nic>``: an RDMA NIC (``mlx5_0``, ``nic0``);
* ``<node>:tcp``: the node's TCP/IP networking.

RDMA and TCP paths list their NICs (or host networking) first, then both GPUs' PCIe ports,
which every path but NVLink crosses.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TypeVar

from topkv.planner.transports import DEFAULT_TRANSPORTS, TransportSpec
from topkv.policy.errors import PolicyInputError
from topkv.policy.view import NVLINK_FAMILY, Endpoint, PairView, PathCandidate

N = TypeVar("N")
M = TypeVar("M")


def gpu_port(endpoint: Endpoint, kind: str) -> str:
    """Link id of a GPU's ``nvlink`` or ``pcie`` port."""
    return f"{endpoint.node}/GPU{endpoint.gpu}:{kind}"


def nic_port(node: str, nic: str) -> str:
    """Link id of an RDMA NIC."""
    return f"{node}:{nic}"


def host_network(node: str) -> str:
    """Link id of a node's TCP/IP networking."""
    return f"{node}:tcp"


def _unique(links: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(links))


def nic_pairs(src_nics: Sequence[N], dst_nics: Sequence[M]) -> Iterator[tuple[N, M]]:
    """Each source NIC with the destination NIC it sends to: the destination's NICs are
    taken in turn, so every source NIC gets a path (one RDMA candidate per source NIC)."""
    return ((nic, dst_nics[i % len(dst_nics)]) for i, nic in enumerate(src_nics))


def assemble_view(
    src: Endpoint,
    dst: Endpoint,
    candidates: Iterable[PathCandidate],
    *,
    same_nvlink_domain: bool,
    rdma_available: bool,
    tcp_available: bool,
) -> PairView:
    """The pair view of ``candidates`` (same node is read off the endpoints)."""
    return PairView(
        src,
        dst,
        same_nvlink_domain,
        src.node == dst.node,
        rdma_available,
        tcp_available,
        tuple(candidates),
    )


def pair_view_from_facts(
    src: Endpoint,
    dst: Endpoint,
    *,
    same_nvlink_domain: bool,
    rdma_available: bool,
    tcp_available: bool = True,
    nvlink_transport: str = "nvlink",
    src_nics: Sequence[str] = ("nic0",),
    dst_nics: Sequence[str] = ("nic0",),
    specs: Mapping[str, TransportSpec] = DEFAULT_TRANSPORTS,
) -> PairView:
    """A pair view with one candidate per available transport (one per NIC for RDMA).

    Same NVLink domain adds an ``nvlink_transport`` path; same node adds PCIe; RDMA adds a
    path through each source NIC (paired with the destination NICs in turn, also within a
    node, as NIC loopback); TCP adds a host-network path. Figures come from ``specs``
    (the planner's SPEC.md reference table by default).
    """
    if nvlink_transport not in NVLINK_FAMILY:
        raise PolicyInputError(
            f"nvlink_transport {nvlink_transport!r} must be one of {sorted(NVLINK_FAMILY)}"
        )
    if rdma_available and (not src_nics or not dst_nics):
        raise PolicyInputError("RDMA is available but a side names no NIC")

    def path(transport: str, links: Sequence[str]) -> PathCandidate:
        spec = specs.get(transport)
        if spec is None:
            raise PolicyInputError(f"no nominal figures for transport {transport!r}")
        return PathCandidate(transport, spec.bandwidth_gbps, spec.setup_latency_s, _unique(links))

    same_node = src.node == dst.node
    candidates: list[PathCandidate] = []
    if same_nvlink_domain:
        candidates.append(
            path(nvlink_transport, [gpu_port(src, "nvlink"), gpu_port(dst, "nvlink")])
        )
    pcie_ports = [gpu_port(src, "pcie"), gpu_port(dst, "pcie")]
    if same_node:
        candidates.append(path("pcie", pcie_ports))
    if rdma_available:
        for nic, peer in nic_pairs(src_nics, dst_nics):
            nics = [nic_port(src.node, nic), nic_port(dst.node, peer)]
            candidates.append(path("rdma", nics + pcie_ports))
    if tcp_available:
        hosts = [host_network(src.node), host_network(dst.node)]
        candidates.append(path("tcp", hosts + pcie_ports))
    return assemble_view(
        src,
        dst,
        candidates,
        same_nvlink_domain=same_nvlink_domain,
        rdma_available=rdma_available,
        tcp_available=tcp_available,
    )
