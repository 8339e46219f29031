"""The orchestrator's view of data movement: one *attempt* at a time, through an executor.

The orchestrator decides (which decode worker, which transport, retry or not); an executor
does. :class:`TransferExecutor` is the whole contract; the one implementation that moves
bytes is the service layer's remote executor, which speaks to each worker's control API
(whether the worker is a ``topkv worker`` process or the same worker class started in the
caller's event loop, as tests and ``topkv chaos --mode inprocess`` do).

Who owns what
    * The *source* (prefill worker) holds request ``r``'s KV from ``submit`` until the
      orchestrator calls :meth:`TransferExecutor.release_source` - which it does only after
      a destination acknowledged a verified copy and the completion was queued, or when the
      transfer ends without delivery (failed, recompute, cancelled).
    * A successful :meth:`TransferExecutor.transfer` leaves a verified copy *held by the
      destination* until the decode side takes it, or the orchestrator calls
      :meth:`TransferExecutor.discard_destination` (digest mismatch, abort, a completion
      that could not be queued).
    * A failed or cancelled attempt leaves nothing behind at the destination: the executor
      cancels the outgoing transfer and drops whatever arrived.

Errors
    ``transfer`` raises :class:`AttemptFailed` with a :class:`FailureKind`, or a
    :class:`topkv.transport.errors.TransportError` which :func:`classify_failure` maps to a
    kind. Cancellation (``asyncio.CancelledError``) must be honoured promptly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from topkv.errors import TopKVError
from topkv.relay.transfers import FailureKind
from topkv.relay.workers import WorkerInfo
from topkv.transport.base import KVLayout, TransferDescriptor
from topkv.transport.errors import (
    ChecksumMismatch,
    TransferCancelled,
    TransferTimeout,
    TransportError,
)
from topkv.wire import crc64


class AttemptFailed(TopKVError):
    """One attempt of a transfer failed for the reason ``kind`` (see :class:`FailureKind`)."""

    def __init__(self, kind: FailureKind, detail: str) -> None:
        super().__init__(f"{kind.value}: {detail}")
        self.kind = kind
        self.detail = detail


def classify_failure(error: BaseException) -> FailureKind:
    """The failure kind of an exception raised by an executor or a transport."""
    if isinstance(error, AttemptFailed):
        return error.kind
    if isinstance(error, ChecksumMismatch):
        return FailureKind.CHECKSUM
    if isinstance(error, TransferTimeout | TimeoutError):
        return FailureKind.TIMEOUT
    if isinstance(error, TransferCancelled):
        return FailureKind.CANCELLED
    if isinstance(error, TransportError):
        # A peer that went away (PeerDied): the orchestrator asks the registry whether the
        # destination is still alive and fails over (it is) or reroutes (it is not). Every
        # other transport error (refused handshake or frame, medium unavailable, resources
        # exhausted) is a transport failure too.
        return FailureKind.TRANSPORT
    return FailureKind.INTERNAL


@dataclass(frozen=True)
class AttemptPlan:
    """One attempt: move ``request_id``'s KV from ``source`` to ``destination``.

    ``path_class`` is the selection policy's name for the path (``nvlink``, ``pcie``,
    ``rdma``, ``tcp`` ...); the executor maps it to a medium it can run (``shm``, ``tcp``,
    ``nixl``, ``emulated-<mode>``) and reports which in :attr:`Delivery.medium`.
    """

    request_id: int
    model_id: str
    layout: KVLayout
    source: WorkerInfo
    destination: WorkerInfo
    path_class: str
    attempt: int
    timeout_s: float

    @property
    def descriptor(self) -> TransferDescriptor:
        return TransferDescriptor(self.request_id, self.model_id, self.layout)


@dataclass(frozen=True)
class Delivery:
    """A verified copy now held by the destination, as reported by the executor.

    ``digest`` is :func:`kv_digest` of the bytes the destination holds; the orchestrator
    compares it with the source's before it declares the transfer delivered.
    """

    request_id: int
    destination: str
    transport: str
    medium: str
    size_bytes: int
    seconds: float
    digest: int
    emulated: bool = False


def kv_digest(tensor_crcs: list[int]) -> int:
    """Digest of a whole KV cache from the CRC-64 of each tensor, in layout order.

    Layout order is layer 0 K, layer 0 V, layer 1 K, ... (or one latent per layer). Both
    sides compute it from their own bytes in one pass; the per-tensor CRCs are the ones the
    wire frames carry, so the source gets them for free while sending.
    """
    packed = b"".join(crc.to_bytes(8, "little") for crc in tensor_crcs)
    return crc64(packed)


class TransferExecutor(Protocol):
    """Performs attempts of planned transfers and manages KV ownership at both ends."""

    async def source_digest(self, source: WorkerInfo, request_id: int, layout: KVLayout) -> int:
        """:func:`kv_digest` of the KV ``source`` holds for ``request_id``.

        Raises :class:`AttemptFailed` (``SOURCE_LOST``) when the source holds none.
        """
        ...

    async def transfer(self, plan: AttemptPlan) -> Delivery:
        """Run one attempt; on success the destination holds a verified copy.

        Must finish (or raise ``TransferTimeout``/``AttemptFailed(TIMEOUT)``) within
        ``plan.timeout_s``; on failure or cancellation nothing stays at the destination.
        """
        ...

    async def probe(self, worker: WorkerInfo) -> bool:
        """Is ``worker`` alive and serving? Asked after a dead peer, to tell a broken
        transport (fail over) from a dead destination (reroute)."""
        ...

    async def release_source(self, source: WorkerInfo, request_id: int) -> None:
        """The source may free its KV for ``request_id`` (idempotent; a dead source is ok)."""
        ...

    async def discard_destination(self, destination: WorkerInfo, request_id: int) -> None:
        """Drop the copy ``destination`` holds for ``request_id`` (idempotent)."""
        ...
