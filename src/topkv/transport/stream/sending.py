"""Send-side pieces shared by every transport: checking, queueing and checksumming layers."""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, InvalidStateError
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from topkv.transport import framing
from topkv.transport.base import (
    Buffer,
    OutgoingTransfer,
    TransferDescriptor,
    TransferResult,
    TransportMode,
)
from topkv.transport.errors import FrameRejected, TransferCancelled, TransportError
from topkv.transport.stream.sockio import send_buffers


@dataclass(frozen=True)
class LayerItem:
    """One layer queued for sending: byte views of its tensors and known CRCs if any."""

    layer: int
    tensors: tuple[memoryview, ...]
    crcs: tuple[int, ...] | None
    ahead: bool = False  # CRCs computed by the transport's look-ahead checksum stage


def as_bytes_view(buffer: Buffer) -> memoryview:
    """A flat, read-only byte view of any C-contiguous buffer (numpy, torch CPU, bytes)."""
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise FrameRejected("tensor buffers must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


TensorT = TypeVar("TensorT")
FlatT = TypeVar("FlatT")


def check_layer_tensors(
    descriptor: TransferDescriptor,
    layer: int,
    tensors: Sequence[TensorT],
    crcs: Sequence[int] | None,
    flatten: Callable[[TensorT], FlatT],
    nbytes: Callable[[FlatT], int],
) -> tuple[tuple[FlatT, ...], tuple[int, ...] | None]:
    """Validate a ``send_layer`` call against the transfer's layout: the layer index, the
    tensor count, each tensor's size in bytes after ``flatten`` and the CRC count.

    Returns the flattened tensors and the CRCs as a tuple (None when not given). Host
    transports flatten to byte views (:func:`check_layer`), the CUDA arena transport to
    device tensors."""
    layout = descriptor.layout
    if not 0 <= layer < layout.num_layers:
        raise FrameRejected(f"layer {layer} out of range 0..{layout.num_layers - 1}")
    if len(tensors) != layout.tensors_per_layer:
        raise FrameRejected(
            f"layer {layer}: {len(tensors)} tensors given, layout needs {layout.tensors_per_layer}"
        )
    flat = tuple(flatten(t) for t in tensors)
    for index, tensor in enumerate(flat):
        size = nbytes(tensor)
        if size != layout.tensor_bytes:
            raise FrameRejected(
                f"layer {layer} tensor {index}: {size} bytes, layout says {layout.tensor_bytes}"
            )
    if crcs is not None and len(crcs) != len(flat):
        raise FrameRejected(f"layer {layer}: {len(crcs)} CRCs for {len(flat)} tensors")
    return flat, tuple(crcs) if crcs is not None else None


def _view_bytes(view: memoryview) -> int:
    return view.nbytes


def check_layer(
    descriptor: TransferDescriptor,
    layer: int,
    tensors: Sequence[Buffer],
    crcs: Sequence[int] | None,
) -> LayerItem:
    """Validate a ``send_layer`` call against the transfer's layout."""
    views, checked = check_layer_tensors(
        descriptor, layer, tensors, crcs, as_bytes_view, _view_bytes
    )
    return LayerItem(layer, views, checked)


def layer_crcs(item: LayerItem) -> tuple[int, ...]:
    """The item's CRC-64 values, computing those the producer did not supply."""
    if item.crcs is not None:
        return item.crcs
    return tuple(framing.crc64(view) for view in item.tensors)


ItemT = TypeVar("ItemT")

#: What follows the last item on a queued transfer's ``_queue``; also put there (and on
#: any queue further down) to wake the sender threads when the transfer fails.
FINISH = object()


class QueuedOutgoing(OutgoingTransfer, Generic[ItemT]):
    """An outgoing transfer whose ``send_layer`` hands checked layers to worker threads.

    Holds the bookkeeping every queueing transport shares: each layer queued once,
    nothing after ``finish()``, and ``finish()`` failing the transfer when layers are
    missing before it queues the finish marker. Checked layers, then :data:`FINISH`, go on
    ``_queue``, which the subclass's sender thread reads. Subclasses supply the hooks: how
    a call is checked (:meth:`_check`) and how the first error is recorded (:meth:`_fail`);
    they call :meth:`_succeed` once the receiver acknowledged a verified copy.
    """

    def __init__(self, descriptor: TransferDescriptor) -> None:
        self._started = time.perf_counter()
        self.descriptor = descriptor
        self._future: Future[TransferResult] = Future()
        self._future.set_running_or_notify_cancel()
        self._lock = threading.RLock()  # reentrant: finish() calls _fail() while holding it
        self._queued: set[int] = set()
        self._finished = False
        self._queue: queue.SimpleQueue[ItemT | object] = queue.SimpleQueue()

    @abstractmethod
    def _check(self, layer: int, tensors: Sequence[Buffer], crcs: Sequence[int] | None) -> ItemT:
        """Validate a ``send_layer`` call (raises ``FrameRejected``) into a queue item."""

    def _enqueue(self, item: ItemT) -> None:
        """Hand a checked layer to the sending side."""
        self._queue.put(item)

    def _enqueue_finish(self) -> None:
        """Tell the sending side that no more layers will come."""
        self._queue.put(FINISH)

    @abstractmethod
    def _fail(self, error: BaseException) -> object:
        """Record ``error`` as the transfer's outcome unless one is already recorded."""

    def _succeed(self, medium: str, mode: TransportMode) -> None:
        """Resolve the future with the verified result (timed from the open), unless it
        already failed."""
        seconds = time.perf_counter() - self._started
        result = TransferResult(
            request_id=self.descriptor.request_id,
            medium=medium,
            mode=mode,
            size_bytes=self.descriptor.layout.total_bytes,
            seconds=seconds,
            checksum_verified=True,
            wall_seconds=seconds,
        )
        with contextlib.suppress(InvalidStateError):
            self._future.set_result(result)

    def send_layer(
        self, layer: int, tensors: Sequence[Buffer], crcs: Sequence[int] | None = None
    ) -> None:
        item = self._check(layer, tensors, crcs)
        with self._lock:
            if self._finished:
                raise TransportError("send_layer() after finish()")
            if layer in self._queued:
                raise FrameRejected(f"layer {layer} queued twice")
            self._queued.add(layer)
        self._enqueue(item)

    def finish(self) -> Future[TransferResult]:
        with self._lock:
            if not self._finished:
                self._finished = True
                missing = self.descriptor.layout.num_layers - len(self._queued)
                if missing:
                    self._fail(FrameRejected(f"finish() with {missing} layers not sent"))
                self._enqueue_finish()
        return self._future


class HostOutgoing(QueuedOutgoing[LayerItem]):
    """A queued transfer of host buffers whose sender threads stop at the first error
    (shm, tcp).

    Layers are checked as byte views (:func:`check_layer`). :meth:`_fail` keeps the first
    error in ``_error`` and wakes the sender threads (:meth:`_wake`), which stop at their
    next layer; :meth:`cancel` marks the transfer ``_cancelled`` and fails it.
    """

    def __init__(self, descriptor: TransferDescriptor) -> None:
        super().__init__(descriptor)
        self._cancelled = threading.Event()
        self._error: BaseException | None = None

    def _check(
        self, layer: int, tensors: Sequence[Buffer], crcs: Sequence[int] | None
    ) -> LayerItem:
        return check_layer(self.descriptor, layer, tensors, crcs)

    def cancel(self) -> None:
        self._cancelled.set()
        self._fail(TransferCancelled(f"request {self.descriptor.request_id} cancelled"))

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
        self._wake()

    @abstractmethod
    def _wake(self) -> None:
        """Wake every sender thread (each then sees ``_error``, or its finish marker)."""


WaiterT = TypeVar("WaiterT")


class ControlChannel:
    """A source's side of one authenticated control connection to a sink: serialized
    sends, with ``dead`` the error it died of once it failed or closed (then every send and
    every new wait for a reply raises it). Subclasses read the replies and set ``dead``."""

    def __init__(self, sock: socket.socket, io_timeout: float) -> None:
        sock.settimeout(io_timeout)
        self.sock = sock
        self.send_lock = threading.Lock()
        self.dead: TransportError | None = None

    def send(self, *buffers: bytes | memoryview) -> None:
        with self.send_lock:
            if self.dead is not None:
                raise self.dead
            send_buffers(self.sock, buffers)

    def _wait_for_reply(
        self,
        lock: AbstractContextManager[object],
        waiters: dict[int, WaiterT],
        request_id: int,
        waiter: WaiterT,
    ) -> WaiterT:
        """Add ``waiter`` to ``waiters`` (guarded by ``lock``) for ``request_id``'s reply,
        unless the connection is dead (then its error is raised)."""
        with lock:
            if self.dead is not None:
                raise self.dead
            waiters[request_id] = waiter
        return waiter


class ControlConnection(Protocol):
    """What :class:`ControlConnections` needs of a source's connection to one sink."""

    @property
    def dead(self) -> TransportError | None:
        """Why the connection died, or None while it is usable."""

    def close(self) -> None:
        """Close the connection (it forgets itself from its pool on the way)."""


KeyT = TypeVar("KeyT", bound=Hashable)
ConnT = TypeVar("ConnT", bound=ControlConnection)


class ControlConnections(Generic[KeyT, ConnT]):
    """A source's control connections, one per sink: reused while alive, replaced once dead.

    A connection connects under the pool's lock, so two transfers to one new sink share
    one connection; a dying connection calls :meth:`forget` itself.
    """

    def __init__(self) -> None:
        self._conns: dict[KeyT, ConnT] = {}
        self._lock = threading.Lock()

    def get(self, key: KeyT, connect: Callable[[], ConnT]) -> ConnT:
        """The live connection to ``key``, made by ``connect`` when there is none."""
        with self._lock:
            conn = self._conns.get(key)
            if conn is None or conn.dead is not None:
                conn = connect()
                self._conns[key] = conn
            return conn

    def forget(self, conn: ConnT) -> None:
        """Drop ``conn`` (it died or closed); a later :meth:`get` connects again."""
        with self._lock:
            for key, known in list(self._conns.items()):
                if known is conn:
                    del self._conns[key]

    def close(self) -> None:
        """Close every connection (outside the lock: each one calls :meth:`forget`)."""
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            conn.close()
