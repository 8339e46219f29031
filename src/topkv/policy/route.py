"""Decode-worker routing: which decode worker receives a prefilled request's KV cache.

Rule: among healthy decode workers with a free slot (and not excluded), pick the cheapest
transfer from the source GPU (the transport selector's estimate for its chosen path), then
the least loaded, then the smallest worker id, so the decision is deterministic. Costs
within ``cost_tolerance`` (relative) of the cheapest count as equally cheap, so float noise
never overrides load. Workers the selector finds no path to are skipped.

Rerouting after a destination died is the same call with that worker in ``exclude``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from topkv.policy.errors import NoPathError, PolicyInputError
from topkv.policy.select import Selection, TransportSelector
from topkv.policy.view import NO_LOAD, Endpoint, LinkLoad, PairView, TransferRequest

PairViewLookup = Callable[[Endpoint, Endpoint], PairView]


@dataclass(frozen=True)
class DecodeWorkerView:
    """What routing may know about one decode worker."""

    worker_id: str
    endpoint: Endpoint
    free_slots: int
    load: float
    healthy: bool = True

    @property
    def eligible(self) -> bool:
        return self.healthy and self.free_slots > 0


@dataclass(frozen=True)
class RouteDecision:
    """The chosen decode worker, the transfer selection to it, and the runner-up workers."""

    worker_id: str
    endpoint: Endpoint
    selection: Selection
    estimated_s: float
    alternatives: tuple[str, ...]
    rationale: str


@dataclass(frozen=True)
class _Scored:
    worker: DecodeWorkerView
    selection: Selection

    @property
    def cost(self) -> float:
        return self.selection.chosen.estimated_s


class RoutingPolicy:
    """Cheapest transfer, then least loaded, then worker id (see the module docstring)."""

    def __init__(self, cost_tolerance: float = 1e-9) -> None:
        if not cost_tolerance >= 0:
            raise PolicyInputError(f"cost tolerance {cost_tolerance} must be >= 0")
        self.cost_tolerance = cost_tolerance

    def choose_decode(
        self,
        source: Endpoint,
        candidates: Sequence[DecodeWorkerView],
        pair_view: PairViewLookup,
        request: TransferRequest,
        selector: TransportSelector,
        load: LinkLoad = NO_LOAD,
        exclude: Collection[str] = frozenset(),
    ) -> RouteDecision | None:
        """The decode worker to send ``request``'s KV to, or None when no worker fits."""
        scored: list[_Scored] = []
        for worker in candidates:
            if not worker.eligible or worker.worker_id in exclude:
                continue
            try:
                selection = selector.select(pair_view(source, worker.endpoint), request, load)
            except NoPathError:
                continue
            scored.append(_Scored(worker, selection))
        if not scored:
            return None
        cheapest = min(s.cost for s in scored)
        limit = cheapest * (1.0 + self.cost_tolerance)
        tied = [s for s in scored if s.cost <= limit]
        best = min(tied, key=lambda s: (s.worker.load, s.worker.worker_id))
        rest = sorted(
            (s for s in scored if s is not best),
            key=lambda s: (s.cost, s.worker.load, s.worker.worker_id),
        )
        why = (
            f"cheapest transfer ({best.cost:.6g} s over {best.selection.choice})"
            if len(tied) == 1
            else f"{len(tied)} tie at {best.cost:.6g} s; least loaded ({best.worker.load:g})"
        )
        return RouteDecision(
            worker_id=best.worker.worker_id,
            endpoint=best.worker.endpoint,
            selection=best.selection,
            estimated_s=best.cost,
            alternatives=tuple(s.worker.worker_id for s in rest),
            rationale=why,
        )
