"""Receive-side pieces shared by every transport.

* :class:`ReceiveTable`: request id -> future of the verified KV, whichever of
  ``receive()`` and the bytes comes first; bounded so an abusive sender cannot grow it.
* :class:`HostAllocator`: destination buffers in host memory, pooled so that repeated
  transfers land in already-faulted memory (like ``recv_into`` a preallocated buffer).
* :func:`read_message`: read the next record from a stream socket, validating headers
  before anything is allocated.
* :func:`read_replies`: a source's reader of its sink's control replies.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from topkv.transport import framing
from topkv.transport.base import LayerTensors, ReceivedKV, TransferDescriptor
from topkv.transport.errors import (
    ChecksumMismatch,
    FrameRejected,
    PeerDied,
    ResourceExhausted,
    TransferCancelled,
    TransportError,
)
from topkv.transport.stream.sockio import recv_exactly, recv_into_exactly

Allocation = tuple[list[LayerTensors], Callable[[], None]]
Allocator = Callable[[TransferDescriptor], Allocation]


def carve_layers(block: memoryview, descriptor: TransferDescriptor) -> list[LayerTensors]:
    """Split one contiguous block into per-layer (K, V) / (latent,) views."""
    layout = descriptor.layout
    size = layout.tensor_bytes
    per_layer = layout.tensors_per_layer
    return [
        tuple(
            block[(layer * per_layer + t) * size : (layer * per_layer + t + 1) * size]
            for t in range(per_layer)
        )
        for layer in range(layout.num_layers)
    ]


class HostAllocator:
    """Allocates one contiguous host block per transfer; keeps freed blocks for reuse."""

    def __init__(self, keep_free: int = 4) -> None:
        self._keep_free = keep_free
        self._free: list[bytearray] = []
        self._lock = threading.Lock()
        self.allocations = 0

    def __call__(self, descriptor: TransferDescriptor) -> Allocation:
        need = descriptor.layout.total_bytes
        with self._lock:
            self.allocations += 1
            block = next((b for b in self._free if len(b) == need), None)
            if block is not None:
                self._free.remove(block)
        if block is None:
            block = bytearray(need)
        layers = carve_layers(memoryview(block), descriptor)

        def release() -> None:
            with self._lock:
                if len(self._free) < self._keep_free:
                    self._free.append(block)
                else:
                    self._free.pop(0)
                    self._free.append(block)

        return layers, release


class ReceiveTable:
    """Futures of incoming transfers keyed by request id."""

    def __init__(self, max_pending: int = 1024) -> None:
        self._max_pending = max_pending
        self._futures: dict[int, Future[ReceivedKV]] = {}
        self._claimed: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False

    def receive(self, request_id: int) -> Future[ReceivedKV]:
        with self._lock:
            future = self._futures.get(request_id)
            if future is None:
                future = Future()
                if self._closed:
                    future.set_exception(TransferCancelled("sink is closed"))
                else:
                    self._futures[request_id] = future
            elif future.done():
                # Hand the finished future over; a later transfer may reuse the id.
                del self._futures[request_id]
                return future
            self._claimed.add(request_id)
            return future

    def claimable(self, request_id: int) -> None:
        """Check that a new transfer may be tracked (raises ResourceExhausted)."""
        with self._lock:
            unclaimed = sum(1 for f in self._futures.values() if f.done())
            if unclaimed >= self._max_pending and request_id not in self._futures:
                raise ResourceExhausted(
                    f"{unclaimed} received transfers were never claimed with receive(); "
                    "refusing more"
                )

    def _settle(self, request_id: int) -> Future[ReceivedKV] | None:
        with self._lock:
            future = self._futures.get(request_id)
            if future is None or future.done():
                future = Future()
                self._futures[request_id] = future
            if request_id in self._claimed:
                self._claimed.discard(request_id)
                del self._futures[request_id]
        return future if future.set_running_or_notify_cancel() else None

    def complete(self, kv: ReceivedKV) -> None:
        future = self._settle(kv.descriptor.request_id)
        if future is None:
            kv.release()
        else:
            future.set_result(kv)

    def fail(self, request_id: int, error: BaseException) -> None:
        future = self._settle(request_id)
        if future is not None:
            future.set_exception(error)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pending = [f for f in self._futures.values() if not f.done()]
        for future in pending:
            if future.set_running_or_notify_cancel():
                future.set_exception(TransferCancelled("sink closed before the transfer ended"))


@dataclass(frozen=True)
class TransferMessage:
    descriptor: TransferDescriptor
    streams: int


@dataclass(frozen=True)
class LayerMessage:
    raw: bytes


Message = TransferMessage | LayerMessage | framing.Control


def read_message(
    sock: socket.socket, limits: framing.ReceiveLimits, first: bytes | None = None
) -> Message:
    """Read one record. ``first`` is its magic when the caller already read it."""
    magic = first if first is not None else recv_exactly(sock, framing.MAGIC_SIZE, "frame")
    if magic == framing.TRANSFER_MAGIC:
        rest = recv_exactly(sock, framing.TRANSFER_HEADER_SIZE - framing.MAGIC_SIZE, "header")
        descriptor, streams = framing.decode_transfer_header(magic + rest, limits)
        return TransferMessage(descriptor, streams)
    if magic == framing.LAYER_MAGIC:
        rest = recv_exactly(sock, framing.LAYER_HEADER_SIZE - framing.MAGIC_SIZE, "layer header")
        return LayerMessage(magic + rest)
    if magic == framing.CONTROL_MAGIC:
        rest = recv_exactly(sock, framing.CONTROL_HEADER_SIZE - framing.MAGIC_SIZE, "control")
        control, text_len = framing.decode_control_header(magic + rest)
        text = recv_exactly(sock, text_len, "control text") if text_len else b""
        return framing.Control(
            control.kind,
            control.request_id,
            control.status,
            control.arg0,
            control.arg1,
            text.decode(errors="replace"),
        )
    raise FrameRejected(f"unknown record magic {magic!r}")


def read_replies(
    sock: socket.socket, on_reply: Callable[[framing.Control], None], sink: str
) -> PeerDied:
    """Hand each control record the ``sink`` sends on a source's control connection to
    ``on_reply`` until the connection fails; returns the error the connection dies of.

    The sink speaks only in reply, so the read has no timeout and EOF means death."""
    try:
        sock.settimeout(None)
        while True:
            message = read_message(sock, framing.ReceiveLimits())
            if not isinstance(message, framing.Control):
                raise FrameRejected(f"{sink} sink sent an unexpected record {message!r}")
            on_reply(message)
    except (TransportError, OSError) as exc:
        return PeerDied(f"{sink} sink went away: {exc}")


def error_from_ack(control: framing.Control) -> TransportError:
    """Map a failed ACK to the exception the sender's future should carry."""
    status = framing.ControlStatus
    text = control.text or "no detail"
    if control.status == status.CHECKSUM:
        return ChecksumMismatch(f"receiver: {text}")
    if control.status == status.REJECTED:
        return FrameRejected(f"receiver rejected the transfer: {text}")
    if control.status == status.CANCELLED:
        return TransferCancelled(f"receiver cancelled: {text}")
    return TransportError(f"receiver failed: {text}")


def status_for(error: BaseException) -> framing.ControlStatus:
    if isinstance(error, ChecksumMismatch):
        return framing.ControlStatus.CHECKSUM
    if isinstance(error, FrameRejected | ResourceExhausted):
        return framing.ControlStatus.REJECTED
    if isinstance(error, TransferCancelled):
        return framing.ControlStatus.CANCELLED
    return framing.ControlStatus.ERROR


VERIFY_CHUNK = 1 << 20


def recv_verified(
    sock: socket.socket, view: memoryview, expected_crc: int, verify: bool = True
) -> bool:
    """Receive exactly ``len(view)`` bytes into ``view``; True when the CRC-64 matched.

    The CRC runs over each received chunk while it is still in cache, so verification is
    streamed with the receive rather than a second pass over the tensor.
    """
    size = len(view)
    if not verify:
        recv_into_exactly(sock, view, "tensor data")
        return True
    crc = 0
    for start in range(0, size, VERIFY_CHUNK):
        chunk = view[start : start + VERIFY_CHUNK]
        recv_into_exactly(sock, chunk, "tensor data")
        crc = framing.crc64(chunk, crc)
    return crc == expected_crc
