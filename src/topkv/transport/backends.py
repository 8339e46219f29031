"""Transports backed by existing engines (NIXL, Mooncake Transfer Engine, CUDA IPC).

These engines move bytes one-sidedly: the initiator *writes* into memory the target has
registered. TopKV maps that onto its contract (:mod:`topkv.transport.base`) the same way for
every engine, with a small control channel beside the engine's data path:

* The sink owns a registered **arena** (host memory for NIXL and Mooncake, a device tensor
  for CUDA) and listens on an authenticated TCP control socket (the HMAC handshake of
  :mod:`topkv.transport.handshake`). Its address is ``<engine>://host:port``.
* After the handshake the sink sends an *engine hello*: the arena size and the engine's own
  metadata (NIXL agent metadata, the Mooncake P2P session, a CUDA IPC handle).
* Per transfer the source sends the transfer header; the sink reserves a region of the arena
  and answers ``USE_SEGMENT(offset)`` (or a failed ACK when it cannot).
* Per layer the source has the **engine** write K and V into the region, waits for the
  engine's completion, then sends the wire format's per-layer frame header (CRC-64 of each
  tensor) on the control socket. The sink verifies the landed bytes against those CRCs and
  calls ``on_layer``. ``DONE`` -> the sink ACKs; the source's future resolves.
* ``ReceivedKV.layers`` are views into the arena; ``release()`` returns the region.

Death of either side closes the control socket: every pending future fails with
``PeerDied`` at once, even when an engine call is stuck (the engine call is abandoned on its
thread, bounded by the transport's I/O timeout).

This module also holds :func:`private_netns` (NIXL and Mooncake bind every interface for
their data ports, so tests and benchmarks run them in a loopback-only network namespace) and
registers ``nixl``, ``mooncake`` and ``cuda`` with :mod:`topkv.transport.registry`.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import importlib.util
import itertools
import json
import logging
import mmap
import os
import queue
import shutil
import socket
import struct
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypedDict

from topkv import wire
from topkv.transport import framing
from topkv.transport.base import (
    LayerCallback,
    LayerTensors,
    OutgoingTransfer,
    ReceivedKV,
    TransferDescriptor,
    TransferResult,
    TransferSink,
    TransferSource,
    TransportMode,
)
from topkv.transport.errors import (
    AuthenticationFailed,
    ChecksumMismatch,
    FrameRejected,
    PeerDied,
    ResourceExhausted,
    TransferCancelled,
    TransferTimeout,
    TransportError,
    TransportUnavailable,
)
from topkv.transport.handshake import client_handshake, server_handshake
from topkv.transport.receiving import (
    LayerMessage,
    ReceiveTable,
    TransferMessage,
    carve_layers,
    error_from_ack,
    read_message,
    status_for,
)
from topkv.transport.sending import QueuedOutgoing, check_layer
from topkv.transport.sockio import recv_exactly, send_buffers

log = logging.getLogger(__name__)

ARENA_ALIGN = 4096
HELLO_MAGIC = b"TKVENG01"
_HELLO = struct.Struct("<8sQI")  # magic, arena capacity, metadata length
MAX_METADATA_BYTES = 1 << 20
WRITE_WINDOW = 2  # engine writes in flight per transfer
_KEY_OFFSET = 16  # request key position in the wire header (see topkv.wire.header)
_KEY_END = _KEY_OFFSET + 16

# -- engine interfaces ---------------------------------------------------------------------


@dataclass(frozen=True)
class EngineLayer:
    """One validated layer queued for an engine write (tensors in the engine's own type)."""

    layer: int
    tensors: tuple[Any, ...]
    crcs: tuple[int, ...] | None


class SinkEngine(ABC):
    """Target side of an engine: a registered arena and what a source needs to reach it."""

    capacity: int

    @abstractmethod
    def metadata(self) -> bytes:
        """Opaque bytes a source passes to :meth:`SourceEngine.attach`."""

    @abstractmethod
    def crc(self, offset: int, nbytes: int) -> int:
        """CRC-64 of arena bytes ``[offset, offset + nbytes)``."""

    @abstractmethod
    def carve(self, offset: int, descriptor: TransferDescriptor) -> list[LayerTensors]:
        """Per-layer views of a transfer's region of the arena."""

    @abstractmethod
    def close(self) -> None:
        """Deregister the arena and shut the engine down."""


class SourceEngine(ABC):
    """Initiator side of an engine."""

    @abstractmethod
    def check(
        self,
        descriptor: TransferDescriptor,
        layer: int,
        tensors: Sequence[Any],
        crcs: Sequence[int] | None,
    ) -> EngineLayer:
        """Validate a ``send_layer`` call (raises ``FrameRejected``)."""

    @abstractmethod
    def crc(self, tensor: Any) -> int:
        """CRC-64 of one tensor as :meth:`check` returned it."""

    @abstractmethod
    def attach(self, metadata: bytes, host: str) -> Any:
        """Make the sink described by ``metadata`` (on ``host``) writable; returns a peer."""

    @abstractmethod
    def write(
        self, peer: Any, pieces: Sequence[tuple[Any, int]], timeout: float, abort: threading.Event
    ) -> None:
        """Write each ``(tensor, arena offset)`` into the peer's arena; return when complete.

        Raises ``TransferTimeout`` after ``timeout`` seconds, ``PeerDied`` when ``abort`` is
        set (the control channel died) or the engine reports a failure.
        """

    @abstractmethod
    def detach(self, peer: Any) -> None:
        """Forget a peer (its sink went away)."""

    @abstractmethod
    def close(self) -> None:
        """Shut the engine down."""


# -- host arena ----------------------------------------------------------------------------


class Arena:
    """First-fit allocator of aligned regions in ``[0, capacity)``; waits for space."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)]  # (offset, size), sorted
        self._cond = threading.Condition()
        self._closed = False

    def allocate(self, nbytes: int, timeout: float) -> int:
        size = -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN
        if size > self.capacity:
            raise FrameRejected(
                f"transfer of {nbytes} bytes exceeds the sink's arena of {self.capacity} bytes"
            )
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed:
                    raise TransferCancelled("sink is closed")
                for index, (offset, free) in enumerate(self._free):
                    if free >= size:
                        if free == size:
                            del self._free[index]
                        else:
                            self._free[index] = (offset + size, free - size)
                        return offset
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ResourceExhausted(
                        f"no {nbytes}-byte region free in the sink's arena within {timeout} s; "
                        "the receiver must release() received KV"
                    )
                self._cond.wait(left)

    def free(self, offset: int, nbytes: int) -> None:
        size = -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN
        with self._cond:
            self._free.append((offset, size))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for start, length in self._free:
                if merged and merged[-1][0] + merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((start, length))
            self._free = merged
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class HostArena:
    """Anonymous, page-aligned host memory for a sink engine to register."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise TransportError(f"arena capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.map = mmap.mmap(-1, capacity, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        self.view = memoryview(self.map)
        self.address = buffer_address(self.view)

    def crc(self, offset: int, nbytes: int) -> int:
        return framing.crc64(self.view[offset : offset + nbytes])

    def carve(self, offset: int, descriptor: TransferDescriptor) -> list[LayerTensors]:
        total = descriptor.layout.total_bytes
        return carve_layers(self.view[offset : offset + total].toreadonly(), descriptor)

    def close(self) -> None:
        self.view.release()
        with contextlib.suppress(BufferError):
            self.map.close()  # views handed out and not yet dropped keep it mapped


class HostSinkEngine(SinkEngine):
    """A sink engine whose arena is a :class:`HostArena` (NIXL, Mooncake).

    Subclasses start their engine, call ``super().__init__(capacity)``, register
    ``self.arena`` with the engine and undo that registration in :meth:`deregister`.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.arena = HostArena(capacity)
        self._closed = False

    def crc(self, offset: int, nbytes: int) -> int:
        return self.arena.crc(offset, nbytes)

    def carve(self, offset: int, descriptor: TransferDescriptor) -> list[LayerTensors]:
        return self.arena.carve(offset, descriptor)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.deregister()
        self.arena.close()

    @abstractmethod
    def deregister(self) -> None:
        """Drop the engine's registration of the arena (once, before the arena is freed)."""


class HostSourceEngine(SourceEngine):
    """A source engine that writes host buffers (NIXL, Mooncake): checked as byte views."""

    def check(
        self,
        descriptor: TransferDescriptor,
        layer: int,
        tensors: Sequence[Any],
        crcs: Sequence[int] | None,
    ) -> EngineLayer:
        item = check_layer(descriptor, layer, tensors, crcs)
        return EngineLayer(item.layer, item.tensors, item.crcs)

    def crc(self, tensor: Any) -> int:
        return framing.crc64(tensor)


def buffer_address(view: memoryview) -> int:
    """Virtual address of a C-contiguous buffer's first byte (read-only buffers too)."""
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


# -- control channel helpers ---------------------------------------------------------------


def parse_engine_address(address: str, scheme: str) -> tuple[str, int]:
    prefix = f"{scheme}://"
    if not address.startswith(prefix):
        raise TransportError(f"not a {scheme} address: {address!r} (expected {prefix}host:port)")
    host, sep, port = address[len(prefix) :].rpartition(":")
    if not sep or not port.isdigit():
        raise TransportError(f"bad {scheme} address {address!r} (expected {prefix}host:port)")
    return host.strip("[]"), int(port)


def _send_hello(sock: socket.socket, capacity: int, metadata: bytes) -> None:
    send_buffers(sock, [_HELLO.pack(HELLO_MAGIC, capacity, len(metadata)), metadata])


def _read_hello(sock: socket.socket) -> tuple[int, bytes]:
    magic, capacity, length = _HELLO.unpack(recv_exactly(sock, _HELLO.size, "engine hello"))
    if magic != HELLO_MAGIC:
        raise FrameRejected(f"bad engine hello magic {magic!r}")
    if length > MAX_METADATA_BYTES:
        raise FrameRejected(f"engine metadata of {length} bytes exceeds {MAX_METADATA_BYTES}")
    return capacity, recv_exactly(sock, length, "engine metadata")


def _control(kind: framing.ControlKind, request_id: int = 0, **kw: Any) -> bytes:
    return framing.encode_control(framing.Control(kind, request_id, **kw))


# -- sink ----------------------------------------------------------------------------------


@dataclass
class _Incoming:
    descriptor: TransferDescriptor
    offset: int
    layers: list[LayerTensors]
    arrived: set[int] = field(default_factory=set)
    error: TransportError | None = None


class EngineSinkOptions(TypedDict, total=False):
    """Control-channel options every engine's sink passes on to :class:`EngineSink`."""

    port: int
    on_layer: LayerCallback | None
    limits: framing.ReceiveLimits | None
    io_timeout: float
    verify: bool


class EngineSink(TransferSink):
    """Receives KV written by an engine into this sink's arena (see the module docstring)."""

    name = "engine"
    mode = TransportMode.TCP

    def __init__(
        self,
        engine: SinkEngine,
        secret: bytes,
        *,
        scheme: str,
        host: str = "127.0.0.1",
        port: int = 0,
        on_layer: LayerCallback | None = None,
        limits: framing.ReceiveLimits | None = None,
        io_timeout: float = 30.0,
        handshake_timeout: float = 5.0,
        verify: bool = True,
    ) -> None:
        self.engine = engine
        self._secret = secret
        self._scheme = scheme
        self._on_layer = on_layer
        self._limits = limits or framing.ReceiveLimits()
        self._io_timeout = io_timeout
        self._handshake_timeout = handshake_timeout
        self._verify = verify
        self._arena = Arena(engine.capacity)
        self._table = ReceiveTable()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener = socket.create_server((host, port))
        self._host = host
        self._port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept_loop, name=f"{scheme}-accept", daemon=True).start()

    @property
    def address(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{self._scheme}://{host}:{self._port}"

    def receive(self, request_id: int) -> Future[ReceivedKV]:
        return self._table.receive(request_id)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._arena.close()
        self._table.close()
        self.engine.close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.add(conn)
        session = _SinkSession(self, conn)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self._handshake_timeout)
            try:
                server_handshake(conn, self._secret)
                _send_hello(conn, self.engine.capacity, self.engine.metadata())
            except (AuthenticationFailed, TransportError, OSError) as exc:
                log.warning("%s sink: refused a connection: %s", self._scheme, exc)
                return
            session.run()
        finally:
            session.end()
            with self._lock:
                self._conns.discard(conn)
            conn.close()


class _SinkSession:
    """Receiver side of one control connection."""

    def __init__(self, sink: EngineSink, conn: socket.socket) -> None:
        self.sink = sink
        self.conn = conn
        self.send_lock = threading.Lock()
        self.transfers: dict[int, _Incoming] = {}
        self.by_key: dict[bytes, _Incoming] = {}
        self.alive = True

    def send(self, record: bytes) -> None:
        with self.send_lock:
            if self.alive:
                with contextlib.suppress(TransportError, OSError):
                    send_buffers(self.conn, [record])

    def run(self) -> None:
        sink = self.sink
        try:
            while not sink._closed.is_set():
                self.conn.settimeout(sink._io_timeout if self.transfers else None)
                message = read_message(self.conn, sink._limits)
                if isinstance(message, TransferMessage):
                    self._open(message)
                elif isinstance(message, LayerMessage):
                    self._layer(message)
                else:
                    self._control(message)
        except (PeerDied, TransferTimeout, FrameRejected) as exc:
            self._fail_all(type(exc)(f"{sink._scheme} sender: {exc}"))
        except OSError as exc:
            self._fail_all(PeerDied(f"{sink._scheme} control connection failed: {exc}"))

    def _fail_all(self, error: TransportError) -> None:
        for state in list(self.transfers.values()):
            rid = state.descriptor.request_id
            got, total = len(state.arrived), state.descriptor.layout.num_layers
            self._drop(state)
            self.sink._table.fail(
                rid, type(error)(f"request {rid}: {error} (after {got}/{total} layers)")
            )

    def end(self) -> None:
        self.alive = False
        self._fail_all(PeerDied(f"{self.sink._scheme} sender went away"))

    def _drop(self, state: _Incoming) -> None:
        rid = state.descriptor.request_id
        self.transfers.pop(rid, None)
        self.by_key.pop(wire.request_key(str(rid)), None)
        self.sink._arena.free(state.offset, state.descriptor.layout.total_bytes)

    def _open(self, message: TransferMessage) -> None:
        descriptor = message.descriptor
        rid = descriptor.request_id
        if message.streams != 1:
            raise FrameRejected(f"{self.sink._scheme} transfers use one stream")
        if rid in self.transfers:
            raise FrameRejected(f"request {rid} opened twice")
        try:
            self.sink._table.claimable(rid)
            offset = self.sink._arena.allocate(descriptor.layout.total_bytes, self.sink._io_timeout)
        except (ResourceExhausted, FrameRejected, TransferCancelled) as exc:
            self.send(_control(framing.ControlKind.ACK, rid, status=status_for(exc), text=str(exc)))
            return
        state = _Incoming(descriptor, offset, self.sink.engine.carve(offset, descriptor))
        self.transfers[rid] = state
        self.by_key[wire.request_key(str(rid))] = state
        self.send(
            _control(
                framing.ControlKind.USE_SEGMENT,
                rid,
                arg0=offset,
                arg1=descriptor.layout.total_bytes,
            )
        )

    def _layer(self, message: LayerMessage) -> None:
        state = self.by_key.get(bytes(message.raw[_KEY_OFFSET:_KEY_END]))
        if state is None:
            raise FrameRejected("layer frame for a request that is not open")
        header = framing.decode_layer_header(message.raw, state.descriptor)
        if header.layer in state.arrived:
            raise FrameRejected(f"request {header.request_id}: layer {header.layer} sent twice")
        state.arrived.add(header.layer)
        if state.error is not None:
            return
        layout = state.descriptor.layout
        if self.sink._verify:
            base = state.offset + header.layer * layout.layer_bytes
            for index, crc in enumerate(header.crcs):
                start = base + index * layout.tensor_bytes
                if self.sink.engine.crc(start, layout.tensor_bytes) != crc:
                    state.error = ChecksumMismatch(
                        f"request {header.request_id} layer {header.layer} tensor {index}: "
                        "CRC-64 mismatch"
                    )
                    return
        if self.sink._on_layer is not None:
            try:
                self.sink._on_layer(state.descriptor, header.layer, state.layers[header.layer])
            except Exception as exc:
                state.error = TransportError(f"on_layer callback raised: {exc!r}")

    def _control(self, control: framing.Control) -> None:
        rid = control.request_id
        if control.kind == framing.ControlKind.DONE:
            state = self.transfers.get(rid)
            if state is None:
                raise FrameRejected(f"DONE for request {rid}, which is not open")
            self._done(state)
        elif control.kind == framing.ControlKind.CANCEL:
            state = self.transfers.get(rid)
            if state is not None:
                self._drop(state)
                self.sink._table.fail(rid, TransferCancelled(f"sender cancelled request {rid}"))
        else:
            raise FrameRejected(f"unexpected control record {control.kind.name} from a sender")

    def _done(self, state: _Incoming) -> None:
        rid = state.descriptor.request_id
        missing = state.descriptor.layout.num_layers - len(state.arrived)
        if state.error is None and missing:
            state.error = FrameRejected(f"request {rid}: {missing} layers never arrived")
        if state.error is not None:
            error = state.error
            self._drop(state)
            self.send(
                _control(framing.ControlKind.ACK, rid, status=status_for(error), text=str(error))
            )
            self.sink._table.fail(rid, error)
            return
        self.transfers.pop(rid, None)
        self.by_key.pop(wire.request_key(str(rid)), None)
        arena, offset, size = self.sink._arena, state.offset, state.descriptor.layout.total_bytes

        def release() -> None:
            arena.free(offset, size)

        self.send(_control(framing.ControlKind.ACK, rid))
        self.sink._table.complete(
            ReceivedKV(state.descriptor, state.layers, self.sink._verify, release)
        )


# -- source --------------------------------------------------------------------------------


class _Connection:
    """One control connection to a sink and the engine peer attached through it."""

    def __init__(self, source: EngineSource, host: str, port: int) -> None:
        self.source = source
        try:
            self.sock = socket.create_connection((host, port), timeout=source.connect_timeout)
        except OSError as exc:
            raise PeerDied(f"cannot connect to {source.name} sink at {host}:{port}: {exc}") from exc
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client_handshake(self.sock, source.secret)
            self.capacity, metadata = _read_hello(self.sock)
            self.peer = source.engine.attach(metadata, host)
        except BaseException:
            self.sock.close()
            raise
        self.sock.settimeout(source.io_timeout)
        self.send_lock = threading.Lock()
        self.lock = threading.Lock()
        self.replies: dict[int, queue.SimpleQueue[framing.Control | TransportError]] = {}
        self.dead: TransportError | None = None
        self.abort = threading.Event()
        self.outgoing: set[_EngineOutgoing] = set()
        threading.Thread(
            target=self._read_loop, name=f"{source.name}-src-read", daemon=True
        ).start()

    def send(self, *records: bytes) -> None:
        with self.send_lock:
            if self.dead is not None:
                raise self.dead
            send_buffers(self.sock, records)

    def expect(self, request_id: int) -> queue.SimpleQueue[framing.Control | TransportError]:
        replies: queue.SimpleQueue[framing.Control | TransportError] = queue.SimpleQueue()
        with self.lock:
            if self.dead is not None:
                raise self.dead
            self.replies[request_id] = replies
        return replies

    def forget(self, request_id: int) -> None:
        with self.lock:
            self.replies.pop(request_id, None)

    def _read_loop(self) -> None:
        try:
            self.sock.settimeout(None)  # the sink speaks only in reply; EOF means death
            while True:
                message = read_message(self.sock, framing.ReceiveLimits())
                if not isinstance(message, framing.Control):
                    raise FrameRejected(f"sink sent an unexpected record {message!r}")
                with self.lock:
                    replies = self.replies.get(message.request_id)
                if replies is not None:
                    replies.put(message)
        except TransportError as exc:
            self._die(PeerDied(f"{self.source.name} sink went away: {exc}"))
        except OSError as exc:
            self._die(PeerDied(f"{self.source.name} sink went away: {exc}"))

    def _die(self, error: TransportError) -> None:
        with self.lock:
            if self.dead is None:
                self.dead = error
            replies, self.replies = self.replies, {}
            outgoing, self.outgoing = self.outgoing, set()
        self.abort.set()
        for waiting in replies.values():
            waiting.put(error)
        for transfer in outgoing:  # fail at once, even while an engine call is stuck
            transfer.fail(error)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.source.forget(self)
        with contextlib.suppress(Exception):
            self.source.engine.detach(self.peer)

    def close(self) -> None:
        self._die(PeerDied(f"{self.source.name} source closed"))


_FINISH = object()


class _EngineOutgoing(QueuedOutgoing[EngineLayer]):
    def __init__(self, conn: _Connection, descriptor: TransferDescriptor) -> None:
        super().__init__(descriptor)
        self._conn = conn
        self._engine = conn.source.engine
        self._queue: queue.SimpleQueue[EngineLayer | object] = queue.SimpleQueue()
        self._started = time.perf_counter()
        self._replies = conn.expect(descriptor.request_id)
        with conn.lock:
            conn.outgoing.add(self)
        threading.Thread(target=self._run, name=f"{conn.source.name}-send", daemon=True).start()

    def _check(self, layer: int, tensors: Sequence[Any], crcs: Sequence[int] | None) -> EngineLayer:
        return self._engine.check(self.descriptor, layer, tensors, crcs)

    def _enqueue(self, item: EngineLayer) -> None:
        self._queue.put(item)

    def _enqueue_finish(self) -> None:
        self._queue.put(_FINISH)

    def cancel(self) -> None:
        if self._fail(TransferCancelled(f"request {self.descriptor.request_id} cancelled")):
            with contextlib.suppress(TransportError, OSError):
                self._conn.send(_control(framing.ControlKind.CANCEL, self.descriptor.request_id))
        self._queue.put(_FINISH)

    def _fail(self, error: BaseException) -> bool:
        with self._lock:
            if self._future.done():
                return False
            self._future.set_exception(error)
            return True

    def fail(self, error: TransportError) -> None:
        """Called by the connection when it dies."""
        self._fail(error)
        self._queue.put(_FINISH)

    def _reply(self, timeout: float, what: str) -> framing.Control:
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise TransferTimeout(
                f"no {what} for request {self.descriptor.request_id} within {timeout} s"
            ) from None
        if isinstance(reply, TransportError):
            raise reply
        return reply

    def _pipeline(self, offset: int) -> None:
        """Engine writes of up to ``WRITE_WINDOW`` layers in flight; CRCs computed meanwhile.

        Headers go out in queue order, each only after its layer's write completed, and
        as soon as it completed when the producer has nothing more queued yet (so
        ``on_layer`` fires at the receiver without waiting for later layers).
        """
        conn, source, layout = self._conn, self._conn.source, self.descriptor.layout
        pending: collections.deque[tuple[EngineLayer, Future[None], tuple[int, ...]]]
        pending = collections.deque()
        finishing = False
        while True:
            if pending and (finishing or len(pending) >= WRITE_WINDOW or self._queue.empty()):
                item, write, crcs = pending.popleft()
                try:
                    write.result(source.io_timeout + 5)
                except TimeoutError:
                    raise TransferTimeout(
                        f"engine write of layer {item.layer} did not complete in time"
                    ) from None
                conn.send(framing.encode_layer_header(self.descriptor, item.layer, crcs))
                continue
            if finishing or self._future.done():
                break
            entry = self._queue.get()
            if entry is _FINISH:
                finishing = True  # send the headers of the writes still in flight, then stop
                continue
            if self._future.done():
                break
            assert isinstance(entry, EngineLayer)
            base = offset + entry.layer * layout.layer_bytes
            pieces = [
                (tensor, base + index * layout.tensor_bytes)
                for index, tensor in enumerate(entry.tensors)
            ]
            write = source.executor().submit(
                self._engine.write, conn.peer, pieces, source.io_timeout, conn.abort
            )
            crcs = entry.crcs or tuple(self._engine.crc(t) for t in entry.tensors)
            pending.append((entry, write, crcs))
        for _item, write, _crcs in pending:  # a failure or cancel: let writes settle
            with contextlib.suppress(Exception):
                write.result(source.io_timeout + 5)

    def _run(self) -> None:
        conn, source = self._conn, self._conn.source
        rid = self.descriptor.request_id
        layout = self.descriptor.layout
        try:
            conn.send(framing.encode_transfer_header(self.descriptor))
            reply = self._reply(source.io_timeout, "arena region")
            if reply.kind != framing.ControlKind.USE_SEGMENT:
                raise error_from_ack(reply)
            offset = reply.arg0
            if offset + layout.total_bytes > conn.capacity:
                raise FrameRejected(f"sink offered region {offset} outside its arena")
            self._pipeline(offset)
            if self._future.done():
                return
            conn.send(_control(framing.ControlKind.DONE, rid))
            reply = self._reply(source.ack_timeout, "ack")
            if reply.kind != framing.ControlKind.ACK or reply.status != framing.ControlStatus.OK:
                raise error_from_ack(reply)
            seconds = time.perf_counter() - self._started
            with self._lock:
                if not self._future.done():
                    self._future.set_result(
                        TransferResult(
                            request_id=rid,
                            transport=source.name,
                            mode=source.mode,
                            size_bytes=layout.total_bytes,
                            seconds=seconds,
                            checksum_verified=True,
                            wall_seconds=seconds,
                        )
                    )
        except TransportError as exc:
            self._fail(exc)
        except OSError as exc:
            self._fail(PeerDied(f"{source.name} transfer failed: {exc}"))
        finally:
            conn.forget(rid)
            with conn.lock:
                conn.outgoing.discard(self)


class EngineSourceOptions(TypedDict, total=False):
    """Control-channel options every engine's source passes on to :class:`EngineSource`."""

    connect_timeout: float
    io_timeout: float
    ack_timeout: float


class EngineSource(TransferSource):
    """Sends KV to :class:`EngineSink` instances through an engine's one-sided writes."""

    name = "engine"
    mode = TransportMode.TCP

    def __init__(
        self,
        engine: SourceEngine,
        secret: bytes,
        *,
        scheme: str,
        connect_timeout: float = 5.0,
        io_timeout: float = 30.0,
        ack_timeout: float = 30.0,
    ) -> None:
        self.engine = engine
        self.secret = secret
        self.scheme = scheme
        self.connect_timeout = connect_timeout
        self.io_timeout = io_timeout
        self.ack_timeout = ack_timeout
        self._conns: dict[tuple[str, int], _Connection] = {}
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    def executor(self) -> ThreadPoolExecutor:
        """Threads that run engine writes (shared by this source's transfers)."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=2 * WRITE_WINDOW, thread_name_prefix=f"{self.name}-write"
                )
            return self._executor

    def _connection(self, destination: str) -> _Connection:
        key = parse_engine_address(destination, self.scheme)
        with self._lock:
            conn = self._conns.get(key)
            if conn is None or conn.dead is not None:
                conn = _Connection(self, *key)
                self._conns[key] = conn
            return conn

    def forget(self, conn: _Connection) -> None:
        with self._lock:
            for key, known in list(self._conns.items()):
                if known is conn:
                    del self._conns[key]

    def open(self, descriptor: TransferDescriptor, destination: str) -> OutgoingTransfer:
        framing.validate_layout(descriptor.layout)
        return _EngineOutgoing(self._connection(destination), descriptor)

    def close(self) -> None:
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            conn.close()
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        self.engine.close()


# -- private network namespace --------------------------------------------------------------

_agent_ids = itertools.count(1)


def unique_name(prefix: str) -> str:
    """A process-unique engine agent name."""
    return f"{prefix}-{os.getpid()}-{next(_agent_ids)}-{os.urandom(3).hex()}"


def netns_available() -> str | None:
    """None when a private network namespace can be made here, else the reason why not."""
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = subprocess.run(
        ["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.strip() or probe.returncode}"
    return None


class PrivateNetns:
    """A loopback-only network namespace held open by a sleeping process.

    ``command(argv)`` wraps a command so that it runs inside (``nsenter -t PID -n``); every
    process started that way shares the namespace, and nothing in it is reachable from
    outside. NIXL (UCX) and Mooncake bind every interface for their data ports, so tests and
    benchmarks run them in here.
    """

    def __init__(self) -> None:
        reason = netns_available()
        if reason is not None:
            raise TransportUnavailable(f"private network namespace unavailable: {reason}")
        self._holder = subprocess.Popen(
            ["unshare", "-n", "sh", "-c", "ip link set lo up && echo ready && exec sleep 86400"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._holder.stdout is not None
        if self._holder.stdout.readline().strip() != "ready":
            self.close()
            raise TransportUnavailable("the network namespace holder did not start")
        self.pid = self._holder.pid

    def command(self, argv: Sequence[str]) -> list[str]:
        return ["nsenter", "-t", str(self.pid), "-n", *argv]

    def close(self) -> None:
        if self._holder.poll() is None:
            self._holder.kill()
        self._holder.wait(10)

    def __enter__(self) -> PrivateNetns:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def private_netns() -> Iterator[PrivateNetns]:
    """``with private_netns() as ns: subprocess.run(ns.command([...]))``."""
    netns = PrivateNetns()
    try:
        yield netns
    finally:
        netns.close()


# -- availability and registration -----------------------------------------------------------

INSTALL_HINT = "install the optional peers with scripts/install-peers.sh"


def missing_package(transport: str) -> str | None:
    """None when ``transport``'s engine package is importable, else why it is not."""
    module = {"nixl": "nixl_cu12", "mooncake": "mooncake.engine", "cuda": "torch"}[transport]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        return f"{transport}: Python module {module} is not installed ({INSTALL_HINT})"
    if transport != "cuda":
        try:  # installed but unloadable (e.g. Mooncake without libibverbs1) counts as absent
            importlib.import_module(module)
        except (ImportError, OSError) as exc:
            return f"{transport}: {module} does not load ({exc}; {INSTALL_HINT})"
    if transport == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "cuda: torch.cuda.is_available() is False (no GPU or no CUDA build of torch)"
    return None


def make_source(transport: str, secret: bytes, **options: Any) -> TransferSource:
    """A source of ``transport`` (nixl | mooncake | cuda); TransportUnavailable if absent."""
    reason = missing_package(transport)
    if reason is not None:
        raise TransportUnavailable(reason)
    if transport == "nixl":
        from topkv.transport.nixl import NixlSource

        return NixlSource(secret, **options)
    if transport == "mooncake":
        from topkv.transport.mooncake import MooncakeSource

        return MooncakeSource(secret, **options)
    from topkv.transport.cuda import CudaSource

    return CudaSource(secret, **options)


def make_sink(transport: str, secret: bytes, **options: Any) -> TransferSink:
    """A sink of ``transport`` (nixl | mooncake | cuda); TransportUnavailable if absent."""
    reason = missing_package(transport)
    if reason is not None:
        raise TransportUnavailable(reason)
    if transport == "nixl":
        from topkv.transport.nixl import NixlSink

        return NixlSink(secret, **options)
    if transport == "mooncake":
        from topkv.transport.mooncake import MooncakeSink

        return MooncakeSink(secret, **options)
    from topkv.transport.cuda import CudaSink

    return CudaSink(secret, **options)


ENGINE_TRANSPORTS: dict[str, tuple[TransportMode, str]] = {
    "nixl": (TransportMode.RDMA, "NIXL agent, UCX backend (optional extra)"),
    "mooncake": (TransportMode.TCP, "Mooncake Transfer Engine, TCP protocol (optional extra)"),
    "cuda": (TransportMode.NVLINK, "CUDA peer copies and IPC through PyTorch (needs a GPU)"),
}


def register_all() -> None:
    """Add nixl, mooncake and cuda to :mod:`topkv.transport.registry` (idempotent)."""
    from topkv.transport import registry

    for name, (mode, description) in ENGINE_TRANSPORTS.items():
        reason = missing_package(name)
        registry.register(
            registry.TransportInfo(
                name=name,
                mode=mode,
                emulated=False,
                make_source=_factory(make_source, name),
                make_sink=_factory(make_sink, name),
                description=description + (f" - unavailable: {reason}" if reason else ""),
            )
        )


def _factory(make: Callable[..., Any], name: str) -> Callable[[bytes], Any]:
    return lambda secret: make(name, secret)


def describe_peers() -> dict[str, str]:
    """Transport name -> "available" or the reason it is not (for CLIs and docs)."""
    return {name: missing_package(name) or "available" for name in ENGINE_TRANSPORTS}


def dumps_metadata(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields, sort_keys=True).encode()


def loads_metadata(data: bytes, required: Sequence[str]) -> dict[str, Any]:
    try:
        fields = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FrameRejected(f"engine metadata is not JSON: {exc}") from exc
    if not isinstance(fields, dict) or any(key not in fields for key in required):
        raise FrameRejected(f"engine metadata lacks one of {list(required)}")
    return fields


# -- two-process peer (tests and benchmarks run each side as ``python -m`` of this module) --


def _kv_data(total_bytes: int, seed: int) -> Any:
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, total_bytes, dtype=np.uint8)


def kv_digest(layers: Sequence[LayerTensors]) -> str:
    """SHA-256 of every tensor's bytes in layer order (what a bit-exact copy must match)."""
    import hashlib

    digest = hashlib.sha256()
    for tensors in layers:
        for tensor in tensors:
            if hasattr(tensor, "cpu"):  # a torch tensor (the cuda transport's device views)
                digest.update(tensor.cpu().numpy())
            else:
                digest.update(tensor)
    return digest.hexdigest()


def expected_digest(total_bytes: int, seed: int) -> str:
    """The digest :func:`peer_send` data of ``seed`` must arrive with."""
    import hashlib

    return hashlib.sha256(_kv_data(total_bytes, seed).tobytes()).hexdigest()


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def peer_sink(
    transport: str,
    secret: bytes,
    options: dict[str, Any],
    first: int,
    count: int,
    digest_all: bool = True,
) -> None:
    """Print ``ADDRESS <sink address>``, ``LAYER <rid> <layer>`` per verified layer, then
    one JSON line per received request ``first..`` (with the SHA-256 of its bytes; only for
    the last one when ``digest_all`` is false, which keeps benchmarks' timings clean)."""

    def announce(descriptor: TransferDescriptor, layer: int, tensors: LayerTensors) -> None:
        print(f"LAYER {descriptor.request_id} {layer}", flush=True)

    sink = make_sink(transport, secret, on_layer=announce, **options)
    print(f"ADDRESS {sink.address}", flush=True)  # engines may log to stdout too
    try:
        for rid in range(first, first + count):
            try:
                kv = sink.receive(rid).result(120)
            except TransportError as exc:
                _emit({"rid": rid, "ok": False, "error": type(exc).__name__, "message": str(exc)})
                continue
            last = rid == first + count - 1
            digest = kv_digest(kv.layers) if digest_all or last else None
            _emit({"rid": rid, "ok": True, "sha256": digest})
            kv.release()
        import sys

        sys.stdin.readline()  # hold the sink until the driver says so (or closes stdin)
    finally:
        sink.close()


def peer_send(
    transport: str,
    address: str,
    secret: bytes,
    seed: int,
    layout_fields: dict[str, Any],
    mode: str,
    repeat: int,
    options: dict[str, Any],
    from_device: int | None = None,
) -> None:
    """Send ``repeat`` transfers (request ids ``seed..``) and print one JSON line each.

    ``mode``: ``ok``; ``corrupt`` (last layer changed after its CRC was taken);
    ``hang-after-2`` (print SENT2 after two layers, then sleep: the driver kills us);
    ``wait-before-2`` (print WAITING after the first transfer; go on at a line on stdin).
    """
    import sys

    from topkv.transport.base import KVLayout

    layout = KVLayout(**layout_fields)
    data = _kv_data(layout.total_bytes, seed)
    view: Any = data.data
    if from_device is not None:  # the cuda transport: send from GPU memory
        import torch

        data = torch.from_numpy(data).to(f"cuda:{from_device}")
        view = data
    size, per = layout.tensor_bytes, layout.tensors_per_layer
    source = make_source(transport, secret, **options)
    try:
        for rid in range(seed, seed + repeat):
            if mode == "wait-before-2" and rid == seed + 1:
                print("WAITING", flush=True)
                sys.stdin.readline()
            try:
                out = source.open(TransferDescriptor(rid, "test-model", layout), address)
                for layer in range(layout.num_layers):
                    tensors = [
                        view[(layer * per + t) * size : (layer * per + t + 1) * size]
                        for t in range(per)
                    ]
                    crcs = None
                    if mode == "corrupt" and layer == layout.num_layers - 1:
                        host = [t.cpu().numpy() if hasattr(t, "cpu") else t for t in tensors]
                        crcs = [framing.crc64(t) for t in host]
                        data[layer * layout.layer_bytes + 5] ^= 0xFF  # changed after the CRC
                    out.send_layer(layer, tensors, crcs)
                    if mode == "hang-after-2" and layer == 1:
                        print("SENT2", flush=True)
                        time.sleep(3600)
                result = out.finish().result(120)
                _emit({"rid": rid, "ok": True, "seconds": result.seconds, "gbps": result.gbps})
            except TransportError as exc:
                _emit({"rid": rid, "ok": False, "error": type(exc).__name__, "message": str(exc)})
    finally:
        source.close()


def _peer_main(argv: Sequence[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m topkv.transport.backends")
    sub = parser.add_subparsers(dest="role", required=True)
    sink = sub.add_parser("sink")
    sink.add_argument("transport")
    sink.add_argument("secret_hex")
    sink.add_argument("--first", type=int, default=1)
    sink.add_argument("--count", type=int, default=1)
    sink.add_argument("--options", default="{}")
    sink.add_argument("--digest-last-only", action="store_true")
    send = sub.add_parser("send")
    send.add_argument("transport")
    send.add_argument("address")
    send.add_argument("secret_hex")
    send.add_argument("seed", type=int)
    send.add_argument("layout_json")
    send.add_argument(
        "--mode", default="ok", choices=["ok", "corrupt", "hang-after-2", "wait-before-2"]
    )
    send.add_argument("--repeat", type=int, default=1)
    send.add_argument("--options", default="{}")
    send.add_argument("--from-device", type=int, default=None)
    args = parser.parse_args(argv)
    options = json.loads(args.options)
    if args.role == "sink":
        peer_sink(
            args.transport,
            bytes.fromhex(args.secret_hex),
            options,
            args.first,
            args.count,
            not args.digest_last_only,
        )
    else:
        peer_send(
            args.transport,
            args.address,
            bytes.fromhex(args.secret_hex),
            args.seed,
            json.loads(args.layout_json),
            args.mode,
            args.repeat,
            options,
            args.from_device,
        )


# -- ``topkv bench transfer --transport nixl|mooncake|cuda`` ---------------------------------


def memcpy_gbps(size: int, repeat: int) -> float:
    """One copy into a preallocated, faulted-in buffer: the same-host limit."""
    import statistics

    import numpy as np

    src = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    dst = np.ones(size, dtype=np.uint8)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        dst[:] = src
        times.append(time.perf_counter() - start)
    return size / statistics.median(times) / 1e9


def _raw_receiver(port_out: Any, size: int, repeat: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port_out.send(listener.getsockname()[1])
    buffer = memoryview(bytearray(size))
    peer, _ = listener.accept()
    with peer, listener:
        for _ in range(repeat):
            got = 0
            while got < size:
                n = peer.recv_into(buffer[got:])
                if n == 0:
                    return
                got += n
            peer.sendall(b"k")


def raw_socket_gbps(size: int, repeat: int) -> float:
    """Blocking ``sendall`` -> ``recv_into`` a preallocated buffer between two processes."""
    import multiprocessing
    import statistics

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_raw_receiver, args=(child, size, repeat), daemon=True)
    proc.start()
    data = _kv_data(size, 2).data
    times = []
    try:
        with socket.create_connection(("127.0.0.1", parent.recv()), timeout=60) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(repeat):
                start = time.perf_counter()
                sock.sendall(data)
                if sock.recv(1) != b"k":
                    raise PeerDied("raw-socket receiver failed")
                times.append(time.perf_counter() - start)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return size / statistics.median(times) / 1e9


def run_engine_benchmark(
    transport: str, size_bytes: int, repeat: int = 5, options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``topkv bench transfer`` for nixl | mooncake | cuda, same JSON as the other media.

    Sink and sender are separate processes; nixl and mooncake run inside a private network
    namespace. The limit, measured in the same run, is one memcpy for same-host paths (nixl
    with UCX's default transports, cuda) and a raw blocking socket for TCP paths (mooncake,
    nixl with ``{"ucx_tls": "tcp"}``).
    """
    import statistics

    from topkv.transport.benchmark import bench_layout

    if transport not in ENGINE_TRANSPORTS:
        raise TransportUnavailable(
            f"{transport!r} is not an engine transport ({', '.join(ENGINE_TRANSPORTS)})"
        )
    reason = missing_package(transport)
    if reason is not None:
        raise TransportUnavailable(reason)
    options = dict(options or {})
    layout = bench_layout(size_bytes)
    size = layout.total_bytes
    tcp_path = transport == "mooncake" or options.get("ucx_tls") == "tcp"
    limit = raw_socket_gbps(size, repeat) if tcp_path else memcpy_gbps(size, repeat)
    options.setdefault("capacity_bytes", size + (1 << 20))
    sink_options = options
    send_options = {k: v for k, v in options.items() if k != "capacity_bytes"}
    if transport == "cuda":
        send_options = {}
    secret = os.urandom(32)
    netns = PrivateNetns() if transport != "cuda" else None
    try:
        sink, address = spawn_sink(
            netns, transport, secret, count=repeat + 1, options=sink_options, digest_all=False
        )
        try:
            sender = spawn_sender(
                netns,
                transport,
                address,
                secret,
                1,
                layout,
                repeat=repeat + 1,
                options=send_options,
            )
            try:
                sent = [sender.record(600) for _ in range(repeat + 1)]
                got = [sink.record(600) for _ in range(repeat + 1)]
            finally:
                sender.stop()
        finally:
            sink.stop()
    finally:
        if netns is not None:
            netns.close()
    failed = [r for r in sent + got if not r["ok"]]
    if failed:
        raise TransportError(f"{transport} benchmark transfer failed: {failed[0]}")
    if got[-1]["sha256"] != expected_digest(size, 1):
        raise ChecksumMismatch(f"{transport} benchmark: received bytes differ from the source")
    gbps = size / statistics.median(r["seconds"] for r in sent[1:]) / 1e9
    return {
        "transport": transport,
        "size_bytes": size,
        "gbps": round(gbps, 3),
        "limit_gbps": round(limit, 3),
        "ratio_to_limit": round(gbps / limit, 3),
        "checksum": "verified",
        "emulated": False,
    }


class PeerProcess:
    """A :func:`peer_sink` / :func:`peer_send` child process, read line by line."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def line(self, prefix: str, timeout: float) -> str:
        """The next stdout line starting with ``prefix`` (engines may log other lines)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self._lines.get(timeout=max(left, 0.001))
            except queue.Empty:
                raise TransferTimeout(f"peer printed no {prefix!r} line in {timeout} s") from None
            if line is None:
                raise PeerDied(f"peer exited ({self.proc.wait()}) before printing {prefix!r}")
            if line.startswith(prefix):
                return line

    def record(self, timeout: float) -> dict[str, Any]:
        """The next JSON record the peer printed."""
        parsed: dict[str, Any] = json.loads(self.line("{", timeout))
        return parsed

    def tell(self, text: str = "go") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def spawn_sink(
    netns: PrivateNetns | None,
    transport: str,
    secret: bytes,
    *,
    first: int = 1,
    count: int = 1,
    options: dict[str, Any] | None = None,
    python: str | None = None,
    digest_all: bool = True,
) -> tuple[PeerProcess, str]:
    """Start a sink peer (inside ``netns`` unless None); returns it and its address."""
    import sys

    argv = [python or sys.executable, "-m", "topkv.transport.backends", "sink", transport]
    argv += [secret.hex(), "--first", str(first), "--count", str(count)]
    argv += ["--options", json.dumps(options or {})]
    if not digest_all:
        argv.append("--digest-last-only")
    peer = PeerProcess(netns.command(argv) if netns is not None else argv)
    try:
        address = peer.line("ADDRESS ", 60).split(" ", 1)[1]
    except TransportError:
        peer.stop()
        raise
    return peer, address


def spawn_sender(
    netns: PrivateNetns | None,
    transport: str,
    address: str,
    secret: bytes,
    seed: int,
    layout: Any,
    *,
    mode: str = "ok",
    repeat: int = 1,
    options: dict[str, Any] | None = None,
    python: str | None = None,
    from_device: int | None = None,
) -> PeerProcess:
    """Start a sender peer (inside ``netns`` unless None; ``layout`` is a KVLayout)."""
    import dataclasses
    import sys

    argv = [python or sys.executable, "-m", "topkv.transport.backends", "send", transport]
    argv += [address, secret.hex(), str(seed), json.dumps(dataclasses.asdict(layout))]
    argv += ["--mode", mode, "--repeat", str(repeat), "--options", json.dumps(options or {})]
    if from_device is not None:
        argv += ["--from-device", str(from_device)]
    return PeerProcess(netns.command(argv) if netns is not None else argv)


if __name__ == "__main__":
    import sys

    _peer_main(sys.argv[1:])
