"""The receives a worker was told to expect, and the abandoned ones it may reclaim.

``POST /v1/receive`` announces a request's KV; the sink's future for it resolves when the
verified bytes arrived. An announcement that is dropped (``DELETE``, a newer attempt, the
worker stopping) is *abandoned*: whatever still lands for it is released at once, unless a
later announcement of the same request on the same sink reclaims the very same future.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from topkv.service.messages import KVSummary, KVTimings, LayoutModel
from topkv.transport.base import LayerTensors, ReceivedKV, TransferDescriptor, TransferSink


@dataclass
class Pending:
    """A receive the orchestrator announced; its future resolves when the bytes arrived."""

    request_id: int
    model_id: str
    descriptor: TransferDescriptor
    medium: str
    sink_kind: str
    future: Future[ReceivedKV]
    keep: bool = True  # false: a drained copy (verified, stamped, released)
    abandoned: bool = False
    claimed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: ``time.perf_counter()`` when each layer landed verified, and when the whole copy was
    landed_s: dict[int, float] = field(default_factory=dict)
    verified_s: float | None = None

    def arrivals(self) -> tuple[float | None, ...]:
        """Each layer's landing stamp, in order (None: the sink reported none)."""
        return tuple(self.landed_s.get(i) for i in range(self.descriptor.layout.num_layers))

    def _verified(self, _: Future[ReceivedKV]) -> None:
        self.verified_s = time.perf_counter()

    def summary(self) -> KVSummary:
        """What a drained copy leaves: its stamps (its bytes were verified and released)."""
        layout = self.descriptor.layout
        return KVSummary(
            request_id=self.request_id,
            model_id=self.model_id,
            layout=LayoutModel.of(layout),
            size_bytes=layout.total_bytes,
            digest=0,
            origin="received",
            medium=self.medium,
            kept=False,
            timings=KVTimings(arrivals_s=list(self.arrivals()), verified_s=self.verified_s),
        )


def _release_if_abandoned(pending: Pending, future: Future[ReceivedKV]) -> None:
    with pending.lock:
        if not pending.abandoned or pending.claimed:
            return
    if future.cancelled() or future.exception() is not None:
        return
    future.result().release()


class Inbox:
    """Announced receives by request id (event-loop side; futures resolve on sink threads)."""

    def __init__(self) -> None:
        self.pending: dict[int, Pending] = {}
        self._abandoned: dict[tuple[str, int], Pending] = {}

    def __len__(self) -> int:
        return len(self.pending)

    def expect(
        self,
        sink: TransferSink,
        kind: str,
        descriptor: TransferDescriptor,
        medium: str,
        keep: bool = True,
    ) -> Pending:
        """Announce ``descriptor``'s KV on ``sink`` (replacing an earlier announcement)."""
        request_id = descriptor.request_id
        previous = self.pending.pop(request_id, None)
        if previous is not None:
            self.abandon(previous)
        future = self._claim(sink, kind, request_id)
        pending = Pending(
            request_id, descriptor.model_id, descriptor, medium, kind, future, keep=keep
        )
        self.pending[request_id] = pending
        future.add_done_callback(pending._verified)
        return pending

    def landed(self, descriptor: TransferDescriptor, layer: int, _: LayerTensors) -> None:
        """A sink's per-layer callback (its receive thread): stamp the layer's arrival."""
        stamp = time.perf_counter()
        pending = self.pending.get(descriptor.request_id)
        if pending is not None and not pending.future.done():
            pending.landed_s[layer] = stamp

    def take(self, pending: Pending) -> bool:
        """Claim ``pending``'s arrived KV for the store; False when it was abandoned."""
        with pending.lock:
            if pending.abandoned:
                return False
            pending.claimed = True
        if self.pending.get(pending.request_id) is pending:
            del self.pending[pending.request_id]
        return True

    def drop(self, request_id: int) -> bool:
        """Abandon the announcement of ``request_id``, if any."""
        pending = self.pending.pop(request_id, None)
        if pending is None:
            return False
        self.abandon(pending)
        return True

    def drop_all(self) -> None:
        for pending in list(self.pending.values()):
            self.abandon(pending)
        self.pending.clear()

    def abandon(self, pending: Pending) -> None:
        with pending.lock:
            pending.abandoned = True
        if not pending.future.done():
            self._abandoned[(pending.sink_kind, pending.request_id)] = pending
        pending.future.add_done_callback(lambda f: self._abandoned_done(pending, f))

    def _abandoned_done(self, pending: Pending, future: Future[ReceivedKV]) -> None:
        key = (pending.sink_kind, pending.request_id)
        if self._abandoned.get(key) is pending:
            with contextlib.suppress(KeyError):
                del self._abandoned[key]
        _release_if_abandoned(pending, future)

    def _claim(self, sink: TransferSink, kind: str, request_id: int) -> Future[ReceivedKV]:
        """A fresh receive future for ``request_id``, reclaiming an abandoned pending one."""
        for _ in range(3):
            future = sink.receive(request_id)
            old = self._abandoned.pop((kind, request_id), None)
            if old is not None and old.future is future:
                with old.lock:
                    old.abandoned = False
            if not future.done():
                return future
            if not future.cancelled() and future.exception() is None:
                kv = future.result()
                if kv.layers:
                    return future
            # A failed or already-released leftover of an earlier attempt: ask again.
        return sink.receive(request_id)
