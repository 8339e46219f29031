"""The end of a transfer: the deferred source digest, verification of the landed copy,
handoff to decode and the release of the source; or, on every other path, cleanup that
releases everything the transfer held (:class:`Handoff`). Also the bounded executor calls
both of them make."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import replace

from topkv.errors import TopKVError
from topkv.relay.attempts.bounded import bounded
from topkv.relay.completions import Completion
from topkv.relay.context import RelayPart
from topkv.relay.executor import AttemptFailed, Delivery, classify_failure
from topkv.relay.runs import Exhausted, TransferRun
from topkv.relay.transfers import (
    FailureKind,
    Outcome,
    TransferRecord,
    TransferState,
)
from topkv.relay.workers import WorkerInfo

log = logging.getLogger(__name__)


class Handoff(RelayPart):
    """Verifies and hands off a landed copy, or cleans a transfer up."""

    async def verify_and_hand_off(
        self,
        record: TransferRecord,
        run: TransferRun,
        source: WorkerInfo,
        destination: WorkerInfo,
        delivery: Delivery,
    ) -> tuple[FailureKind | None, str]:
        """Compare the copy's digest with the source's, then hand it to decode and release
        the source. Returns the failure (None: delivered)."""
        self.transfers.move(record, TransferState.VERIFYING)
        if record.source_digest is None:
            # Deferred (streaming): the source finished producing the KV by now. Fetched
            # once; a retry compares against the same value. Failing here (source lost,
            # timeout) ends the transfer; cleanup discards the copy (state is verifying).
            record.source_digest = await self.executor_call(
                self.executor.source_digest(source, record.request_id, record.layout),
                FailureKind.SOURCE_LOST,
            )
        if delivery.digest != record.source_digest:
            await self.discard(destination, record.request_id)
            detail = (
                f"destination digest {delivery.digest:#018x} != source digest "
                f"{record.source_digest or 0:#018x}"
            )
            failed = replace(record.attempts[-1], error=FailureKind.CHECKSUM, detail=detail)
            record.attempts[-1] = failed
            return FailureKind.CHECKSUM, detail
        if run.destination_left or not self.view.alive(destination.worker_id):
            # Verified, but the destination died before decode could take it; the source
            # still owns the KV, so send it elsewhere.
            await self.discard(destination, record.request_id)
            return FailureKind.DESTINATION_DIED, f"{destination.worker_id} died after the ack"
        record.medium = delivery.medium
        record.emulated = delivery.emulated
        record.transfer_seconds = delivery.seconds
        completion = Completion.of(record, Outcome.DELIVERED, None, "", self.clock.now())
        completions = self.completions.queue
        assert completions is not None
        # Handoff is one step of the event loop when the queue has room: no registry event
        # can slip between the liveness check above and the completion being visible.
        if completions.full():
            try:
                await asyncio.wait_for(
                    completions.put(completion), self.config.completion_put_timeout_s
                )
            except TimeoutError:
                await self.discard(destination, record.request_id)
                raise Exhausted(
                    FailureKind.COMPLETION_QUEUE_FULL,
                    f"completion queue stayed full for {self.config.completion_put_timeout_s} s",
                ) from None
            if run.destination_left or not self.view.alive(destination.worker_id):
                await self.discard(destination, record.request_id)
                raise Exhausted(
                    FailureKind.DESTINATION_DIED,
                    f"{destination.worker_id} died while its completion was queued",
                )
        else:
            completions.put_nowait(completion)
        # The decode slot now belongs to the delivered KV (until release_decode_slot).
        self.slots.deliver(run, record.request_id)
        # The destination acknowledged a verified copy and decode can take it: only now
        # may the source let go of its KV.
        await self.release_source(source, record.request_id)
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

    async def cleanup(
        self,
        record: TransferRecord,
        run: TransferRun,
        outcome: Outcome,
        kind: FailureKind | None,
        reason: str,
    ) -> None:
        """End ``record`` without delivery and release everything it held."""
        if record.terminal:
            return
        destination = self.view.get(record.destination) if record.destination else None
        if destination is not None and record.state == TransferState.VERIFYING:
            await self.discard(destination, record.request_id)
        self.slots.release(run)
        source = self.view.get(record.source)
        if source is not None:
            await self.release_source(source, record.request_id)
        record.outcome = outcome
        record.failure = kind
        record.reason = reason
        record.ended_at = self.clock.now()
        state = TransferState.CANCELLED if outcome == Outcome.CANCELLED else TransferState.FAILED
        self.transfers.move(record, state)
        self.metrics.outcome(record.transport or "none", outcome.value).inc()
        completion = Completion.of(record, outcome, kind, reason, self.clock.now())
        await self.completions.put(completion)

    # -- executor calls, each bounded by executor_call_timeout_s ---------------------------

    async def executor_call(self, call: Awaitable[int], kind: FailureKind) -> int:
        """``await call``; a failure ends the transfer as ``kind`` (or as it classifies)."""
        try:
            return await bounded(call, self.config.executor_call_timeout_s)
        except (AttemptFailed, TopKVError, TimeoutError) as exc:
            raise Exhausted(
                classify_failure(exc) if isinstance(exc, AttemptFailed) else kind,
                str(exc) or exc.__class__.__name__,
            ) from exc

    async def release_source(self, source: WorkerInfo, request_id: int) -> None:
        call = self.executor.release_source(source, request_id)
        await self._quietly(call, f"release of request {request_id} at {source.worker_id}")

    async def discard(self, destination: WorkerInfo, request_id: int) -> None:
        call = self.executor.discard_destination(destination, request_id)
        await self._quietly(call, f"discard of request {request_id} at {destination.worker_id}")

    async def _quietly(self, call: Awaitable[None], what: str) -> None:
        """``await call``, bounded; a failure is logged, not raised (nothing depends on it)."""
        try:
            await bounded(call, self.config.executor_call_timeout_s)
        except (TopKVError, TimeoutError, OSError) as exc:
            log.warning("%s failed: %s", what, exc)

    async def destination_alive(self, destination: WorkerInfo, run: TransferRun) -> bool:
        if run.destination_left or not self.view.alive(destination.worker_id):
            return False
        try:
            return await bounded(
                self.executor.probe(destination), self.config.executor_call_timeout_s
            )
        except (TopKVError, TimeoutError, OSError):
            return False
