"""The expert registry: every expert replica the workers report, indexed three ways.

It mirrors the orchestrator's :class:`~topkv.relay.liveview.LiveWorkerView` (so memory and
etcd backends alike, and a restarted orchestrator rebuilds it from etcd with the records):
each worker record that carries an :class:`~topkv.relay.workers.ExpertReport` adds its
replicas, indexed by ``(layer, expert)``, by worker and by NVLink domain. A report counts
from when a new one (a higher ``sequence``) arrived, on the injected clock; one older than
``stale_after_s`` (the worker missed its heartbeats) is left out of every answer, and a
worker that leaves takes its replicas with it.

One registry per view (:meth:`ExpertRegistry.of`): routing and ``GET /v1/experts`` read the
same one.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

from topkv.policy.clock import Clock
from topkv.policy.moe.experts import DEFAULT_WEIGHTS, ExpertReplica, ExpertSnapshot, MoEWeights
from topkv.policy.view import Endpoint
from topkv.relay.liveview import LiveWorkerView
from topkv.relay.workers import ExpertReport, ExpertStat, RegistryEvent, WorkerInfo


@dataclass(frozen=True)
class _Reported:
    info: WorkerInfo
    report: ExpertReport
    received_at: float


_BY_VIEW: weakref.WeakKeyDictionary[LiveWorkerView, ExpertRegistry] = weakref.WeakKeyDictionary()
_BY_VIEW_LOCK = threading.Lock()


class ExpertRegistry:
    """Expert replicas by ``(layer, expert)``, worker and domain (see the module doc)."""

    def __init__(
        self, view: LiveWorkerView, clock: Clock, weights: MoEWeights = DEFAULT_WEIGHTS
    ) -> None:
        self._clock = clock
        self.weights = weights
        self._reports: dict[str, _Reported] = {}
        self._lock = threading.Lock()
        view.subscribe(self._on_event)
        for info in view.workers():
            self.note(info)

    @classmethod
    def of(cls, view: LiveWorkerView, clock: Clock) -> ExpertRegistry:
        """The registry of ``view`` (made on first use)."""
        with _BY_VIEW_LOCK:
            found = _BY_VIEW.get(view)
            if found is None:
                found = _BY_VIEW[view] = cls(view, clock)
            return found

    # -- updates -----------------------------------------------------------------------

    def _on_event(self, event: RegistryEvent) -> None:
        if event.kind == "leave":
            with self._lock:
                self._reports.pop(event.worker_id, None)
        elif event.info is not None:
            self.note(event.info)

    def note(self, info: WorkerInfo) -> None:
        """Take ``info``'s report; its time is now unless it is the same report again."""
        report = info.experts
        with self._lock:
            if report is None:
                self._reports.pop(info.worker_id, None)
                return
            known = self._reports.get(info.worker_id)
            if known is not None and known.report.sequence == report.sequence:
                self._reports[info.worker_id] = _Reported(info, report, known.received_at)
                return
            self._reports[info.worker_id] = _Reported(info, report, self._clock.now())

    # -- reads -------------------------------------------------------------------------

    def _fresh(self) -> list[_Reported]:
        now = self._clock.now()
        with self._lock:
            reports = list(self._reports.values())
        return [r for r in reports if now - r.received_at <= self.weights.stale_after_s]

    @property
    def is_moe(self) -> bool:
        """Whether any worker reports experts now (the model is then MoE)."""
        return any(r.report.stats for r in self._fresh())

    def model_shape(self) -> tuple[int, int, int] | None:
        """``(experts_per_token, moe_layers, hidden_size)`` from the freshest report."""
        fresh = self._fresh()
        if not fresh:
            return None
        report = max(fresh, key=lambda r: r.received_at).report
        return report.experts_per_token, report.moe_layers, report.hidden_size

    def replicas(
        self,
        expert: int | None = None,
        domain: str | None = None,
        worker: str | None = None,
        layer: int | None = None,
    ) -> list[ExpertReplica]:
        """The fresh replicas, optionally of one expert (and layer), domain or worker;
        by layer, expert, then worker id."""
        out: list[ExpertReplica] = []
        for r in self._fresh():
            info = r.info
            if worker is not None and info.worker_id != worker:
                continue
            if domain is not None and info.nvlink_domain != domain:
                continue
            out.extend(
                _replica(info, s, r.received_at)
                for s in r.report.stats
                if (expert is None or s.expert == expert) and (layer is None or s.layer == layer)
            )
        out.sort(key=lambda x: (x.layer, x.expert, x.worker_id))
        return out

    def snapshot(self) -> ExpertSnapshot:
        """Every fresh replica, stragglers flagged, at the clock's time."""
        return ExpertSnapshot.build(self.replicas(), self._clock.now(), self.weights)

    def describe(
        self, expert: int | None = None, domain: str | None = None, worker: str | None = None
    ) -> dict[str, object]:
        """``GET /v1/experts``: the matching replicas with load factor and straggler flag."""
        snapshot = self.snapshot()
        chosen = self.replicas(expert, domain, worker)
        return {
            "experts": [
                {
                    "layer": r.layer,
                    "expert": r.expert,
                    "worker": r.worker_id,
                    "domain": r.domain,
                    "rate": r.rate,
                    "compute_s": r.compute_s,
                    "network_s": r.network_s,
                    "queue_depth": r.queue_depth,
                    "healthy": r.healthy,
                    "age_s": self._clock.now() - r.updated_at,
                    "load_factor": snapshot.load_factor(r),
                    "straggler": snapshot.is_straggler(r),
                }
                for r in chosen
            ],
            "workers": sorted({r.worker_id for r in chosen}),
            "domains": sorted({r.domain for r in chosen if r.domain is not None}),
            "stragglers": sorted(snapshot.straggler_workers),
            "baseline_compute_s": snapshot.baseline_compute_s,
            "stale_after_s": self.weights.stale_after_s,
        }


def _replica(info: WorkerInfo, stat: ExpertStat, received_at: float) -> ExpertReplica:
    return ExpertReplica(
        layer=stat.layer,
        expert=stat.expert,
        worker_id=info.worker_id,
        domain=info.nvlink_domain,
        endpoint=Endpoint(info.node, info.gpus[0] if info.gpus else 0),
        rate=stat.rate,
        compute_s=stat.compute_s,
        network_s=stat.network_s,
        queue_depth=stat.queue_depth,
        updated_at=received_at,
        healthy=stat.healthy,
    )
