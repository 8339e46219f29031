"""MoE-aware decode routing (paper §3.6): four strategies over one expert snapshot.

:class:`MoERouter` picks a decode target for a :class:`MoERequest` by one of
:data:`STRATEGIES` (``cache-affinity``, ``expert-locality``, ``load-balance``, ``cost``, the
default), weighing how far the request's KV travels (once) against how far every decode
step's expert dispatch travels (per token); it reads an
:class:`~topkv.policy.moe.experts.ExpertSnapshot` and answers a :class:`MoEDecision`, or None
with no eligible target. The strategies and their terms: docs/moe.md ("The strategies").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from topkv.policy.clock import Clock
from topkv.policy.errors import NoPathError, PolicyInputError
from topkv.policy.moe.experts import (
    DEFAULT_WEIGHTS,
    DomainTable,
    ExpertKey,
    ExpertReplica,
    ExpertSnapshot,
    MoEWeights,
)
from topkv.policy.route import PairViewLookup, SlotEligible
from topkv.policy.select import CostFunction, TransportSelector, cost_function
from topkv.policy.view import NO_LOAD, Endpoint, LinkLoad, TransferRequest

STRATEGIES: tuple[str, ...] = ("cache-affinity", "expert-locality", "load-balance", "cost")
#: Bytes per element of a dispatched hidden state (BF16, out and back).
DISPATCH_DTYPE_BYTES = 2
DEFAULT_STRATEGY = "cost"
_TOLERANCE = 1e-9


def dispatch_bytes_per_activation(hidden_size: int, dtype_bytes: int = DISPATCH_DTYPE_BYTES) -> int:
    """What one activation moves: the token's hidden state to the expert and its output
    back."""
    return 2 * hidden_size * dtype_bytes


@dataclass(frozen=True)
class MoETarget(SlotEligible):
    """A decode worker as MoE routing sees it; ``load`` is its share of slots in use,
    ``queue_s`` the expected wait before its decode of this request starts."""

    worker_id: str
    endpoint: Endpoint
    domain: str | None
    free_slots: int
    load: float = 0.0
    queue_s: float = 0.0
    healthy: bool = True
    holds_kv: bool = False


@dataclass(frozen=True)
class MoERequest:
    """One request to route: its KV transfer and its decode's expert traffic.

    ``activations_per_token``: experts_per_token x MoE layers; ``dispatch_bytes``: what
    one activation moves (the hidden state out and back); ``shares``: the prompt's known
    routing as each expert's share of a token's activations (None: from the rates).
    """

    kv: TransferRequest
    decode_tokens: int = 1
    activations_per_token: int = 1
    dispatch_bytes: int = 0
    shares: Mapping[ExpertKey, float] | None = None
    #: Names ``shares`` for the snapshot's cache (equal ids: equal shares); None: no cache.
    shares_id: int | str | None = None

    def __post_init__(self) -> None:
        if self.decode_tokens < 0 or self.activations_per_token < 0 or self.dispatch_bytes < 0:
            raise PolicyInputError(
                "MoE request: decode_tokens, activations_per_token and dispatch_bytes must "
                f"be >= 0 (got {self.decode_tokens}, {self.activations_per_token}, "
                f"{self.dispatch_bytes})"
            )


@dataclass(frozen=True)
class MoEDecision:
    """The chosen target, the strategy that chose it, and the terms behind the choice."""

    worker_id: str
    strategy: str
    score: float
    kv_s: float
    dispatch_s: float
    queue_s: float
    local_share: float
    load_factor: float
    straggler_share: float
    alternatives: tuple[str, ...]
    rationale: str

    def to_dict(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class _Scored:
    target: MoETarget
    kv_s: float
    table: DomainTable
    dispatch_s: float
    stretch: float = 1.0

    @property
    def total_s(self) -> float:
        return self.kv_s + self.dispatch_s + self.queue_s

    @property
    def queue_s(self) -> float:
        """The target's expected wait, in its steps, which its slowest expert host
        stretches (``stretch``: that host's compute latency over the baseline, >= 1)."""
        return self.target.queue_s * self.stretch


class MoERouter:
    """Routes decode by one strategy (see the module docstring); time comes from ``clock``."""

    def __init__(
        self,
        clock: Clock,
        strategy: str = DEFAULT_STRATEGY,
        weights: MoEWeights = DEFAULT_WEIGHTS,
    ) -> None:
        if strategy not in STRATEGIES:
            raise PolicyInputError(
                f"unknown MoE router {strategy!r}; use one of {', '.join(STRATEGIES)}"
            )
        self.clock = clock
        self.strategy = strategy
        self.weights = weights

    def snapshot(self, replicas: Iterable[ExpertReplica]) -> ExpertSnapshot:
        """The fresh replicas now (stale ones, whose host missed its heartbeats, dropped)."""
        return ExpertSnapshot.build(replicas, self.clock.now(), self.weights)

    def decide(
        self,
        snapshot: ExpertSnapshot,
        source: Endpoint,
        targets: Sequence[MoETarget],
        pair_view: PairViewLookup,
        request: MoERequest,
        selector: TransportSelector,
        load: LinkLoad = NO_LOAD,
        exclude: Collection[str] = frozenset(),
    ) -> MoEDecision | None:
        """The target to decode ``request`` on, or None when no target is eligible."""
        cost_of = cost_function(selector)
        scored: list[_Scored] = []
        for t in targets:
            if not t.eligible or t.worker_id in exclude:
                continue
            try:
                kv_s = cost_of(pair_view(source, t.endpoint), request.kv, load)
            except NoPathError:
                continue
            table = snapshot.table(t.domain, request.shares, request.shares_id)
            dispatch = self._dispatch_s(t, table, request, pair_view, cost_of, load)
            base = snapshot.baseline_compute_s
            stretch = max(1.0, table.slowest_compute_s / base) if base > 0 else 1.0
            scored.append(_Scored(t, kv_s, table, dispatch, stretch))
        if not scored:
            return None
        key, why = _RULES[self.strategy]
        ranked = sorted(scored, key=lambda s: (key(s), s.target.load, s.target.worker_id))
        best = _break_tie(ranked, key)
        rest = tuple(s.target.worker_id for s in ranked if s is not best)
        return MoEDecision(
            worker_id=best.target.worker_id,
            strategy=self.strategy,
            score=key(best),
            kv_s=best.kv_s,
            dispatch_s=best.dispatch_s,
            queue_s=best.queue_s,
            local_share=best.table.local_share,
            load_factor=best.table.load_factor,
            straggler_share=best.table.straggler_share,
            alternatives=rest,
            rationale=why(best),
        )

    @staticmethod
    def _dispatch_s(
        target: MoETarget,
        table: DomainTable,
        request: MoERequest,
        pair_view: PairViewLookup,
        cost_of: CostFunction,
        load: LinkLoad,
    ) -> float:
        """Expected dispatch seconds of the whole decode (see the module docstring)."""
        acts = request.activations_per_token
        if request.decode_tokens == 0 or acts == 0:
            return 0.0
        # Expert compute: every activation waits for its layer's all-to-all, which ends with
        # the slowest serving host (a straggler slows every step that touches it).
        per_token = acts * table.slowest_compute_s
        for host in table.hosts:
            calls = host.share * acts
            if host.endpoint == target.endpoint:
                continue
            hop = calls * host.network_s
            if host.endpoint is not None and request.dispatch_bytes > 0:
                nbytes = round(calls * request.dispatch_bytes)
                with contextlib.suppress(NoPathError):
                    hop = cost_of(
                        pair_view(target.endpoint, host.endpoint),
                        TransferRequest(nbytes=nbytes, chunks=max(1, round(calls))),
                        load,
                    )
            per_token += hop
        return per_token * request.decode_tokens


_Key = Callable[[_Scored], float]


def _break_tie(ranked: list[_Scored], key: _Key) -> _Scored:
    """The first of ``ranked`` (already by key, load, id), treating keys within the
    tolerance as equal so float noise never overrides load."""
    best = ranked[0]
    bound = key(best)
    limit = bound + abs(bound) * _TOLERANCE
    tied = [s for s in ranked if key(s) <= limit]
    return min(tied, key=lambda s: (s.target.load, s.target.worker_id))


def _affinity(s: _Scored) -> float:
    return -1.0 if s.target.holds_kv else s.kv_s


def _locality(s: _Scored) -> float:
    return -s.table.local_share


def _balance(s: _Scored) -> float:
    # A straggler served from the target's own choice of replicas puts it behind every
    # target without one (the load factor is well below 1e6).
    return s.table.load_factor + (1e6 if s.table.straggler_share > 0 else 0.0)


def _cost(s: _Scored) -> float:
    return s.total_s


_RULES: dict[str, tuple[_Key, Callable[[_Scored], str]]] = {
    "cache-affinity": (
        _affinity,
        lambda s: "holds the KV" if s.target.holds_kv else f"cheapest KV transfer {s.kv_s:.6g} s",
    ),
    "expert-locality": (
        _locality,
        lambda s: f"domain {s.target.domain} hosts {s.table.local_share:.1%} of the activations",
    ),
    "load-balance": (
        _balance,
        lambda s: (
            f"load factor {s.table.load_factor:.4g}"
            + (f", {s.table.straggler_share:.1%} straggling" if s.table.straggler_share else "")
        ),
    ),
    "cost": (
        _cost,
        lambda s: (
            f"kv {s.kv_s:.4g} s + dispatch {s.dispatch_s:.4g} s + queue {s.target.queue_s:.4g} s"
        ),
    ),
}
