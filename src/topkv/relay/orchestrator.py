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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator
from dataclasses import dataclass, field
from types import CoroutineType
from typing import Any, Generic, Literal, TypeVar, cast

from topkv.errors import ConfigError, TopKVError
from topkv.policy.clock import Clock, MonotonicClock
from topkv.policy.errors import PolicyError
from topkv.policy.route import DecodeWorkerView, RouteDecision, RouteScore, RoutingPolicy
from topkv.policy.select import CostPolicy, Selection, TransportSelector
from topkv.policy.view import Endpoint, LinkLoad, LinkLoadTracker, PairView, TransferRequest
from topkv.relay.executor import (
    AttemptFailed,
    AttemptPlan,
    Delivery,
    TransferExecutor,
    classify_failure,
)
from topkv.relay.liveview import LiveWorkerView
from topkv.relay.metrics import RelayMetrics
from topkv.relay.pairs import CachingSelector, PairViewCache, endpoint_of
from topkv.relay.registry import WorkerRegistry
from topkv.relay.transfers import (
    AttemptRecord,
    FailureKind,
    Outcome,
    TransferRecord,
    TransferState,
    TransferTable,
    UnknownRequest,
)
from topkv.relay.workers import RegistryEvent, WorkerInfo
from topkv.transport.base import KVLayout

log = logging.getLogger(__name__)

Sleep = Callable[[float], Awaitable[None]]
T = TypeVar("T")
WorkerPairView = Callable[[WorkerInfo, WorkerInfo], PairView]


class QueueFull(TopKVError):
    """The submission queue is full (non-blocking submit, or the wait timed out)."""


class UnknownWorker(TopKVError):
    """The named worker is not registered (or not with the expected role)."""


class OrchestratorClosed(TopKVError):
    """The orchestrator is not running (not started yet, or closed)."""


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try before giving up on one request.

    ``max_retries`` retries of the same (destination, transport) after a checksum failure
    or a timeout, waiting ``backoff_s * backoff_factor**(n-1)`` before retry ``n``; then
    the next transport. ``max_reroutes`` other decode workers after a destination died (or
    every transport to it failed).
    """

    max_retries: int = 2
    backoff_s: float = 0.1
    backoff_factor: float = 2.0
    max_reroutes: int = 2

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.max_reroutes < 0:
            raise ConfigError("max_retries and max_reroutes must be >= 0")
        if self.backoff_s < 0 or self.backoff_factor < 1:
            raise ConfigError("backoff_s must be >= 0 and backoff_factor >= 1")

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1-based)."""
        return self.backoff_s * self.backoff_factor ** (retry - 1)


@dataclass(frozen=True)
class OrchestratorConfig:
    """Limits and timeouts. Every wait the orchestrator does is bounded by one of these."""

    max_in_flight: int = 100
    queue_size: int = 1000
    completion_queue_size: int = 1000
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    attempt_timeout_s: float = 30.0
    cancel_grace_s: float = 5.0
    executor_call_timeout_s: float = 10.0
    route_wait_s: float = 5.0
    submit_timeout_s: float = 30.0
    completion_put_timeout_s: float = 30.0
    on_exhausted: Literal["fail", "recompute"] = "fail"
    chunks_per_layer: int = 1
    history: int = 10_000

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.queue_size < 1 or self.completion_queue_size < 1:
            raise ConfigError("queue sizes must be >= 1")
        if self.on_exhausted not in ("fail", "recompute"):
            raise ConfigError(
                f"on_exhausted must be 'fail' or 'recompute', not {self.on_exhausted!r}"
            )
        timeouts = (
            self.attempt_timeout_s,
            self.cancel_grace_s,
            self.executor_call_timeout_s,
            self.route_wait_s,
            self.submit_timeout_s,
            self.completion_put_timeout_s,
        )
        if any(not t > 0 for t in timeouts):
            raise ConfigError("every timeout must be > 0 s")
        if self.chunks_per_layer < 1:
            raise ConfigError("chunks_per_layer must be >= 1")


@dataclass(frozen=True)
class Completion:
    """A finished transfer, as put on the completion queue.

    ``outcome == DELIVERED``: the verified KV is held by ``destination`` for decode to take
    (then call :meth:`Orchestrator.release_decode_slot`). ``RECOMPUTE``: prefill must run
    again. ``FAILED``/``CANCELLED``: ``reason`` says why.
    """

    request_id: int
    model_id: str
    outcome: Outcome
    source: str
    destination: str | None
    transport: str | None
    medium: str
    size_bytes: int
    failure: FailureKind | None
    reason: str
    handoff_seconds: float


class _Run:
    """Runtime handles of one dispatched transfer (cancellation and bookkeeping)."""

    __slots__ = (
        "aborted",
        "destination_left",
        "done",
        "flow",
        "in_attempt",
        "interrupted",
        "slot_holder",
        "task",
    )

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None
        self.in_attempt = False
        self.interrupted = False
        self.destination_left = False
        self.aborted = False
        self.slot_holder: str | None = None
        self.flow: tuple[tuple[str, ...], int] | None = None
        self.done: asyncio.Future[None] | None = None


async def _bounded(call: Awaitable[T], timeout_s: float) -> T:
    """``await call`` within ``timeout_s`` (``TimeoutError`` after), arming no timer when
    the call finishes without waiting.

    A coroutine is run up to its first suspension on the spot; only if it suspends does
    the rest run under ``asyncio.timeout``. The bound therefore covers the time the call
    spends waiting, which is all an event loop can interrupt anyway. Executor calls such as
    releasing a source often complete at once, and a timer costs more than they do.
    """
    if type(call) is not CoroutineType:
        async with asyncio.timeout(timeout_s):
            return await call
    coro = cast("Coroutine[Any, Any, T]", call)
    try:
        first = coro.send(None)
    except StopIteration as done:
        return cast("T", done.value)
    async with asyncio.timeout(timeout_s):
        return await _Resumed(coro, first)


class _Resumed(Generic[T]):
    """Awaits the rest of a coroutine already run to its first suspension point.

    Passes what the coroutine yields (the future it waits on) up to the task, and what the
    task sends or throws in (resumption, cancellation) down to the coroutine, as an
    ``await`` of it would have.
    """

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, Any, T], first: Any) -> None:
        self._coro = coro
        self._first = first

    def __await__(self) -> Generator[Any, None, T]:
        coro, pending = self._coro, self._first
        while True:
            try:
                yield pending
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as error:  # cancellation (or anything) thrown in
                try:
                    pending = coro.throw(error)
                except StopIteration as done:
                    return cast("T", done.value)
            else:
                try:
                    pending = coro.send(None)
                except StopIteration as done:
                    return cast("T", done.value)


class _Exhausted(Exception):
    def __init__(self, kind: FailureKind, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


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
        self._sleep: Sleep = sleep or asyncio.sleep
        self._pair_view: WorkerPairView = pair_view or PairViewCache()
        self.view = LiveWorkerView(registry)
        self.view.subscribe(self._on_worker_event)
        self.transfers = TransferTable(self.config.history)
        self._runs: dict[int, _Run] = {}
        self._queue: asyncio.Queue[TransferRecord] | None = None
        self._completions: asyncio.Queue[Completion] | None = None
        self._dispatchers: list[asyncio.Task[None]] = []
        self._slots_used: dict[str, int] = {}
        self._slot_of: dict[int, str] = {}
        self._capacity_changed: asyncio.Event | None = None
        # Live per-link load, kept as counters; the immutable snapshot the policies read
        # is built only when routing needs it and something changed since the last one.
        self._load = LinkLoadTracker()
        # Decode workers as routing sees them, kept current on slot and registry changes.
        self._decode_views: dict[str, DecodeWorkerView] = {}
        # Routing costs per (source, request), reused while the source's registration, the
        # registry version and the load snapshot stay the same. Only when the selection
        # policy is declared pure (CachingSelector) and the routing rule is the stock one.
        self._reuse_scores = isinstance(self.selector, CachingSelector) and (
            type(self.routing) is RoutingPolicy
        )
        self._scores: dict[
            tuple[str, TransferRequest], tuple[WorkerInfo, LinkLoad, int, tuple[RouteScore, ...]]
        ] = {}
        self._requests: dict[tuple[int, int, str | None], TransferRequest] = {}
        self._pairs: dict[
            str,
            tuple[WorkerInfo, int, list[tuple[str, Endpoint]], dict[Endpoint, PairView]],
        ] = {}
        self._endpoints: dict[str, tuple[WorkerInfo, Endpoint]] = {}
        self._in_flight = 0
        self.max_in_flight_seen = 0
        self._running = False
        self._closing = False
        self.completions_dropped = 0

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Rebuild the worker view from the registry, then start dispatching."""
        if self._running:
            return
        self._queue = asyncio.Queue(self.config.queue_size)
        self._completions = asyncio.Queue(self.config.completion_queue_size)
        self._capacity_changed = asyncio.Event()
        await self.view.start()
        self._running = True
        self._closing = False
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
        self._closing = True
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
        now = self.clock.now()
        record = TransferRecord(
            request_id=request_id,
            model_id=model_id,
            layout=layout,
            source=source,
            submitted_at=now,
            source_digest=source_digest,
        )
        record.digest_deferred = defer_digest and source_digest is None
        record.manual_override = manual_override
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
            "completions_waiting": self._completions.qsize() if self._completions else 0,
            "completions_dropped": self.completions_dropped,
            "transfers": self.transfers.counts(),
            "workers": [
                {
                    **w.model_dump(mode="json"),
                    "slots_used": self._slots_used.get(w.worker_id, 0),
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
        run = self._runs.setdefault(request_id, _Run())
        if run.done is None:
            run.done = asyncio.get_running_loop().create_future()
        await asyncio.wait_for(asyncio.shield(run.done), timeout_s)
        return record

    async def next_completion(self, timeout_s: float) -> Completion:
        """The next finished transfer (raises ``TimeoutError`` after ``timeout_s``)."""
        completions = self._completions
        if completions is None:
            raise OrchestratorClosed("the orchestrator was never started")
        if not completions.empty():
            return completions.get_nowait()
        return await asyncio.wait_for(completions.get(), timeout_s)

    def completion_nowait(self) -> Completion | None:
        """The next finished transfer if one is waiting, else None."""
        if self._completions is None or self._completions.empty():
            return None
        return self._completions.get_nowait()

    async def completions(self, idle_timeout_s: float) -> AsyncIterator[Completion]:
        """Iterate over completions until none arrives for ``idle_timeout_s``."""
        while True:
            try:
                yield await self.next_completion(idle_timeout_s)
            except TimeoutError:
                return

    def release_decode_slot(self, request_id: int) -> None:
        """Decode finished with ``request_id``'s KV: its slot on the decode worker is free."""
        worker = self._slot_of.pop(request_id, None)
        if worker is not None:
            self._free_slot(worker)
            return
        record = self.transfers.get(request_id)
        if record is None or record.state != TransferState.DELIVERED:
            raise UnknownRequest(f"request {request_id} holds no decode slot")
        # Delivered to a worker that has died since: its slots went with it.

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def slots_used(self, worker_id: str) -> int:
        return self._slots_used.get(worker_id, 0)

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
            run = self._runs.setdefault(record.request_id, _Run())
            task = asyncio.current_task()
            assert task is not None
            run.task = task
            self._in_flight += 1
            if self._in_flight > self.max_in_flight_seen:
                self.max_in_flight_seen = self._in_flight
            try:
                await self._run_transfer(record, run)
            except asyncio.CancelledError:
                if self._closing and not record.terminal:
                    raise
                if not run.aborted:
                    raise
                task.uncancel()
            finally:
                self._in_flight -= 1
                self._runs.pop(record.request_id, None)
                if run.done is not None and not run.done.done():
                    run.done.set_result(None)

    async def _run_transfer(self, record: TransferRecord, run: _Run) -> None:
        try:
            await self._attempt_until_done(record, run)
        except asyncio.CancelledError:
            await asyncio.shield(self._cleanup(record, run, Outcome.CANCELLED, None, "aborted"))
            raise
        except _Exhausted as exc:
            outcome = (
                Outcome.RECOMPUTE
                if self.config.on_exhausted == "recompute" or exc.kind == FailureKind.SOURCE_LOST
                else Outcome.FAILED
            )
            await self._cleanup(record, run, outcome, exc.kind, exc.reason)
        except Exception as exc:  # a bug: report it on the record, release everything
            log.exception("transfer %s failed unexpectedly", record.request_id)
            await self._cleanup(record, run, Outcome.FAILED, FailureKind.INTERNAL, repr(exc))

    async def _attempt_until_done(self, record: TransferRecord, run: _Run) -> None:
        source = self.view.get(record.source)
        if source is None:
            raise _Exhausted(FailureKind.SOURCE_LOST, f"source {record.source} left")
        if record.source_digest is None and not record.digest_deferred:
            record.source_digest = await self._executor_call(
                self.executor.source_digest(source, record.request_id, record.layout),
                FailureKind.SOURCE_LOST,
            )
        excluded: set[str] = set()
        retry = self.config.retry
        request = self._request_for(record)
        while True:
            decision = await self._route(record, source, request, excluded)
            destination = self.view.get(decision.worker_id)
            if destination is None:  # left between routing and now
                excluded.add(decision.worker_id)
                self._release_slot_of(record)
                continue
            record.destination = decision.worker_id
            record.policy = decision.selection.policy
            record.rationale = f"{decision.rationale}; {decision.selection.rationale}"
            transports = list(decision.selection.ranked_transports)
            index, retries_here = 0, 0
            rerouting = False
            while not rerouting:
                transport = transports[index]
                record.transport = transport
                run.destination_left = not self.view.alive(destination.worker_id)
                self.transfers.move(record, TransferState.RUNNING)
                failure, detail = await self._one_attempt(
                    record, run, source, destination, transport, decision.selection
                )
                if failure is None:
                    return
                kind = failure
                self.metrics.attempt_failures.labels(kind.value).inc()
                if kind == FailureKind.CHECKSUM:
                    self.metrics.checksum_failures.inc()
                if kind in (FailureKind.TRANSPORT, FailureKind.CANCELLED):
                    alive = await self._destination_alive(destination, run)
                    if not alive:
                        kind = FailureKind.DESTINATION_DIED
                    elif kind == FailureKind.CANCELLED:
                        kind = FailureKind.TRANSPORT
                if kind == FailureKind.SOURCE_LOST:
                    raise _Exhausted(kind, detail)
                if kind == FailureKind.INTERNAL:
                    raise _Exhausted(kind, detail)
                if kind in (FailureKind.CHECKSUM, FailureKind.TIMEOUT):
                    if retries_here < retry.max_retries:
                        retries_here += 1
                        record.retries += 1
                        self.metrics.retries.inc()
                        self.transfers.move(record, TransferState.PLANNED)
                        await self._sleep(retry.delay(retries_here))
                        continue
                    kind = FailureKind.TRANSPORT  # this path keeps failing: next transport
                if kind == FailureKind.TRANSPORT:
                    if index + 1 < len(transports):
                        index += 1
                        retries_here = 0
                        record.failovers += 1
                        self.metrics.failovers.inc()
                        self.transfers.move(record, TransferState.PLANNED)
                        continue
                    detail = f"every transport to {destination.worker_id} failed ({detail})"
                # destination died, or nothing works towards it: another decode worker
                excluded.add(destination.worker_id)
                self._release_slot_of(record)
                if record.reroutes >= retry.max_reroutes:
                    raise _Exhausted(kind, f"{detail}; gave up after {record.reroutes} reroute(s)")
                record.reroutes += 1
                self.metrics.reroutes.inc()
                self.transfers.move(record, TransferState.PLANNED)
                rerouting = True

    async def _route(
        self,
        record: TransferRecord,
        source: WorkerInfo,
        request: TransferRequest,
        excluded: set[str],
    ) -> RouteDecision:
        """Pick the decode worker and reserve one of its slots; waits (bounded) for one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.route_wait_s
        while True:
            decision = self._choose(source, request, excluded)
            if decision is not None:
                self._reserve_slot(record, decision.worker_id)
                if record.state == TransferState.QUEUED:
                    self.transfers.move(record, TransferState.PLANNED)
                return decision
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise _Exhausted(
                    FailureKind.NO_DESTINATION,
                    f"no healthy decode worker with a free slot within "
                    f"{self.config.route_wait_s} s (excluded: {sorted(excluded) or 'none'})",
                )
            event = self._capacity_changed
            assert event is not None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), remaining)

    def _choose(
        self, source: WorkerInfo, request: TransferRequest, excluded: set[str]
    ) -> RouteDecision | None:
        try:
            if self._reuse_scores:
                scores = self._route_scores(source, request)
                return self.routing.choose_scored(
                    scores,
                    self._decode_views,
                    self.selector,
                    request,
                    self._load_snapshot(),
                    excluded,
                )
            by_endpoint = self._decoders_by_endpoint()

            def lookup(_src: Endpoint, dst: Endpoint) -> PairView:
                return self._pair_view(source, by_endpoint[dst])

            return self.routing.choose_decode(
                self._endpoint(source),
                list(self._decode_views.values()),
                lookup,
                request,
                self.selector,
                self._load_snapshot(),
                excluded,
            )
        except PolicyError as exc:
            raise _Exhausted(FailureKind.NO_DESTINATION, f"routing refused: {exc}") from exc

    def _decoders_by_endpoint(self) -> dict[Endpoint, WorkerInfo]:
        return {self._endpoint(info): info for info in self.view.workers("decode")}

    def _route_scores(self, source: WorkerInfo, request: TransferRequest) -> tuple[RouteScore, ...]:
        """Every decode worker's transfer cost from ``source`` (cached, see __init__)."""
        load = self._load_snapshot()
        version = self.view.version
        key = (source.worker_id, request)
        found = self._scores.get(key)
        if found is not None and found[0] is source and found[1] is load and found[2] == version:
            return found[3]
        targets, pairs = self._pairs_from(source, version)
        scores = self.routing.score(
            self._endpoint(source),
            targets,
            lambda _src, dst: pairs[dst],
            request,
            self.selector,
            load,
        )
        if len(self._scores) >= 1024:
            self._scores.clear()
        self._scores[key] = (source, load, version, scores)
        return scores

    def _pairs_from(
        self, source: WorkerInfo, version: int
    ) -> tuple[list[tuple[str, Endpoint]], dict[Endpoint, PairView]]:
        """The decode workers and the pair view to each from ``source`` (cached until the
        registry changes: pair views depend on the registrations alone)."""
        found = self._pairs.get(source.worker_id)
        if found is not None and found[0] is source and found[1] == version:
            return found[2], found[3]
        by_endpoint = self._decoders_by_endpoint()
        targets = [(info.worker_id, endpoint) for endpoint, info in by_endpoint.items()]
        pairs = {endpoint: self._pair_view(source, info) for endpoint, info in by_endpoint.items()}
        if len(self._pairs) >= 1024:
            self._pairs.clear()
        self._pairs[source.worker_id] = (source, version, targets, pairs)
        return targets, pairs

    def _request_for(self, record: TransferRecord) -> TransferRequest:
        """The policies' view of ``record`` (one shared object per distinct request)."""
        key = (
            record.size_bytes,
            record.layout.num_layers * self.config.chunks_per_layer,
            record.manual_override,
        )
        request = self._requests.get(key)
        if request is None:
            if len(self._requests) >= 1024:
                self._requests.clear()
            request = self._requests[key] = TransferRequest(*key)
        return request

    async def _one_attempt(
        self,
        record: TransferRecord,
        run: _Run,
        source: WorkerInfo,
        destination: WorkerInfo,
        transport: str,
        selection: Selection,
    ) -> tuple[FailureKind | None, str]:
        """Run one attempt and, on success, verify and hand off. Returns the failure."""
        number = len(record.attempts) + 1
        started = self.clock.now()
        plan = AttemptPlan(
            request_id=record.request_id,
            model_id=record.model_id,
            layout=record.layout,
            source=source,
            destination=destination,
            transport=transport,
            attempt=number,
            timeout_s=self.config.attempt_timeout_s,
        )
        path = selection.best_path(transport)
        links = path.links if path is not None else ()
        self._add_flow(run, links, record.size_bytes)
        failure: FailureKind | None = None
        delivery: Delivery | None = None
        detail = ""
        task = run.task
        run.in_attempt = True
        try:
            delivery = await _bounded(self.executor.transfer(plan), self.config.attempt_timeout_s)
        except TimeoutError:
            failure = FailureKind.TIMEOUT
            detail = (
                f"attempt {number} over {transport} took over {self.config.attempt_timeout_s} s"
            )
        except asyncio.CancelledError:
            if not run.interrupted or run.aborted or task is None:
                raise
            # The destination left the registry: the leave handler interrupted this attempt.
            task.uncancel()
            failure = FailureKind.DESTINATION_DIED
            detail = f"{destination.worker_id} left the registry during attempt {number}"
        except Exception as error:
            failure = classify_failure(error)
            detail = str(error) or error.__class__.__name__
            if failure == FailureKind.INTERNAL:
                log.error("executor raised unexpectedly: %r", error)
        finally:
            run.in_attempt = False
            run.interrupted = False
            self._remove_flow(run)
        record.attempts.append(
            AttemptRecord(
                number=number,
                destination=destination.worker_id,
                transport=transport,
                started_at=started,
                ended_at=self.clock.now(),
                error=failure,
                detail=detail,
                medium=delivery.medium if delivery is not None else "",
            )
        )
        if delivery is None:
            return failure, detail
        return await self._verify_and_hand_off(record, run, source, destination, delivery)

    async def _verify_and_hand_off(
        self,
        record: TransferRecord,
        run: _Run,
        source: WorkerInfo,
        destination: WorkerInfo,
        delivery: Delivery,
    ) -> tuple[FailureKind | None, str]:
        self.transfers.move(record, TransferState.VERIFYING)
        if record.source_digest is None:
            # Deferred (streaming): the source finished producing the KV by now. Fetched
            # once; a retry compares against the same value. Failing here (source lost,
            # timeout) ends the transfer; cleanup discards the copy (state is verifying).
            record.source_digest = await self._executor_call(
                self.executor.source_digest(source, record.request_id, record.layout),
                FailureKind.SOURCE_LOST,
            )
        if delivery.digest != record.source_digest:
            await self._discard(destination, record.request_id)
            detail = (
                f"destination digest {delivery.digest:#018x} != source digest "
                f"{record.source_digest or 0:#018x}"
            )
            record.attempts[-1] = _with_error(record.attempts[-1], FailureKind.CHECKSUM, detail)
            return FailureKind.CHECKSUM, detail
        if run.destination_left or not self.view.alive(destination.worker_id):
            # Verified, but the destination died before decode could take it; the source
            # still owns the KV, so send it elsewhere.
            await self._discard(destination, record.request_id)
            return FailureKind.DESTINATION_DIED, f"{destination.worker_id} died after the ack"
        record.medium = delivery.medium
        record.emulated = delivery.emulated
        record.transfer_seconds = delivery.seconds
        completion = self._completion(record, Outcome.DELIVERED, None, "")
        completions = self._completions
        assert completions is not None
        # Handoff is one step of the event loop when the queue has room: no registry event
        # can slip between the liveness check above and the completion being visible.
        if completions.full():
            try:
                await asyncio.wait_for(
                    completions.put(completion), self.config.completion_put_timeout_s
                )
            except TimeoutError:
                await self._discard(destination, record.request_id)
                raise _Exhausted(
                    FailureKind.COMPLETION_QUEUE_FULL,
                    f"completion queue stayed full for {self.config.completion_put_timeout_s} s",
                ) from None
            if run.destination_left or not self.view.alive(destination.worker_id):
                await self._discard(destination, record.request_id)
                raise _Exhausted(
                    FailureKind.DESTINATION_DIED,
                    f"{destination.worker_id} died while its completion was queued",
                )
        else:
            completions.put_nowait(completion)
        # The decode slot now belongs to the delivered KV (until release_decode_slot).
        if run.slot_holder is not None:
            self._slot_of[record.request_id] = run.slot_holder
            run.slot_holder = None
        # The destination acknowledged a verified copy and decode can take it: only now
        # may the source let go of its KV.
        await self._release_source(source, record.request_id)
        mode = record.transport or "none"
        record.outcome = Outcome.DELIVERED
        record.ended_at = self.clock.now()
        self.transfers.move(record, TransferState.DELIVERED)
        m = self.metrics
        m.outcome(mode, Outcome.DELIVERED.value).inc()
        nbytes, seconds, gbps = m.for_mode(mode)
        nbytes.inc(record.size_bytes)
        seconds.observe(delivery.seconds)
        m.handoff_seconds.observe(completion.handoff_seconds)
        if delivery.seconds > 0:
            gbps.observe(record.size_bytes / delivery.seconds / 1e9)
        return None, ""

    # -- cleanup ---------------------------------------------------------------------------

    async def _cleanup(
        self,
        record: TransferRecord,
        run: _Run,
        outcome: Outcome,
        kind: FailureKind | None,
        reason: str,
    ) -> None:
        """End ``record`` without delivery and release everything it held."""
        if record.terminal:
            return
        destination = self.view.get(record.destination) if record.destination else None
        if destination is not None and record.state == TransferState.VERIFYING:
            await self._discard(destination, record.request_id)
        self._release_slot_of(record)
        source = self.view.get(record.source)
        if source is not None:
            await self._release_source(source, record.request_id)
        record.outcome = outcome
        record.failure = kind
        record.reason = reason
        record.ended_at = self.clock.now()
        state = TransferState.CANCELLED if outcome == Outcome.CANCELLED else TransferState.FAILED
        self.transfers.move(record, state)
        self.metrics.outcome(record.transport or "none", outcome.value).inc()
        await self._put_completion(self._completion(record, outcome, kind, reason))

    async def _finish_unstarted(self, record: TransferRecord, reason: str) -> None:
        run = self._runs.pop(record.request_id, None)
        await self._cleanup(record, run or _Run(), Outcome.CANCELLED, FailureKind.CANCELLED, reason)
        if run is not None and run.done is not None and not run.done.done():
            run.done.set_result(None)

    def _completion(
        self, record: TransferRecord, outcome: Outcome, kind: FailureKind | None, reason: str
    ) -> Completion:
        return Completion(
            request_id=record.request_id,
            model_id=record.model_id,
            outcome=outcome,
            source=record.source,
            destination=record.destination,
            transport=record.transport,
            medium=record.medium,
            size_bytes=record.size_bytes,
            failure=kind,
            reason=reason,
            handoff_seconds=self.clock.now() - record.submitted_at,
        )

    async def _put_completion(self, completion: Completion) -> None:
        completions = self._completions
        if completions is None:
            return
        try:
            if self._closing:
                completions.put_nowait(completion)
            else:
                await asyncio.wait_for(
                    completions.put(completion), self.config.completion_put_timeout_s
                )
        except (TimeoutError, asyncio.QueueFull):
            self.completions_dropped += 1
            log.warning("completion of request %s dropped: queue full", completion.request_id)

    async def _executor_call(self, call: Awaitable[int], kind: FailureKind) -> int:
        try:
            return await _bounded(call, self.config.executor_call_timeout_s)
        except (AttemptFailed, TopKVError, TimeoutError) as exc:
            raise _Exhausted(
                classify_failure(exc) if isinstance(exc, AttemptFailed) else kind,
                str(exc) or exc.__class__.__name__,
            ) from exc

    async def _release_source(self, source: WorkerInfo, request_id: int) -> None:
        try:
            await _bounded(
                self.executor.release_source(source, request_id),
                self.config.executor_call_timeout_s,
            )
        except (TopKVError, TimeoutError, OSError) as exc:
            log.warning("release of request %s at %s failed: %s", request_id, source.worker_id, exc)

    async def _discard(self, destination: WorkerInfo, request_id: int) -> None:
        try:
            await _bounded(
                self.executor.discard_destination(destination, request_id),
                self.config.executor_call_timeout_s,
            )
        except (TopKVError, TimeoutError, OSError) as exc:
            log.warning(
                "discard of request %s at %s failed: %s", request_id, destination.worker_id, exc
            )

    async def _destination_alive(self, destination: WorkerInfo, run: _Run) -> bool:
        if run.destination_left or not self.view.alive(destination.worker_id):
            return False
        try:
            return await _bounded(
                self.executor.probe(destination), self.config.executor_call_timeout_s
            )
        except (TopKVError, TimeoutError, OSError):
            return False

    # -- slots, load, registry events ------------------------------------------------------

    def _endpoint(self, info: WorkerInfo) -> Endpoint:
        found = self._endpoints.get(info.worker_id)
        if found is None or found[0] is not info:
            found = self._endpoints[info.worker_id] = (info, endpoint_of(info))
        return found[1]

    def _refresh_decode_view(self, worker_id: str) -> None:
        """Rebuild routing's view of ``worker_id`` from its registration and slots."""
        info = self.view.get(worker_id)
        if info is None or info.role != "decode":
            self._decode_views.pop(worker_id, None)
            return
        used = self._slots_used.get(worker_id, 0)
        self._decode_views[worker_id] = DecodeWorkerView(
            worker_id=worker_id,
            endpoint=self._endpoint(info),
            free_slots=info.capacity - used,
            load=used / info.capacity if info.capacity else 1.0,
        )

    def _reserve_slot(self, record: TransferRecord, worker_id: str) -> None:
        run = self._runs.get(record.request_id)
        self._slots_used[worker_id] = self._slots_used.get(worker_id, 0) + 1
        self._refresh_decode_view(worker_id)
        if run is not None:
            run.slot_holder = worker_id

    def _release_slot_of(self, record: TransferRecord) -> None:
        run = self._runs.get(record.request_id)
        if run is not None and run.slot_holder is not None:
            worker, run.slot_holder = run.slot_holder, None
            self._free_slot(worker)

    def _free_slot(self, worker_id: str) -> None:
        used = self._slots_used.get(worker_id, 0) - 1
        if used > 0:
            self._slots_used[worker_id] = used
        else:
            self._slots_used.pop(worker_id, None)
        self._refresh_decode_view(worker_id)
        self._signal_capacity()

    def _signal_capacity(self) -> None:
        event = self._capacity_changed
        if event is not None:
            event.set()
            self._capacity_changed = asyncio.Event()

    def _load_snapshot(self) -> LinkLoad:
        """The link load now, as the policies read it (rebuilt only after a change)."""
        return self._load.snapshot()

    def _add_flow(self, run: _Run, links: tuple[str, ...], nbytes: int) -> None:
        if links:
            self._load.add(links, nbytes)
            run.flow = (links, nbytes)

    def _remove_flow(self, run: _Run) -> None:
        if run.flow is not None:
            links, nbytes = run.flow
            self._load.remove(links, nbytes)
            run.flow = None

    def _on_worker_event(self, event: RegistryEvent) -> None:
        self._scores.clear()
        self._refresh_decode_view(event.worker_id)
        if event.kind == "leave":
            for run in self._runs.values():
                record_destination = run.slot_holder
                if record_destination == event.worker_id:
                    run.destination_left = True
                    if run.in_attempt and not run.interrupted and run.task is not None:
                        run.interrupted = True
                        run.task.cancel()
            # Delivered KV held by a dead decode worker is gone with it: free the slots.
            for request_id, worker in list(self._slot_of.items()):
                if worker == event.worker_id:
                    del self._slot_of[request_id]
                    self._slots_used.pop(worker, None)
            self._decode_views.pop(event.worker_id, None)
        self._signal_capacity()


def _with_error(attempt: AttemptRecord, kind: FailureKind, detail: str) -> AttemptRecord:
    return AttemptRecord(
        number=attempt.number,
        destination=attempt.destination,
        transport=attempt.transport,
        started_at=attempt.started_at,
        ended_at=attempt.ended_at,
        error=kind,
        detail=detail,
        medium=attempt.medium,
    )
