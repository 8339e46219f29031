"""Decode-worker routing: which decode worker receives a prefilled request's KV cache.

Rule: among healthy decode workers with a free slot (and not excluded), pick the cheapest
transfer from the source GPU (the transport selector's estimate for its chosen path), then
the least loaded, then the smallest worker id, so the decision is deterministic. Costs
within ``cost_tolerance`` (relative) of the cheapest count as equally cheap, so float noise
never overrides load. Workers the selector finds no path to are skipped.

Rerouting after a destination died is the same call with that worker in ``exclude``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from topkv.policy.errors import NoPathError, PolicyInputError
from topkv.policy.select import Selection, TransportSelector, cost_function
from topkv.policy.view import NO_LOAD, Endpoint, LinkLoad, PairView, TransferRequest

PairViewLookup = Callable[[Endpoint, Endpoint], PairView]


class SlotEligible:
    """A decode worker's eligibility rule, shared by every routing view of one: it may
    take a request when healthy and with a free slot."""

    healthy: bool
    free_slots: int

    @property
    def eligible(self) -> bool:
        return self.healthy and self.free_slots > 0


@dataclass(frozen=True)
class DecodeWorkerView(SlotEligible):
    """What routing may know about one decode worker."""

    worker_id: str
    endpoint: Endpoint
    free_slots: int
    load: float
    healthy: bool = True


@dataclass(frozen=True)
class RouteDecision:
    """The chosen decode worker, the transfer selection to it, and the runner-up workers."""

    worker_id: str
    endpoint: Endpoint
    selection: Selection
    estimated_s: float
    alternatives: tuple[str, ...]
    rationale: str


class RouteScore(NamedTuple):
    """One decode worker's transfer cost from a source: the selector's chosen estimate.

    Depends only on the pair, the request and the link load, never on the worker's slots
    or load, so a caller may keep a tuple of scores while those inputs stay the same.
    """

    cost: float
    worker_id: str
    endpoint: Endpoint
    pair: PairView


class RoutingPolicy:
    """Cheapest transfer, then least loaded, then worker id (see the module docstring).

    :meth:`choose_decode` is the whole decision. It is also available in two steps for a
    caller that routes many requests between changes of its inputs: :meth:`score` (the
    transfer costs, independent of slots and worker load) and :meth:`choose_scored` (the
    rule applied to the workers' current slots and load); ``choose_decode`` is exactly
    ``choose_scored(score(...))`` over the eligible workers.

    Costs come from :func:`~topkv.policy.select.transfer_cost` (the chosen path's estimate
    without building a full selection); only the chosen worker's pair is selected in full.
    """

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
        workers = {w.worker_id: w for w in candidates if w.eligible and w.worker_id not in exclude}
        scores = self.score(
            source,
            [(w.worker_id, w.endpoint) for w in workers.values()],
            pair_view,
            request,
            selector,
            load,
        )
        return self.choose_scored(scores, workers, selector, request, load)

    @staticmethod
    def score(
        source: Endpoint,
        workers: Iterable[tuple[str, Endpoint]],
        pair_view: PairViewLookup,
        request: TransferRequest,
        selector: TransportSelector,
        load: LinkLoad = NO_LOAD,
    ) -> tuple[RouteScore, ...]:
        """Each worker's transfer cost, cheapest first (then by worker id).

        Workers the selector finds no path to are left out.
        """
        scores: list[RouteScore] = []
        cost_of = cost_function(selector)
        for worker_id, endpoint in workers:
            pair = pair_view(source, endpoint)
            try:
                cost = cost_of(pair, request, load)
            except NoPathError:
                continue
            scores.append(RouteScore(cost, worker_id, endpoint, pair))
        scores.sort(key=_cost_then_id)
        return tuple(scores)

    def choose_scored(
        self,
        scores: Sequence[RouteScore],
        workers: Mapping[str, DecodeWorkerView],
        selector: TransportSelector,
        request: TransferRequest,
        load: LinkLoad = NO_LOAD,
        exclude: Collection[str] = frozenset(),
    ) -> RouteDecision | None:
        """Apply the rule to ``scores`` (from :meth:`score`, cheapest first, computed with
        the same ``selector``, ``request`` and ``load``).

        ``workers`` holds the current slots and load by worker id; a scored worker missing
        from it, ineligible or in ``exclude`` is passed over. The chosen worker's pair is
        selected in full for the decision.
        """
        # (cost, load, worker id, ...): tuples compare natively, and ids are unique, so
        # sorting never reaches the objects at the end.
        usable: list[tuple[float, float, str, RouteScore, DecodeWorkerView]] = []
        for score in scores:
            worker = workers.get(score.worker_id)
            if (
                worker is None
                or not (worker.healthy and worker.free_slots > 0)
                or score.worker_id in exclude
            ):
                continue
            usable.append((score.cost, worker.load, score.worker_id, score, worker))
        if not usable:
            return None
        limit = usable[0][0] * (1.0 + self.cost_tolerance)
        tied = 1
        while tied < len(usable) and usable[tied][0] <= limit:
            tied += 1
        best_index = 0
        if tied > 1:
            best_index = min(range(tied), key=lambda i: (usable[i][1], usable[i][2]))
        _, _, _, best, best_worker = usable.pop(best_index)
        usable.sort()
        selection = selector.select(best.pair, request, load)
        why = (
            f"cheapest transfer ({best.cost:.6g} s over {selection.choice})"
            if tied == 1
            else f"{tied} tie at {best.cost:.6g} s; least loaded ({best_worker.load:g})"
        )
        return RouteDecision(
            worker_id=best.worker_id,
            endpoint=best_worker.endpoint,
            selection=selection,
            estimated_s=best.cost,
            alternatives=tuple(u[2] for u in usable),
            rationale=why,
        )


def _cost_then_id(score: RouteScore) -> tuple[float, str]:
    return (score.cost, score.worker_id)
