"""The KV relay orchestrator: prefill -> transfer -> decode, reliably.

Lifecycle of one request (see ``docs/orchestrator.md`` and :mod:`topkv.relay.transfers`)::

    submit()  -> queued      the prefill worker is free at once; its KV stays owned by it
    dispatch  -> planned     RoutingPolicy picks the decode worker (healthy, free slot,
                             cheapest transfer, then least loaded); the selection policy
                             ranks the transports (CostPolicy by default)
    attempt   -> running     the executor moves the bytes over the chosen transport
    ack       -> verifying   the destination holds a copy; its digest must equal the source's
    handoff   -> delivered   completion queued for decode, then the source releases its KV

Failures: a checksum failure or a timeout retries the same path (``max_retries`` times,
exponential backoff from ``backoff_s``); a transport failure fails over to the next
transport of the selection's ranked list; a destination that died (registry leave, or a
dead peer the executor's probe confirms) is rerouted to another decode worker; when all of
that is exhausted the transfer fails cleanly with its reason, or is handed back for
recompute (``on_exhausted="recompute"``). Every resource is released on every path: the
source's KV, the destination's copy, the decode slot and the concurrency slot.

Concurrency: at most ``max_in_flight`` transfers hold a slot; ``submit`` beyond that queues
up to ``queue_size`` (then awaits space, or raises :class:`QueueFull` when non-blocking).
Every terminal outcome is put on a completion queue of ``completion_queue_size``.

Split by concern: :mod:`~topkv.relay.orchestrator_config` (limits, timeouts, retries),
:mod:`~topkv.relay.routing` (decode worker and transports) over
:mod:`~topkv.relay.slots` (decode slots), :mod:`~topkv.relay.attempts.loop` (the attempt loop),
:mod:`~topkv.relay.attempts.handoff` (deferred digest, verification, handoff, cleanup),
:mod:`~topkv.relay.attempts.calls` (bounded executor calls) and
:mod:`~topkv.relay.completions` (the completion queue).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from topkv.errors import ConfigError, TopKVError
from topkv.policy.clock import Clock, MonotonicClock
from topkv.policy.route import RoutingPolicy
from topkv.policy.select import CostPolicy, TransportSelector
from topkv.policy.view import LinkLoadTracker
from topkv.relay.attempts.calls import ExecutorCalls
from topkv.relay.attempts.handoff import Handoff
from topkv.relay.attempts.loop import AttemptLoop, Sleep
from topkv.relay.completions import Completion, CompletionQueue
from topkv.relay.context import RelayContext
from topkv.relay.executor import TransferExecutor
from topkv.relay.liveview import LiveWorkerView
from topkv.relay.metrics import RelayMetrics
from topkv.relay.orchestrator_config import OrchestratorConfig
from topkv.relay.pairs import CachingSelector, PairViewCache
from topkv.relay.registry.memory import WorkerRegistry
from topkv.relay.routing import DecodeRouter, WorkerPairView
from topkv.relay.runs import TransferRun
from topkv.relay.slots import DecodeSlots
from topkv.relay.transfers import (
    FailureKind,
    Outcome,
    TransferRecord,
    TransferState,
    TransferTable,
    UnknownRequest,
)
from topkv.relay.workers import RegistryEvent
from topkv.transport.base import KVLayout


class QueueFull(TopKVError):
    """The submission queue is full (non-blocking submit, or the wait timed out)."""


class UnknownWorker(TopKVError):
    """The named worker is not registered (or not with the expected role)."""


class OrchestratorClosed(TopKVError):
    """The orchestrator is not running (not started yet, or closed)."""


class Orchestrator:
    """Asyncio KV relay orchestrator. Use as ``async with Orchestrator(...) as orch:``."""

    def __init__(
        self,
        registry: WorkerRegistry,
        executor: TransferExecutor,
        *,
        config: OrchestratorConfig | None = None,
        selector: TransportSelector | None = None,
        routing: RoutingPolicy | None = None,
        pair_view: WorkerPairView | None = None,
        clock: Clock | None = None,
        sleep: Sleep | None = None,
        metrics: RelayMetrics | None = None,
    ) -> None:
        """
        Args:
            registry: where workers register; the orchestrator watches it.
            executor: moves the bytes (in process, or through worker services).
            config: limits, retries and timeouts (defaults: 100 in flight, 2 retries from
                100 ms, completion queue 1000).
            selector: the transport selection policy (default :class:`CostPolicy`).
            routing: the decode routing policy (default :class:`RoutingPolicy`).
            pair_view: paths between two workers (default: from their registrations); it
                must depend on the two registrations alone, since routing reuses its
                answers until the registry changes.
            clock: time for records and latencies (default monotonic).
            sleep: awaited for retry backoff (inject an instant one in tests).
            metrics: where to count (default: a fresh registry of its own).
        """
        self.config = config or OrchestratorConfig()
        self.executor = executor
        # The default policy is pure and uses nominal figures, so its answers are memoised.
        self.selector: TransportSelector = selector or CachingSelector(CostPolicy())
        self.routing = routing or RoutingPolicy()
        self.clock: Clock = clock or MonotonicClock()
        self.metrics = metrics or RelayMetrics()
        self.metrics.track(
            lambda: self._in_flight, lambda: self._queue.qsize() if self._queue else 0
        )
        self.view = LiveWorkerView(registry)
        self.view.subscribe(self._on_worker_event)
        self.transfers = TransferTable(self.config.history)
        self._runs: dict[int, TransferRun] = {}
        self._queue: asyncio.Queue[TransferRecord] | None = None
        self._completions = CompletionQueue(
            self.config.completion_queue_size, self.config.completion_put_timeout_s
        )
        self._dispatchers: list[asyncio.Task[None]] = []
        self._slots = DecodeSlots(self.view)
        load = LinkLoadTracker()
        context = RelayContext(
            executor,
            self.config,
            self.view,
            self.transfers,
            self._slots,
            self._completions,
            self.metrics,
            self.clock,
        )
        self._router = DecodeRouter(
            context,
            selector=self.selector,
            routing=self.routing,
            pair_view=pair_view or PairViewCache(),
            load=load,
        )
        calls = ExecutorCalls(context)
        self._handoff = Handoff(context, calls)
        self._attempts = AttemptLoop(
            context, self._router, self._handoff, calls, load, sleep or asyncio.sleep
        )
        self._in_flight = 0
        self.max_in_flight_seen = 0
        self._running = False

    @property
    def completions_dropped(self) -> int:
        """Completions dropped because the queue stayed full."""
        return self._completions.dropped

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Rebuild the worker view from the registry, then start dispatching."""
        if self._running:
            return
        self._queue = asyncio.Queue(self.config.queue_size)
        self._completions.open()
        self._slots.open()
        await self.view.start()
        self._running = True
        self._dispatchers = [
            asyncio.create_task(self._dispatch_loop(), name=f"topkv-dispatch-{i}")
            for i in range(self.config.max_in_flight)
        ]

    async def close(self) -> None:
        """Cancel every transfer (releasing all resources) and stop."""
        if not self._running:
            return
        self._running = False
        queue = self._queue
        assert queue is not None
        while not queue.empty():
            record = queue.get_nowait()
            await self._finish_unstarted(record, "orchestrator closed")
        self._completions.closing = True
        for run in list(self._runs.values()):
            run.aborted = True
            if run.task is not None:
                run.task.cancel()
        pending = [r.task for r in self._runs.values() if r.task is not None]
        if pending:
            await asyncio.wait(pending, timeout=self.config.cancel_grace_s * 2)
        for task in self._dispatchers:
            task.cancel()
        await asyncio.gather(*self._dispatchers, return_exceptions=True)
        self._dispatchers = []
        self.view.stop()

    async def __aenter__(self) -> Orchestrator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- public API ------------------------------------------------------------------------

    async def submit(
        self,
        request_id: int,
        model_id: str,
        layout: KVLayout,
        source: str,
        *,
        block: bool = True,
        timeout_s: float | None = None,
        source_digest: int | None = None,
        defer_digest: bool = False,
        manual_override: str | None = None,
    ) -> TransferRecord:
        """Accept a prefilled request's KV for transfer; returns once it is queued.

        The prefill worker is free as soon as this returns (``handed_off_at``); it keeps
        owning the KV until a destination acknowledged a verified copy. With ``block``
        the call awaits queue space (at most ``timeout_s``, default
        ``config.submit_timeout_s``) and then raises :class:`QueueFull`; without it a full
        queue raises :class:`QueueFull` at once. ``source_digest``: the KV's
        :func:`~topkv.relay.executor.kv_digest` if the caller has it (else the executor
        is asked before routing).

        ``defer_digest``: the source is still *producing* the KV (prefill publishing layer
        by layer). Routing, transport selection and the first attempt start at once, so
        each layer can go out as it is computed; the executor's ``source_digest`` is
        awaited only when a copy has landed (after the last layer), and compared as
        usual. Retries, failovers and reroutes are unchanged: each attempt re-sends from
        the layers the source holds (and those it has yet to produce).
        ``manual_override`` forces a transport (Algorithm 1's override).
        """
        queue = self._require_running()
        info = self.view.get(source)
        if info is None or info.role != "prefill":
            raise UnknownWorker(f"{source!r} is not a registered prefill worker")
        if layout.total_bytes <= 0:
            raise ConfigError(f"request {request_id}: the KV layout holds no bytes")
        record = TransferRecord(
            request_id=request_id,
            model_id=model_id,
            layout=layout,
            source=source,
            submitted_at=self.clock.now(),
            source_digest=source_digest,
            digest_deferred=defer_digest and source_digest is None,
            manual_override=manual_override,
        )
        self.transfers.add(record)  # raises DuplicateRequest
        try:
            if block and queue.full():
                wait = self.config.submit_timeout_s if timeout_s is None else timeout_s
                try:
                    await asyncio.wait_for(queue.put(record), wait)
                except TimeoutError:
                    raise QueueFull(
                        f"submission queue full ({self.config.queue_size}) for {wait} s"
                    ) from None
            else:
                try:
                    queue.put_nowait(record)
                except asyncio.QueueFull:
                    raise QueueFull(
                        f"submission queue full ({self.config.queue_size} waiting, "
                        f"{self._in_flight} in flight); retry later"
                    ) from None
        except BaseException:
            self.transfers.move(record, TransferState.CANCELLED)
            record.outcome = Outcome.CANCELLED
            record.reason = "not accepted"
            raise
        record.handed_off_at = self.clock.now()
        return record

    def status(self) -> dict[str, object]:
        """Counts, limits and workers: a JSON-ready snapshot."""
        queued = self._queue.qsize() if self._queue is not None else 0
        return {
            "running": self._running,
            "in_flight": self._in_flight,
            "queued": queued,
            "max_in_flight": self.config.max_in_flight,
            "max_in_flight_seen": self.max_in_flight_seen,
            "completions_waiting": self._completions.waiting(),
            "completions_dropped": self.completions_dropped,
            "transfers": self.transfers.counts(),
            "workers": [
                {
                    **w.model_dump(mode="json"),
                    "slots_used": self._slots.used_by(w.worker_id),
                }
                for w in self.view.workers()
            ],
        }

    def transfer(self, request_id: int) -> TransferRecord:
        """The record of ``request_id`` (raises :class:`UnknownRequest`)."""
        return self.transfers.require(request_id)

    def query(
        self,
        state: TransferState | str | None = None,
        worker: str | None = None,
        limit: int | None = None,
    ) -> list[TransferRecord]:
        """Transfers (active first, then recent history), filtered by state and worker."""
        wanted = TransferState(state) if isinstance(state, str) else state
        return self.transfers.query(wanted, worker, limit)

    async def abort(self, request_id: int) -> TransferRecord:
        """Cancel ``request_id`` wherever it is; every resource on both sides is released.

        Returns the record once it is terminal (a finished transfer is returned as is).
        """
        record = self.transfers.require(request_id)
        if record.terminal:
            return record
        run = self._runs.get(request_id)
        if run is None or run.task is None:
            # Still queued: the dispatcher will skip it.
            await self._finish_unstarted(record, "aborted")
            return record
        run.aborted = True
        if run.task is not None:
            run.task.cancel()
            await asyncio.wait([run.task], timeout=self.config.cancel_grace_s * 2)
        return record

    async def wait(self, request_id: int, timeout_s: float) -> TransferRecord:
        """Await the end of ``request_id`` (raises ``TimeoutError`` after ``timeout_s``)."""
        record = self.transfers.require(request_id)
        if record.terminal:
            return record
        run = self._runs.setdefault(request_id, TransferRun())
        if run.done is None:
            run.done = asyncio.get_running_loop().create_future()
        await asyncio.wait_for(asyncio.shield(run.done), timeout_s)
        return record

    async def next_completion(self, timeout_s: float) -> Completion:
        """The next finished transfer (raises ``TimeoutError`` after ``timeout_s``)."""
        completions = self._completions.queue
        if completions is None:
            raise OrchestratorClosed("the orchestrator was never started")
        if not completions.empty():
            return completions.get_nowait()
        return await asyncio.wait_for(completions.get(), timeout_s)

    def completion_nowait(self) -> Completion | None:
        """The next finished transfer if one is waiting, else None."""
        return self._completions.nowait()

    async def completions(self, idle_timeout_s: float) -> AsyncIterator[Completion]:
        """Iterate over completions until none arrives for ``idle_timeout_s``."""
        while True:
            try:
                yield await self.next_completion(idle_timeout_s)
            except TimeoutError:
                return

    def release_decode_slot(self, request_id: int) -> None:
        """Decode finished with ``request_id``'s KV: its slot on the decode worker is free."""
        if self._slots.release_delivered(request_id):
            return
        record = self.transfers.get(request_id)
        if record is None or record.state != TransferState.DELIVERED:
            raise UnknownRequest(f"request {request_id} holds no decode slot")
        # Delivered to a worker that has died since: its slots went with it.

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def slots_used(self, worker_id: str) -> int:
        return self._slots.used_by(worker_id)

    def delivered_to(self, worker_id: str) -> int:
        """Delivered KV ``worker_id`` holds for decode (its running decode sequences)."""
        return sum(1 for w in self._slots.delivered.values() if w == worker_id)

    def fence(self, worker_id: str, closed: bool = True) -> None:
        """Route no new KV to decode worker ``worker_id`` (``closed`` false: open it again);
        what is already in flight to it carries on. The ADP fences a worker it converts."""
        if closed:
            self._slots.closed.add(worker_id)
        else:
            self._slots.closed.discard(worker_id)
        self._slots.refresh(worker_id)
        self._slots.signal_capacity()

    # -- dispatch --------------------------------------------------------------------------

    def _require_running(self) -> asyncio.Queue[TransferRecord]:
        if not self._running or self._queue is None:
            raise OrchestratorClosed("the orchestrator is not running; call start() first")
        return self._queue

    async def _dispatch_loop(self) -> None:
        queue = self._queue
        assert queue is not None
        while True:
            record = await queue.get()
            if record.terminal:
                continue
            run = self._runs.setdefault(record.request_id, TransferRun())
            task = asyncio.current_task()
            assert task is not None
            run.task = task
            self._in_flight += 1
            if self._in_flight > self.max_in_flight_seen:
                self.max_in_flight_seen = self._in_flight
            try:
                await self._attempts.run_transfer(record, run)
            except asyncio.CancelledError:
                if self._completions.closing and not record.terminal:
                    raise
                if not run.aborted:
                    raise
                task.uncancel()
            finally:
                self._in_flight -= 1
                self._runs.pop(record.request_id, None)
                if run.done is not None and not run.done.done():
                    run.done.set_result(None)

    async def _finish_unstarted(self, record: TransferRecord, reason: str) -> None:
        run = self._runs.pop(record.request_id, None)
        await self._handoff.cleanup(
            record, run or TransferRun(), Outcome.CANCELLED, FailureKind.CANCELLED, reason
        )
        if run is not None and run.done is not None and not run.done.done():
            run.done.set_result(None)

    # -- registry events -----------------------------------------------------------------

    def _on_worker_event(self, event: RegistryEvent) -> None:
        self._router.registry_changed()
        self._slots.refresh(event.worker_id)
        if event.kind == "leave":
            for run in self._runs.values():
                record_destination = run.slot_holder
                if record_destination == event.worker_id:
                    run.destination_left = True
                    if run.in_attempt and not run.interrupted and run.task is not None:
                        run.interrupted = True
                        run.task.cancel()
            # Delivered KV held by a dead decode worker is gone with it: free the slots.
            self._slots.left(event.worker_id)
        self._slots.signal_capacity()
