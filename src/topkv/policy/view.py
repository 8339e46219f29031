"""The immutable snapshot that every transport and routing policy reads.

A policy never sees the topology model, a socket or the event loop. The caller (the live
relay, the simulator, the ``topkv select`` command) reduces whatever it knows to these few
frozen values, and the policy returns a decision. Bandwidths are in GB/s (10**9 bytes per
second), latencies and times in seconds, sizes in bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from topkv.policy.errors import PolicyInputError

#: The transport modes in the order Algorithm 1 of the paper prefers them; also the
#: deterministic tie-break between paths with equal estimates. ``xgmi`` (AMD Infinity
#: Fabric) sits with the NVLink family, as the same kind of GPU-to-GPU fabric.
TRANSPORT_LADDER: tuple[str, ...] = ("nvlink", "nvswitch", "xgmi", "pcie", "rdma", "tcp")

#: The GPU-fabric family: Algorithm 1's "nvlink" step picks whichever of these the pair has.
NVLINK_FAMILY: frozenset[str] = frozenset({"nvlink", "nvswitch", "xgmi"})


_LADDER_RANKS: dict[str, int] = {name: i for i, name in enumerate(TRANSPORT_LADDER)}


def ladder_rank(transport: str) -> int:
    """Position of ``transport`` in :data:`TRANSPORT_LADDER`; unknown names rank last."""
    return _LADDER_RANKS.get(transport, len(TRANSPORT_LADDER))


@dataclass(frozen=True, order=True)
class Endpoint:
    """One GPU: the node's name and the GPU's index on that node."""

    node: str
    gpu: int

    def __post_init__(self) -> None:
        if not self.node or self.node != self.node.strip():
            raise PolicyInputError(f"endpoint node name {self.node!r} is empty or padded")
        if self.gpu < 0:
            raise PolicyInputError(f"endpoint {self.node}: GPU index {self.gpu} is negative")

    def __str__(self) -> str:
        return f"{self.node}:{self.gpu}"

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        """Parse ``NODE:GPU`` (e.g. ``node0:3``); the GPU index is a non-negative integer."""
        node, sep, gpu_text = text.strip().rpartition(":")
        if not sep or not node:
            raise PolicyInputError(f"endpoint {text!r} is not NODE:GPU (for example node0:3)")
        if not gpu_text.isdigit() or not gpu_text.isascii():
            raise PolicyInputError(
                f"endpoint {text!r}: GPU index {gpu_text!r} is not a non-negative integer"
            )
        return cls(node=node, gpu=int(gpu_text))


@dataclass(frozen=True)
class PathCandidate:
    """One way to move bytes between a pair: a transport over a set of shared links.

    ``links`` names the shared physical resources the path crosses (``"node0:nic0"``,
    ``"node0:gpu3:nvlink"``); transfers whose paths name the same link compete for it.
    ``bandwidth_gbps`` and ``setup_latency_s`` are the nominal figures for this path.
    """

    transport: str
    bandwidth_gbps: float
    setup_latency_s: float
    links: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.transport:
            raise PolicyInputError("a path candidate needs a transport name")
        if not self.bandwidth_gbps > 0:
            raise PolicyInputError(
                f"{self.transport} path: bandwidth {self.bandwidth_gbps} GB/s must be > 0"
            )
        if not self.setup_latency_s >= 0:
            raise PolicyInputError(
                f"{self.transport} path: setup latency {self.setup_latency_s} s must be >= 0"
            )


@dataclass(frozen=True)
class PairView:
    """What the policies may know about one (source GPU, destination GPU) pair."""

    src: Endpoint
    dst: Endpoint
    same_nvlink_domain: bool
    same_node: bool
    rdma_available: bool
    tcp_available: bool
    candidates: tuple[PathCandidate, ...]

    def paths_for(self, transport: str) -> tuple[PathCandidate, ...]:
        """Every candidate path that uses ``transport``, in the view's order."""
        return tuple(c for c in self.candidates if c.transport == transport)

    @property
    def transports(self) -> tuple[str, ...]:
        """Distinct transport names among the candidates, in first-seen order."""
        return tuple(dict.fromkeys(c.transport for c in self.candidates))


def _frozen_counts(values: Mapping[str, int], what: str) -> Mapping[str, int]:
    cleaned: dict[str, int] = {}
    for link, value in values.items():
        if value < 0:
            raise PolicyInputError(f"link load: {what} on {link!r} is negative ({value})")
        if value:
            cleaned[link] = int(value)
    return MappingProxyType(cleaned)


@dataclass(frozen=True)
class LinkLoad:
    """Snapshot of the traffic on shared links: bytes still in flight and active flows.

    Missing links carry nothing. Build a new snapshot with :meth:`with_flow` /
    :meth:`without_flow` rather than mutating one.
    """

    bytes_in_flight: Mapping[str, int] = field(default_factory=dict)
    active_flows: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "bytes_in_flight", _frozen_counts(self.bytes_in_flight, "bytes in flight")
        )
        object.__setattr__(self, "active_flows", _frozen_counts(self.active_flows, "flows"))

    def bytes_on(self, link: str) -> int:
        return self.bytes_in_flight.get(link, 0)

    def flows_on(self, link: str) -> int:
        return self.active_flows.get(link, 0)

    def with_flow(self, links: Iterable[str], nbytes: int) -> LinkLoad:
        """A new snapshot with one more flow of ``nbytes`` on each of ``links``."""
        in_flight = dict(self.bytes_in_flight)
        flows = dict(self.active_flows)
        for link in dict.fromkeys(links):
            in_flight[link] = in_flight.get(link, 0) + nbytes
            flows[link] = flows.get(link, 0) + 1
        return LinkLoad(in_flight, flows)

    def without_flow(self, links: Iterable[str], nbytes: int) -> LinkLoad:
        """A new snapshot with one flow of ``nbytes`` fewer on each of ``links``."""
        in_flight = dict(self.bytes_in_flight)
        flows = dict(self.active_flows)
        for link in dict.fromkeys(links):
            in_flight[link] = max(0, in_flight.get(link, 0) - nbytes)
            flows[link] = max(0, flows.get(link, 0) - 1)
        return LinkLoad(in_flight, flows)


#: A snapshot with no traffic.
NO_LOAD = LinkLoad()


class LinkLoadTracker:
    """Mutable counters behind a :class:`LinkLoad`, for a caller that adds and removes
    flows far more often than a policy reads the load.

    :meth:`add` and :meth:`remove` do the arithmetic of :meth:`LinkLoad.with_flow` and
    :meth:`LinkLoad.without_flow`; :meth:`snapshot` returns the equal immutable snapshot,
    built only when something changed since the last one (:data:`NO_LOAD` when idle), so
    equal consecutive snapshots are the same object.
    """

    __slots__ = ("_bytes", "_flows", "_snapshot")

    def __init__(self) -> None:
        self._bytes: dict[str, int] = {}
        self._flows: dict[str, int] = {}
        self._snapshot: LinkLoad | None = NO_LOAD

    def add(self, links: Iterable[str], nbytes: int) -> None:
        """One more flow of ``nbytes`` on each of ``links``."""
        in_flight, flows = self._bytes, self._flows
        for link in dict.fromkeys(links):
            in_flight[link] = in_flight.get(link, 0) + nbytes
            flows[link] = flows.get(link, 0) + 1
        self._snapshot = None

    def remove(self, links: Iterable[str], nbytes: int) -> None:
        """One flow of ``nbytes`` fewer on each of ``links`` (never below zero)."""
        in_flight, flows = self._bytes, self._flows
        for link in dict.fromkeys(links):
            left = in_flight.get(link, 0) - nbytes
            if left > 0:
                in_flight[link] = left
            else:
                in_flight.pop(link, None)
            count = flows.get(link, 0) - 1
            if count > 0:
                flows[link] = count
            else:
                flows.pop(link, None)
        self._snapshot = None

    def snapshot(self) -> LinkLoad:
        """The load now, as an immutable :class:`LinkLoad`."""
        found = self._snapshot
        if found is None:
            found = self._snapshot = (
                LinkLoad(self._bytes, self._flows) if self._bytes or self._flows else NO_LOAD
            )
        return found


@dataclass(frozen=True)
class TransferRequest:
    """What is to be moved: ``nbytes`` in ``chunks`` pieces (each pays the setup latency).

    ``manual_override`` names a transport that an operator forces for this transfer
    (Algorithm 1, line 3); every policy honours it.
    """

    nbytes: int
    chunks: int = 1
    manual_override: str | None = None

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            raise PolicyInputError(f"transfer size {self.nbytes} bytes is negative")
        if self.chunks < 1:
            raise PolicyInputError(f"a transfer needs at least one chunk, got {self.chunks}")
        if self.manual_override is not None and not self.manual_override.strip():
            raise PolicyInputError("manual override names no transport (empty string)")
