"""What MoE routing knows about expert replicas: a fresh snapshot, stragglers, load factors.

An :class:`ExpertReplica` is one copy of one expert (``layer``, ``expert``) on one worker,
with the statistics that worker last reported. :meth:`ExpertSnapshot.build` keeps the entries
fresh at the injected time, flags stragglers and answers, per NVLink domain, which replica
serves each expert and what it costs (:class:`DomainTable`, cached). Weights and thresholds
are :class:`MoEWeights`; their defaults and why: docs/moe.md ("Weights and thresholds").
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from topkv.policy.errors import PolicyInputError
from topkv.policy.view import Endpoint

#: One expert of one layer: ``(layer, expert)``.
ExpertKey = tuple[int, int]


@dataclass(frozen=True)
class MoEWeights:
    """Every weight and threshold of MoE routing (the module docstring says why each)."""

    stale_after_s: float = 30.0
    straggler_factor: float = 2.0
    rate: float = 0.4
    compute: float = 0.4
    queue: float = 0.2
    queue_norm: float = 8.0

    def __post_init__(self) -> None:
        _require_finite(self, ("stale_after_s", "rate", "compute", "queue"), "MoE weight ")
        _require_finite(self, ("straggler_factor", "queue_norm"), "MoE weight ", positive=True)


def _require_finite(
    obj: object, names: tuple[str, ...], where: str, positive: bool = False
) -> None:
    """Raise :class:`PolicyInputError` (its message starting with ``where``) for the first
    attribute of ``obj`` in ``names`` that is not finite and >= 0 (> 0 when ``positive``)."""
    for name in names:
        value = getattr(obj, name)
        if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
            bound = "> 0" if positive else ">= 0"
            raise PolicyInputError(f"{where}{name}={value} must be finite and {bound}")


DEFAULT_WEIGHTS = MoEWeights()


@dataclass(frozen=True)
class ExpertReplica:
    """One replica of expert ``expert`` of layer ``layer``, hosted by ``worker_id``.

    ``rate``: activations per second (an EMA); ``compute_s``: seconds per routed token
    on it (EMA); ``network_s``: the dispatch round trip the host measures (EMA);
    ``queue_depth``: batches waiting; ``updated_at``: when its host last reported, on the
    router's clock.
    """

    layer: int
    expert: int
    worker_id: str
    domain: str | None
    endpoint: Endpoint | None
    rate: float
    compute_s: float
    network_s: float
    queue_depth: int
    updated_at: float
    healthy: bool = True

    @property
    def key(self) -> ExpertKey:
        return (self.layer, self.expert)

    def __post_init__(self) -> None:
        where = f"expert {self.layer}/{self.expert} on {self.worker_id}: "
        _require_finite(self, ("rate", "compute_s", "network_s"), where)
        if self.queue_depth < 0:
            raise PolicyInputError(
                f"expert {self.layer}/{self.expert} on {self.worker_id}: queue_depth "
                f"{self.queue_depth} is negative"
            )


@dataclass(frozen=True)
class HostShare:
    """What one host serves for a domain: its share of the activations, the expected
    compute seconds per activation over that share, and the share that is straggling."""

    worker_id: str
    endpoint: Endpoint | None
    network_s: float
    share: float = 0.0
    compute_s: float = 0.0
    load_factor: float = 0.0
    straggling: float = 0.0


@dataclass(frozen=True)
class DomainTable:
    """For a decode target in ``domain``: the replicas it would dispatch to, per host."""

    domain: str | None
    local_share: float
    straggler_share: float
    hosts: tuple[HostShare, ...]
    #: The slowest serving replica's compute latency (queue included): each MoE layer's
    #: all-to-all completes when its slowest host does.
    slowest_compute_s: float = 0.0

    @property
    def load_factor(self) -> float:
        """The activation-weighted load factor of the replicas this domain uses."""
        return sum(h.load_factor for h in self.hosts)


@dataclass
class ExpertSnapshot:
    """The fresh replicas at one instant, with stragglers flagged (see the module doc)."""

    replicas: tuple[ExpertReplica, ...]
    weights: MoEWeights
    stragglers: frozenset[tuple[str, int, int]]
    #: The baseline compute latency: the lower quartile of the fresh healthy replicas'.
    baseline_compute_s: float
    mean_rate: float
    dropped_stale: int
    _by_key: dict[ExpertKey, list[ExpertReplica]] = field(default_factory=dict)
    _tables: dict[tuple[str | None, int | str | None], DomainTable] = field(default_factory=dict)
    _references: dict[ExpertKey, float] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        replicas: Iterable[ExpertReplica],
        now: float,
        weights: MoEWeights = DEFAULT_WEIGHTS,
    ) -> ExpertSnapshot:
        everything = list(replicas)
        fresh = tuple(
            sorted(
                (r for r in everything if now - r.updated_at <= weights.stale_after_s),
                key=lambda r: (r.layer, r.expert, r.worker_id),
            )
        )
        usable = [r for r in fresh if r.healthy]
        # A replica that never computed (no token routed to it yet) has no latency to count.
        baseline = _lower_quartile([r.compute_s for r in usable if r.compute_s > 0])
        mean_rate = statistics.fmean(r.rate for r in usable) if usable else 0.0
        by_key: dict[ExpertKey, list[float]] = {}
        for r in usable:
            if r.compute_s > 0:
                by_key.setdefault(r.key, []).append(r.compute_s)
        references = {key: _reference(values, baseline) for key, values in by_key.items()}
        slow = [
            r
            for r in usable
            if baseline > 0
            and r.compute_s > weights.straggler_factor * references.get(r.key, baseline)
        ]
        stragglers = _on_straggling_hosts(slow, usable)
        snapshot = cls(
            fresh, weights, stragglers, baseline, mean_rate, len(everything) - len(fresh)
        )
        snapshot._references = references
        for r in usable:
            snapshot._by_key.setdefault(r.key, []).append(r)
        return snapshot

    @property
    def keys(self) -> tuple[ExpertKey, ...]:
        return tuple(sorted(self._by_key))

    @property
    def straggler_workers(self) -> frozenset[str]:
        return frozenset(worker for worker, _, _ in self.stragglers)

    def is_straggler(self, r: ExpertReplica) -> bool:
        return (r.worker_id, r.layer, r.expert) in self.stragglers

    def effective_compute_s(self, r: ExpertReplica) -> float:
        """The compute latency the estimates use: a straggler's as measured; any other
        replica's at its reference (differences within the straggler threshold are
        measurement noise, and must not outweigh a cheaper KV transfer)."""
        if self.is_straggler(r):
            return r.compute_s
        return self._references.get(r.key, self.baseline_compute_s) or r.compute_s

    def load_factor(self, r: ExpertReplica) -> float:
        """``rate * rate/mean + compute * compute/baseline + queue * depth/queue_norm``
        (``baseline_compute_s``: the lower quartile of the latencies)."""
        w = self.weights
        rate = r.rate / self.mean_rate if self.mean_rate > 0 else 0.0
        compute = (
            self.effective_compute_s(r) / self.baseline_compute_s
            if self.baseline_compute_s > 0
            else 0.0
        )
        return w.rate * rate + w.compute * compute + w.queue * r.queue_depth / w.queue_norm

    def expected_shares(self) -> dict[ExpertKey, float]:
        """Each expert's expected share of a token's activations, from the rates.

        Per layer the rates of an expert's replicas are summed and normalised; every layer
        weighs the same; a layer with no rate at all is uniform. The shares sum to 1.
        """
        by_layer: dict[int, dict[int, float]] = {}
        for (layer, expert), reps in self._by_key.items():
            by_layer.setdefault(layer, {})[expert] = sum(r.rate for r in reps)
        shares: dict[ExpertKey, float] = {}
        for layer, rates in by_layer.items():
            total = sum(rates.values())
            for expert, rate in rates.items():
                each = rate / total if total > 0 else 1.0 / len(rates)
                shares[(layer, expert)] = each / len(by_layer)
        return shares

    def serving(self, domain: str | None, key: ExpertKey) -> ExpertReplica | None:
        """The replica a target in ``domain`` dispatches ``key`` to, as expert parallelism
        places it: the one in ``domain`` when there is one (a straggler too: routing
        avoids a straggler by choosing the target, not the replica); else the cheapest
        (``compute * (1 + queue) + network``) that is not a straggler where one is not,
        then the smallest worker id."""
        reps = self._by_key.get(key)
        if not reps:
            return None
        local = [r for r in reps if domain is not None and r.domain == domain]
        pool = local or [r for r in reps if not self.is_straggler(r)] or reps
        return min(
            pool,
            key=lambda r: (
                self.effective_compute_s(r) * (1 + r.queue_depth) + r.network_s,
                r.worker_id,
            ),
        )

    def table(
        self,
        domain: str | None,
        shares: Mapping[ExpertKey, float] | None = None,
        shares_id: int | str | None = None,
    ) -> DomainTable:
        """Where a target in ``domain`` sends its activations: for the rate-derived shares
        (``shares`` None) or a prompt's known routing; cached per domain and ``shares_id``
        (known shares without an id are computed afresh)."""
        cacheable = shares is None or shares_id is not None
        cache_key = (domain, shares_id)
        if cacheable and cache_key in self._tables:
            return self._tables[cache_key]
        if shares is None:
            shares = self.expected_shares()
        hosts: dict[str, dict[str, float]] = {}
        meta: dict[str, ExpertReplica] = {}
        local = straggling = slowest = 0.0
        for key in sorted(shares):
            share = shares[key]
            r = self.serving(domain, key)
            if r is None or share <= 0:
                continue
            acc = hosts.setdefault(
                r.worker_id, {"share": 0.0, "compute": 0.0, "lf": 0.0, "st": 0.0}
            )
            meta.setdefault(r.worker_id, r)
            acc["share"] += share
            latency = self.effective_compute_s(r) * (1 + r.queue_depth)
            slowest = max(slowest, latency)
            acc["compute"] += share * latency
            acc["lf"] += share * self.load_factor(r)
            if self.is_straggler(r):
                acc["st"] += share
                straggling += share
            if domain is not None and r.domain == domain:
                local += share
        table = DomainTable(
            domain,
            local,
            straggling,
            tuple(
                HostShare(
                    wid,
                    meta[wid].endpoint,
                    meta[wid].network_s,
                    acc["share"],
                    acc["compute"],
                    acc["lf"],
                    acc["st"],
                )
                for wid, acc in sorted(hosts.items())
            ),
            slowest,
        )
        if cacheable:
            self._tables[cache_key] = table
        return table


def _lower_quartile(values: list[float]) -> float:
    """The 25th percentile (linear between order statistics); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = 0.25 * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _reference(same_expert: list[float], baseline: float) -> float:
    """The latency a replica is compared with: its expert's replicas', else the baseline."""
    return _lower_quartile(same_expert) if len(same_expert) >= 2 else baseline


def _on_straggling_hosts(
    slow: list[ExpertReplica], usable: list[ExpertReplica]
) -> frozenset[tuple[str, int, int]]:
    """The slow replicas of hosts at least half of whose measured replicas are slow: a
    straggler is a slow host (throttled, contended); one slow replica among fast ones on
    the same host is timing noise."""
    measured: dict[str, int] = {}
    for r in usable:
        if r.compute_s > 0:
            measured[r.worker_id] = measured.get(r.worker_id, 0) + 1
    count: dict[str, int] = {}
    for r in slow:
        count[r.worker_id] = count.get(r.worker_id, 0) + 1
    hosts = {w for w, n in count.items() if 2 * n >= measured.get(w, 1)}
    return frozenset((r.worker_id, r.layer, r.expert) for r in slow if r.worker_id in hosts)
