"""Starting a request's prefill on a healthy prefill worker, with failover.

The orchestrator picks a request's prefill worker itself (round robin over the prefill pool,
or the ADP's). A worker that fails the prefill start (an error, a timeout, a connection it
drops, bytes that are not HTTP) or answers it with nonsense (not a summary of this request's
KV) is *benched*: skipped for a cool-down that doubles with each consecutive failure
(:attr:`PrefillHealth.base_s` up to :attr:`PrefillHealth.max_s`), and the request is started
on the next healthy prefill worker. A worker's ``400`` is the request's fault and is answered
as such; a full worker (``capacity``) is passed over for that request but not benched.

A client sees a specific error only when no healthy prefill worker is left: 503
``no_healthy_prefill_worker`` when every registered one is benched, 503
``no_prefill_capacity`` when each one tried is full, 502 ``bad_prefill_worker`` when each
one tried failed. Metrics:
``topkv_prefill_start_failures_total{kind}`` and ``topkv_prefill_workers_benched``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from topkv.errors import TopKVError
from topkv.relay.executor import AttemptFailed
from topkv.relay.orchestrator import UnknownWorker
from topkv.relay.transfers import FailureKind
from topkv.relay.workers import WorkerInfo
from topkv.service.messages import KVSummary, PrefillRequest
from topkv.service.orchestrator.executor import RemoteExecutor

log = logging.getLogger(__name__)

#: Prefill workers one request is started on at most before it gets a 502.
MAX_PREFILL_TRIES = 8

#: Workers whose failures are remembered (the oldest record is dropped beyond it).
_REMEMBERED_WORKERS = 4096


class PrefillUnavailable(TopKVError):
    """No healthy prefill worker could start a request: ``status`` 502 or 503, ``kind``
    names why."""

    def __init__(self, status: int, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.kind = kind


@dataclass
class _Strikes:
    failures: int
    benched_until: float
    reason: str


class PrefillHealth:
    """Which prefill workers are benched after failing a prefill start (bounded table)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        clock: Callable[[], float] = time.monotonic,
        base_s: float = 5.0,
        max_s: float = 300.0,
    ) -> None:
        self.clock = clock
        self.base_s = base_s
        self.max_s = max_s
        self._strikes: OrderedDict[str, _Strikes] = OrderedDict()
        self.failures = Counter(
            "topkv_prefill_start_failures",
            "Prefill starts a worker failed or answered with nonsense, by failure kind",
            ["kind"],
            registry=registry,
        )
        benched = Gauge(
            "topkv_prefill_workers_benched",
            "Prefill workers skipped for a cool-down after failing a prefill start",
            registry=registry,
        )
        benched.set_function(lambda: len(self.benched_workers()))

    def benched(self, worker_id: str) -> bool:
        strikes = self._strikes.get(worker_id)
        return strikes is not None and strikes.benched_until > self.clock()

    def benched_workers(self) -> dict[str, str]:
        """Each benched worker's last failure."""
        now = self.clock()
        return {w: s.reason for w, s in self._strikes.items() if s.benched_until > now}

    def failed(self, worker_id: str, kind: FailureKind, reason: str) -> None:
        """Bench ``worker_id``: ``base_s`` after a first failure, twice as long after each
        further one in a row, at most ``max_s``."""
        self.failures.labels(kind.value).inc()
        strikes = self._strikes.pop(worker_id, None)
        count = 1 if strikes is None else strikes.failures + 1
        cool_down = min(self.max_s, self.base_s * 2 ** min(count - 1, 30))
        self._strikes[worker_id] = _Strikes(count, self.clock() + cool_down, reason)
        while len(self._strikes) > _REMEMBERED_WORKERS:
            self._strikes.popitem(last=False)
        log.warning("prefill worker %s benched for %.0f s: %s", worker_id, cool_down, reason)

    def succeeded(self, worker_id: str) -> None:
        self._strikes.pop(worker_id, None)


class PrefillStarter:
    """Starts a request's prefill on a healthy prefill worker, failing over to the next."""

    def __init__(
        self,
        executor: RemoteExecutor,
        health: PrefillHealth,
        pool: Callable[[], list[WorkerInfo]],
    ) -> None:
        """``pool``: the prefill workers serving now."""
        self.executor = executor
        self.health = health
        self.pool = pool
        self._round_robin = itertools.count()
        self._drops: set[asyncio.Task[None]] = set()

    def candidates(self) -> list[WorkerInfo]:
        """The healthy prefill workers, from the next in round-robin order; UnknownWorker
        when none is registered, :class:`PrefillUnavailable` (503) when all are benched."""
        workers = self.pool()
        if not workers:
            raise UnknownWorker("no prefill worker is registered")
        first = next(self._round_robin) % len(workers)
        rotated = workers[first:] + workers[:first]
        healthy = [w for w in rotated if not self.health.benched(w.worker_id)]
        if not healthy:
            benched = self.health.benched_workers()
            why = "; ".join(f"{w.worker_id}: {benched.get(w.worker_id, '?')}" for w in workers)
            raise PrefillUnavailable(
                503,
                "no_healthy_prefill_worker",
                f"every prefill worker is benched after failing a prefill start ({why})",
            )
        return healthy

    async def start(
        self, request_id: int, body: PrefillRequest, chosen: WorkerInfo | None = None
    ) -> tuple[WorkerInfo, KVSummary]:
        """Start ``body`` on ``chosen``, or on the healthy prefill workers one after another
        until one starts it; the worker and its answer. A worker's refusal (400) raises
        ConfigError at once; :class:`PrefillUnavailable` (502) when every one tried failed."""
        workers = [chosen] if chosen is not None else self.candidates()[:MAX_PREFILL_TRIES]
        failures: list[str] = []
        full = 0
        for worker in workers:
            try:
                held = await self.executor.prefill(worker, request_id, body)
                _check_answer(worker, request_id, body, held)
            except AttemptFailed as exc:
                failures.append(str(exc))
                if exc.kind == FailureKind.NO_DESTINATION:  # full: busy, not bad
                    full += 1
                else:
                    self.health.failed(worker.worker_id, exc.kind, str(exc))
                self._drop_later(worker, request_id)
                continue
            self.health.succeeded(worker.worker_id)
            return worker, held
        every = "the prefill worker" if len(workers) == 1 else f"all {len(workers)} tried"
        if full == len(workers):
            raise PrefillUnavailable(
                503, "no_prefill_capacity", f"{every} is full: {'; '.join(failures)}"
            )
        raise PrefillUnavailable(
            502, "bad_prefill_worker", f"{every} failed the prefill start: {'; '.join(failures)}"
        )

    def _drop_later(self, worker: WorkerInfo, request_id: int) -> None:
        """Drop whatever a failed start left on ``worker``, without holding the request."""
        task = asyncio.create_task(self.executor.release_source(worker, request_id))
        self._drops.add(task)
        task.add_done_callback(self._drops.discard)

    async def close(self) -> None:
        for task in list(self._drops):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._drops, return_exceptions=True)


def _check_answer(
    worker: WorkerInfo, request_id: int, body: PrefillRequest, held: KVSummary
) -> None:
    """A start's answer must summarise this request's KV of the model asked for."""
    if held.request_id != request_id or (body.model_id and held.model_id != body.model_id):
        raise AttemptFailed(
            FailureKind.SOURCE_LOST,
            f"{worker.worker_id} answered the prefill start of request {request_id} with "
            f"nonsense: a summary of request {held.request_id}, model {held.model_id[:100]!r}",
        )
