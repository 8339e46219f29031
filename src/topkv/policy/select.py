"""Transport selection policies: which path moves one KV cache between a GPU pair.

Every policy has the same shape: ``select(pair, request, load) -> Selection``. It reads only
the immutable :class:`~topkv.policy.view.PairView`, the request and a
:class:`~topkv.policy.view.LinkLoad` snapshot (plus, for measured bandwidth, a
:class:`~topkv.policy.bandwidth.BandwidthReader` whose time is injected), so the live relay
and the simulator run exactly the same decision code.

A :class:`Selection` ranks every candidate path; its ``fallbacks`` are the other transports
in rank order, so failing over after a transport error is
:func:`next_after_failure`. Every policy honours ``request.manual_override`` first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

from topkv.planner.transports import GB
from topkv.policy.bandwidth import BandwidthReader, NominalBandwidth
from topkv.policy.errors import NoPathError, PolicyInputError
from topkv.policy.estimate import CandidateEstimate, estimate_path, estimate_seconds
from topkv.policy.view import (
    NO_LOAD,
    NVLINK_FAMILY,
    TRANSPORT_LADDER,
    LinkLoad,
    PairView,
    PathCandidate,
    TransferRequest,
    ladder_rank,
)


@dataclass(frozen=True)
class Selection:
    """A policy's decision: the chosen transport, every candidate ranked, the fallbacks.

    ``candidates[0]`` is the chosen path. ``fallbacks`` lists the other transports in the
    order to try them if the chosen one fails.
    """

    policy: str
    choice: str
    candidates: tuple[CandidateEstimate, ...]
    fallbacks: tuple[str, ...]
    rationale: str

    @property
    def chosen(self) -> CandidateEstimate:
        """The chosen path's estimate."""
        return self.candidates[0]

    @property
    def ranked_transports(self) -> tuple[str, ...]:
        """The choice followed by the fallbacks."""
        return (self.choice, *self.fallbacks)

    def best_path(self, transport: str) -> CandidateEstimate | None:
        """The best-ranked path that uses ``transport``, if any."""
        return next((c for c in self.candidates if c.transport == transport), None)

    def to_dict(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "choice": self.choice,
            "rationale": self.rationale,
            "fallbacks": list(self.fallbacks),
            "candidates": [c.to_dict() for c in self.candidates],
        }


class TransportSelector(Protocol):
    """The interface every selection policy implements."""

    @property
    def name(self) -> str: ...

    def select(
        self, pair: PairView, request: TransferRequest, load: LinkLoad = NO_LOAD
    ) -> Selection: ...


def transfer_cost(
    selector: TransportSelector, pair: PairView, request: TransferRequest, load: LinkLoad
) -> float:
    """``selector.select(pair, request, load).chosen.estimated_s``, cheaply.

    Uses the selector's ``cost`` method when it has one (every policy here does: the same
    arithmetic without ranking every path or building a :class:`Selection`), else selects.
    Raises what ``select`` raises (:class:`NoPathError` when there is no usable path).
    """
    return cost_function(selector)(pair, request, load)


CostFunction = Callable[[PairView, TransferRequest, LinkLoad], float]


def cost_function(selector: TransportSelector) -> CostFunction:
    """The function :func:`transfer_cost` calls for ``selector`` (resolve it once per batch)."""
    cost = getattr(selector, "cost", None)
    if callable(cost):
        return cast(CostFunction, cost)

    def by_selecting(pair: PairView, request: TransferRequest, load: LinkLoad) -> float:
        return selector.select(pair, request, load).chosen.estimated_s

    return by_selecting


def next_after_failure(selection: Selection, failed: str | Iterable[str]) -> str | None:
    """The best-ranked transport of ``selection`` that is not in ``failed``, or None."""
    failed_set = {failed} if isinstance(failed, str) else set(failed)
    return next((t for t in selection.ranked_transports if t not in failed_set), None)


def _require_candidates(pair: PairView) -> None:
    if not pair.candidates:
        raise NoPathError(f"no path at all between {pair.src} and {pair.dst}")


def _require_transport(pair: PairView, transport: str, why: str) -> None:
    if not pair.paths_for(transport):
        have = ", ".join(pair.transports) or "none"
        raise NoPathError(
            f"{why} chose {transport!r}, but {pair.src} -> {pair.dst} has no {transport} path"
            f" (paths: {have})"
        )


def _estimate_all(
    pair: PairView, request: TransferRequest, load: LinkLoad, reader: BandwidthReader
) -> list[tuple[int, PathCandidate, CandidateEstimate]]:
    return [
        (index, path, estimate_path(path, request, load, reader))
        for index, path in enumerate(pair.candidates)
    ]


def _build(
    policy: str,
    ranked: Sequence[CandidateEstimate],
    rationale: str,
) -> Selection:
    transports = tuple(dict.fromkeys(c.transport for c in ranked))
    return Selection(
        policy=policy,
        choice=ranked[0].transport,
        candidates=tuple(ranked),
        fallbacks=transports[1:],
        rationale=rationale,
    )


def _promote(ranked: list[CandidateEstimate], transport: str) -> list[CandidateEstimate]:
    """Move the best-ranked path of ``transport`` to the front, keeping the rest in order."""
    first = next(i for i, c in enumerate(ranked) if c.transport == transport)
    return [ranked[first], *ranked[:first], *ranked[first + 1 :]]


def _ladder_order(
    estimates: list[tuple[int, PathCandidate, CandidateEstimate]],
) -> list[CandidateEstimate]:
    """Candidates in Algorithm 1's fixed order, the view's order within a transport."""
    ordered = sorted(estimates, key=lambda e: (ladder_rank(e[1].transport), e[0]))
    return [e[2] for e in ordered]


class PaperPolicy:
    """Algorithm 1 of the paper, exactly.

    1. a manual override wins; 2. same NVLink domain -> nvlink (the pair's NVLink-family
    path: ``nvlink``, or ``nvswitch`` on an NVSwitch domain); 3. same node -> pcie;
    4. RDMA available -> rdma; 5. otherwise tcp.

    The choice reads only the pair's facts, never the load or measured bandwidth. Estimates
    are still computed (with the same formula as :class:`CostPolicy`) so that a report can
    show what the fixed order costs. Within a transport the view's first path is used;
    fallbacks follow the same fixed order.
    """

    name = "paper"

    def __init__(self, reader: BandwidthReader | None = None) -> None:
        self._reader: BandwidthReader = reader if reader is not None else NominalBandwidth()

    def decide(self, pair: PairView, request: TransferRequest) -> tuple[str, str]:
        """Algorithm 1 alone: ``(transport, why)`` from the pair's facts and the override."""
        if request.manual_override is not None:
            return request.manual_override, "manual override configured (Algorithm 1, line 3)"
        if pair.same_nvlink_domain:
            family = [t for t in TRANSPORT_LADDER if t in NVLINK_FAMILY and pair.paths_for(t)]
            return (family[0] if family else "nvlink"), "same NVLink domain (Algorithm 1, line 6)"
        if pair.same_node:
            return "pcie", "same node, different NVLink domain (Algorithm 1, line 9)"
        if pair.rdma_available:
            return "rdma", "different nodes, RDMA available (Algorithm 1, line 12)"
        return "tcp", "different nodes, no RDMA: TCP fallback (Algorithm 1, line 15)"

    def select(
        self, pair: PairView, request: TransferRequest, load: LinkLoad = NO_LOAD
    ) -> Selection:
        _require_candidates(pair)
        transport, why = self.decide(pair, request)
        _require_transport(pair, transport, f"Algorithm 1 ({why})")
        ranked = _promote(
            _ladder_order(_estimate_all(pair, request, load, self._reader)), transport
        )
        return _build(self.name, ranked, why)

    def cost(self, pair: PairView, request: TransferRequest, load: LinkLoad = NO_LOAD) -> float:
        """The chosen path's estimate, as :meth:`select` would report it."""
        _require_candidates(pair)
        transport, why = self.decide(pair, request)
        _require_transport(pair, transport, f"Algorithm 1 ({why})")
        return _first_path_cost(pair, transport, request, load, self._reader)


def _first_path_cost(
    pair: PairView,
    transport: str,
    request: TransferRequest,
    load: LinkLoad,
    reader: BandwidthReader,
) -> float:
    """Estimate of the view's first ``transport`` path (what a fixed-order policy picks)."""
    path = next(c for c in pair.candidates if c.transport == transport)
    return estimate_seconds(path, request, load, reader)


class CostPolicy:
    """The default: the path with the minimum estimated completion time.

    ``estimated_s = chunks * setup_latency + (nbytes + queued_bytes) / bandwidth``, with
    measured bandwidth where the reader has a fresh figure and the bytes already queued on
    the path's busiest shared link (see :mod:`topkv.policy.estimate`). Ties go to the
    fixed order (nvlink, nvswitch, pcie, rdma, tcp), then to the view's order.

    Why Algorithm 1's fixed order is wrong, and this policy is the default:

    * **Many small chunks.** The order ranks paths by peak bandwidth alone, but a transfer
      split into ``n`` pieces pays the setup latency ``n`` times. Layer-by-layer streaming of
      paged KV sends thousands of pieces (Llama-3-70B at 4K tokens, 16-token pages, 80
      layers: 20,480 pieces of 64 KiB), so a path with 20 us per-piece setup spends 0.41 s
      on setup alone and loses to a path with half the bandwidth and 2 us setup.
    * **A busy link.** The order ignores traffic. If 4 GB are already queued on a node's
      RDMA NIC, a 1.34 GB cache takes (1.34 + 4) / 25 = 214 ms there, and 134 ms over an
      idle 10 GB/s path; likewise a second, idle NIC beats the busy one.
    * **Nominal is not measured.** A NIC that negotiated half its rate, or a PCIe path that
      crosses sockets, is slower than its table entry; measured bandwidth corrects that.
    """

    name = "cost"

    def __init__(self, reader: BandwidthReader | None = None) -> None:
        self._reader: BandwidthReader = reader if reader is not None else NominalBandwidth()

    def select(
        self, pair: PairView, request: TransferRequest, load: LinkLoad = NO_LOAD
    ) -> Selection:
        _require_candidates(pair)
        estimates = _estimate_all(pair, request, load, self._reader)
        ordered = sorted(
            estimates, key=lambda e: (e[2].estimated_s, ladder_rank(e[1].transport), e[0])
        )
        ranked = [e[2] for e in ordered]
        if request.manual_override is not None:
            _require_transport(pair, request.manual_override, "the manual override")
            return _build(
                self.name,
                _promote(ranked, request.manual_override),
                "manual override configured",
            )
        best = ranked[0]
        return _build(
            self.name, ranked, f"minimum estimated completion time ({best.estimated_s:.6g} s)"
        )

    def cost(self, pair: PairView, request: TransferRequest, load: LinkLoad = NO_LOAD) -> float:
        """The chosen path's estimate (the minimum one, or the override's best), as
        :meth:`select` would report it, without ranking every path."""
        _require_candidates(pair)
        override = request.manual_override
        if override is not None:
            _require_transport(pair, override, "the manual override")
        # estimate_seconds() per path, inlined (routing runs this for every decode worker);
        # the property tests check it equals select()'s chosen estimate exactly.
        reader = self._reader
        nbytes, chunks = request.nbytes, request.chunks
        in_flight, flows = load.bytes_in_flight, load.active_flows
        best = math.inf
        for path in pair.candidates:
            if override is not None and path.transport != override:
                continue
            queued = 0
            if in_flight:
                for link in path.links:
                    on_link = in_flight.get(link, 0)
                    count = flows.get(link, 0)
                    if count > 0:
                        on_link = min(on_link, count * nbytes)
                    if on_link > queued:
                        queued = on_link
            estimated = chunks * path.setup_latency_s + (nbytes + queued) / (
                reader.reading(path).gbps * GB
            )
            if estimated < best:
                best = estimated
        return best


class UniformPolicy:
    """One transport for every pair (e.g. uniform RDMA, the baseline the paper argues
    against). A manual override still wins; fallbacks follow the fixed order."""

    def __init__(self, transport: str, reader: BandwidthReader | None = None) -> None:
        if not transport:
            raise PolicyInputError("a uniform policy needs a transport name")
        self.transport = transport
        self._reader: BandwidthReader = reader if reader is not None else NominalBandwidth()

    @property
    def name(self) -> str:
        return f"uniform-{self.transport}"

    def select(
        self, pair: PairView, request: TransferRequest, load: LinkLoad = NO_LOAD
    ) -> Selection:
        _require_candidates(pair)
        if request.manual_override is not None:
            transport, why = request.manual_override, "manual override configured"
        else:
            transport, why = self.transport, f"uniform policy: always {self.transport}"
        _require_transport(pair, transport, self.name)
        ranked = _promote(
            _ladder_order(_estimate_all(pair, request, load, self._reader)), transport
        )
        return _build(self.name, ranked, why)

    def cost(self, pair: PairView, request: TransferRequest, load: LinkLoad = NO_LOAD) -> float:
        """The chosen path's estimate, as :meth:`select` would report it."""
        _require_candidates(pair)
        override = request.manual_override
        transport = override if override is not None else self.transport
        _require_transport(pair, transport, self.name)
        return _first_path_cost(pair, transport, request, load, self._reader)


POLICY_NAMES: tuple[str, ...] = ("cost", "paper", "uniform-<transport>")


def policy_from_name(name: str, reader: BandwidthReader | None = None) -> TransportSelector:
    """``cost``, ``paper`` or ``uniform-<transport>`` (e.g. ``uniform-rdma``)."""
    key = name.strip().lower()
    if key == "cost":
        return CostPolicy(reader)
    if key == "paper":
        return PaperPolicy(reader)
    if key.startswith("uniform-") and key[len("uniform-") :]:
        return UniformPolicy(key[len("uniform-") :], reader)
    raise PolicyInputError(
        f"unknown selection policy {name!r}; use one of: {', '.join(POLICY_NAMES)}"
    )
