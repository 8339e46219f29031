"""The end of a transfer: the deferred source digest, verification of the landed copy,
handoff to decode and the release of the source; or, on every other path, cleanup that
releases everything the transfer held (:class:`Handoff`)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from topkv.relay.attempts.calls import ExecutorCalls
from topkv.relay.completions import Completion
from topkv.relay.context import RelayContext, RelayPart
from topkv.relay.executor import Delivery
from topkv.relay.runs import Exhausted, TransferRun
from topkv.relay.transfers import (
    FailureKind,
    Outcome,
    TransferRecord,
    TransferState,
)
from topkv.relay.workers import WorkerInfo


class Handoff(RelayPart):
    """Verifies and hands off a landed copy, or cleans a transfer up."""

    def __init__(self, context: RelayContext, calls: ExecutorCalls) -> None:
        super().__init__(context)
        self.calls = calls

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
            record.source_digest = await self.calls.source_digest(record, source)
        if delivery.digest != record.source_digest:
            await self.calls.discard(destination, record.request_id)
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
            await self.calls.discard(destination, record.request_id)
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
                await self.calls.discard(destination, record.request_id)
                raise Exhausted(
                    FailureKind.COMPLETION_QUEUE_FULL,
                    f"completion queue stayed full for {self.config.completion_put_timeout_s} s",
                ) from None
            if run.destination_left or not self.view.alive(destination.worker_id):
                await self.calls.discard(destination, record.request_id)
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
        await self.calls.release_source(source, record.request_id)
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
            await self.calls.discard(destination, record.request_id)
        self.slots.release(run)
        source = self.view.get(record.source)
        if source is not None:
            await self.calls.release_source(source, record.request_id)
        record.outcome = outcome
        record.failure = kind
        record.reason = reason
        record.ended_at = self.clock.now()
        state = TransferState.CANCELLED if outcome == Outcome.CANCELLED else TransferState.FAILED
        self.transfers.move(record, state)
        self.metrics.outcome(record.transport or "none", outcome.value).inc()
        completion = Completion.of(record, outcome, kind, reason, self.clock.now())
        await self.completions.put(completion)
