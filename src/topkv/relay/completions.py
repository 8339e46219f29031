"""Finished transfers (:class:`Completion`) and the bounded queue the orchestrator puts
them on (:class:`CompletionQueue`)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from topkv.relay.transfers import FailureKind, Outcome, TransferRecord

log = logging.getLogger(__name__)


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

    @classmethod
    def of(
        cls,
        record: TransferRecord,
        outcome: Outcome,
        kind: FailureKind | None,
        reason: str,
        now: float,
    ) -> Completion:
        """The completion of ``record`` ending with ``outcome`` at time ``now``."""
        return cls(
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
            handoff_seconds=now - record.submitted_at,
        )


class CompletionQueue:
    """The completion queue of ``size`` entries; opened (empty) by each start.

    Puts wait at most ``put_timeout_s`` for room (none while ``closing``); a completion
    that still finds no room is dropped and counted in ``dropped``.
    """

    def __init__(self, size: int, put_timeout_s: float) -> None:
        self.size = size
        self.put_timeout_s = put_timeout_s
        self.queue: asyncio.Queue[Completion] | None = None
        self.dropped = 0
        self.closing = False

    def open(self) -> None:
        self.queue = asyncio.Queue(self.size)
        self.closing = False

    def waiting(self) -> int:
        return self.queue.qsize() if self.queue else 0

    def nowait(self) -> Completion | None:
        """The next completion if one is waiting, else None."""
        if self.queue is None or self.queue.empty():
            return None
        return self.queue.get_nowait()

    async def put(self, completion: Completion) -> None:
        """Queue ``completion``, or drop it (counted) when the queue stays full."""
        queue = self.queue
        if queue is None:
            return
        try:
            if self.closing:
                queue.put_nowait(completion)
            else:
                await asyncio.wait_for(queue.put(completion), self.put_timeout_s)
        except (TimeoutError, asyncio.QueueFull):
            self.dropped += 1
            log.warning("completion of request %s dropped: queue full", completion.request_id)
