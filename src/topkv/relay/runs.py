"""One dispatched transfer's runtime handles (:class:`TransferRun`) and the exception that
ends its attempts (:class:`Exhausted`)."""

from __future__ import annotations

import asyncio

from topkv.relay.transfers import FailureKind


class TransferRun:
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


class Exhausted(Exception):
    """Every retry, failover and reroute of a transfer is spent (or it cannot go on)."""

    def __init__(self, kind: FailureKind, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason
