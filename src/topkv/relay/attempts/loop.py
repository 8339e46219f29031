"""The attempt loop of one transfer: route, attempt, and on failure retry, fail over or
reroute until it is delivered or exhausted (:class:`AttemptLoop`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from topkv.policy.select import Selection
from topkv.policy.view import LinkLoadTracker
from topkv.relay.attempts.bounded import bounded
from topkv.relay.attempts.calls import ExecutorCalls
from topkv.relay.attempts.handoff import Handoff
from topkv.relay.context import RelayContext, RelayPart
from topkv.relay.executor import AttemptPlan, Delivery, classify_failure
from topkv.relay.routing import DecodeRouter
from topkv.relay.runs import Exhausted, TransferRun
from topkv.relay.transfers import (
    AttemptRecord,
    FailureKind,
    Outcome,
    TransferRecord,
    TransferState,
)
from topkv.relay.workers import WorkerInfo

log = logging.getLogger(__name__)

Sleep = Callable[[float], Awaitable[None]]

#: Failures no other decode worker can mend: they end the transfer without a reroute.
_ENDS_TRANSFER = frozenset({FailureKind.SOURCE_LOST, FailureKind.INTERNAL})


class AttemptLoop(RelayPart):
    """Runs one dispatched transfer to its end, releasing everything on every path."""

    def __init__(
        self,
        context: RelayContext,
        router: DecodeRouter,
        handoff: Handoff,
        calls: ExecutorCalls,
        load: LinkLoadTracker,
        sleep: Sleep,
    ) -> None:
        super().__init__(context)
        self.router = router
        self.handoff = handoff
        self.calls = calls
        self.load = load
        self.sleep = sleep

    async def run_transfer(self, record: TransferRecord, run: TransferRun) -> None:
        cleanup = self.handoff.cleanup
        try:
            await self._attempt_until_done(record, run)
        except asyncio.CancelledError:
            await asyncio.shield(cleanup(record, run, Outcome.CANCELLED, None, "aborted"))
            raise
        except Exhausted as exc:
            outcome = (
                Outcome.RECOMPUTE
                if self.config.on_exhausted == "recompute" or exc.kind == FailureKind.SOURCE_LOST
                else Outcome.FAILED
            )
            await cleanup(record, run, outcome, exc.kind, exc.reason)
        except Exception as exc:  # a bug: report it on the record, release everything
            log.exception("transfer %s failed unexpectedly", record.request_id)
            await cleanup(record, run, Outcome.FAILED, FailureKind.INTERNAL, repr(exc))

    async def _attempt_until_done(self, record: TransferRecord, run: TransferRun) -> None:
        """Attempt ``record`` towards one decode worker after another until it is delivered;
        raises :class:`Exhausted` when it cannot be."""
        source = await self._source_with_digest(record)
        excluded: set[str] = set()
        request = self.router.request_for(record)
        while True:
            decision = await self.router.route(record, run, source, request, excluded)
            destination = self.view.get(decision.worker_id)
            if destination is None:  # left between routing and now
                excluded.add(decision.worker_id)
                self.slots.release(run)
                continue
            record.destination = decision.worker_id
            record.policy = decision.selection.policy
            record.rationale = f"{decision.rationale}; {decision.selection.rationale}"
            given_up = await self._attempt_destination(
                record, run, source, destination, decision.selection
            )
            if given_up is None:
                return
            kind, reason = given_up
            if kind not in _ENDS_TRANSFER:  # destination died, or nothing works towards it
                excluded.add(destination.worker_id)
                self.slots.release(run)
                if record.reroutes < self.config.retry.max_reroutes:
                    record.reroutes += 1
                    self.metrics.reroutes.inc()
                    self.transfers.move(record, TransferState.PLANNED)
                    continue  # to another decode worker
                reason = f"{reason}; gave up after {record.reroutes} reroute(s)"
            raise Exhausted(kind, reason)

    async def _source_with_digest(self, record: TransferRecord) -> WorkerInfo:
        """The transfer's source, with its digest fetched unless deferred to the handoff."""
        source = self.view.get(record.source)
        if source is None:
            raise Exhausted(FailureKind.SOURCE_LOST, f"source {record.source} left")
        if record.source_digest is None and not record.digest_deferred:
            record.source_digest = await self.calls.source_digest(record, source)
        return source

    async def _attempt_destination(
        self,
        record: TransferRecord,
        run: TransferRun,
        source: WorkerInfo,
        destination: WorkerInfo,
        selection: Selection,
    ) -> tuple[FailureKind, str] | None:
        """Attempt ``record`` towards ``destination``: retry a path that corrupts or stalls,
        fail over to the next ranked transport. Returns why it gave up (None: delivered)."""
        retry = self.config.retry
        transports = list(selection.ranked_transports)
        index, retries_here = 0, 0
        while True:
            transport = transports[index]
            record.transport = transport
            run.destination_left = not self.view.alive(destination.worker_id)
            self.transfers.move(record, TransferState.RUNNING)
            failure, detail = await self._one_attempt(
                record, run, source, destination, transport, selection
            )
            if failure is None:
                return None
            kind = await self._failure_kind(failure, destination, run)
            if kind in (FailureKind.CHECKSUM, FailureKind.TIMEOUT):
                if retries_here < retry.max_retries:
                    retries_here += 1
                    record.retries += 1
                    self.metrics.retries.inc()
                    self.transfers.move(record, TransferState.PLANNED)
                    await self.sleep(retry.delay(retries_here))
                    continue
                kind = FailureKind.TRANSPORT  # this path keeps failing: next transport
            if kind != FailureKind.TRANSPORT:
                return kind, detail
            if index + 1 == len(transports):
                return kind, f"every transport to {destination.worker_id} failed ({detail})"
            index += 1
            retries_here = 0
            record.failovers += 1
            self.metrics.failovers.inc()
            self.transfers.move(record, TransferState.PLANNED)

    async def _failure_kind(
        self, failure: FailureKind, destination: WorkerInfo, run: TransferRun
    ) -> FailureKind:
        """Count a failed attempt. A transport failure or cancellation becomes destination
        died when the destination is gone (registry or probe), else a transport failure."""
        self.metrics.attempt_failures.labels(failure.value).inc()
        if failure == FailureKind.CHECKSUM:
            self.metrics.checksum_failures.inc()
        if failure not in (FailureKind.TRANSPORT, FailureKind.CANCELLED):
            return failure
        if not await self._destination_alive(destination, run):
            return FailureKind.DESTINATION_DIED
        return FailureKind.TRANSPORT

    async def _destination_alive(self, destination: WorkerInfo, run: TransferRun) -> bool:
        if run.destination_left or not self.view.alive(destination.worker_id):
            return False
        return await self.calls.probe(destination)

    async def _one_attempt(
        self,
        record: TransferRecord,
        run: TransferRun,
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
            path_class=transport,
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
            delivery = await bounded(self.executor.transfer(plan), self.config.attempt_timeout_s)
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
        return await self.handoff.verify_and_hand_off(record, run, source, destination, delivery)

    def _add_flow(self, run: TransferRun, links: tuple[str, ...], nbytes: int) -> None:
        if links:
            self.load.add(links, nbytes)
            run.flow = (links, nbytes)

    def _remove_flow(self, run: TransferRun) -> None:
        if run.flow is not None:
            links, nbytes = run.flow
            self.load.remove(links, nbytes)
            run.flow = None
