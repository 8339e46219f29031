"""The listening half every stream sink shares: listen, accept, authenticate, serve, close.

:class:`ListeningSink` is the skeleton of the ``shm``, ``tcp`` and arena sinks: it owns the
listening socket, the accept thread, one thread per connection and the
:class:`~topkv.transport.stream.receiving.ReceiveTable` that ``receive()`` reads. A connection is
served only after the HMAC handshake (:mod:`topkv.transport.stream.handshake`) passed within
``handshake_timeout``; a refused one is logged and closed. What an authenticated connection
carries is the subclass's (:meth:`ListeningSink._session`); the bulk data paths live there,
untouched by this module. ``close()`` stops accepting, shuts every connection down (their
sessions end and fail what they were receiving) and fails the transfers still pending.

:class:`ControlSession` is the receiving side of a connection that carries records only
(``shm`` and the arena transports: the bytes travel through a shared segment or a library's
writes): its read loop, serialized replies, and the failure of every transfer still open on
it when the connection fails.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Generic, Protocol, TypeVar, Unpack

from topkv import wire
from topkv.transport import framing
from topkv.transport.base import LayerTensors, ReceivedKV, TransferDescriptor, TransferSink
from topkv.transport.errors import (
    ChecksumMismatch,
    FrameRejected,
    PeerDied,
    TransferTimeout,
    TransportError,
)
from topkv.transport.stream.handshake import server_handshake
from topkv.transport.stream.options import (
    DEFAULT_HANDSHAKE_TIMEOUT,
    DEFAULT_IO_TIMEOUT,
    SinkOptions,
)
from topkv.transport.stream.receiving import (
    LayerMessage,
    ReceiveTable,
    TransferMessage,
    read_message,
)
from topkv.transport.stream.sockio import send_buffers
from topkv.wire.header import REQUEST_KEY_END, REQUEST_KEY_OFFSET

log = logging.getLogger(__name__)


class ListeningSink(TransferSink):
    """A sink that accepts authenticated stream connections and serves each on a thread.

    Subclasses call ``super().__init__`` first (with their :class:`SinkOptions`), set up
    their own state, then :meth:`_listen` with their bound, listening socket (which starts
    accepting).
    """

    def __init__(self, secret: bytes, *, label: str, **options: Unpack[SinkOptions]) -> None:
        self._secret = secret
        self._label = label  # names the threads and log lines: "shm", "tcp", "nixl", ...
        self._on_layer = options.get("on_layer")
        self._limits = options.get("limits") or framing.ReceiveLimits()
        self._io_timeout = options.get("io_timeout", DEFAULT_IO_TIMEOUT)
        self._handshake_timeout = options.get("handshake_timeout", DEFAULT_HANDSHAKE_TIMEOUT)
        self._verify = options.get("verify", True)
        self._table = ReceiveTable()
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()

    def _listen(self, listener: socket.socket) -> None:
        self._listener = listener
        threading.Thread(
            target=self._accept_loop, name=f"{self._label}-accept", daemon=True
        ).start()

    def receive(self, request_id: int) -> Future[ReceivedKV]:
        return self._table.receive(request_id)

    def close(self) -> None:
        if self._stop_listening():
            self._table.close()

    def _stop_listening(self) -> bool:
        """Stop accepting and shut every connection down; False when already closed."""
        if self._closed.is_set():
            return False
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        return True

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(
                target=self._serve, args=(conn,), name=f"{self._label}-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        with self._conns_lock:
            self._conns.add(conn)
        try:
            self._prepare(conn)
            conn.settimeout(self._handshake_timeout)
            try:
                server_handshake(conn, self._secret)
                self._greet(conn)
            except TransportError as exc:  # AuthenticationFailed, a timeout, a bad answer
                log.warning("%s sink: refused a connection: %s", self._label, exc)
                return
            self._session(conn)
        except OSError as exc:
            log.debug("%s sink connection ended: %s", self._label, exc)
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    def _prepare(self, conn: socket.socket) -> None:
        """Socket options of an accepted connection, set before the handshake."""

    def _greet(self, conn: socket.socket) -> None:
        """What an authenticated peer is told before its session starts."""

    @abstractmethod
    def _session(self, conn: socket.socket) -> None:
        """Serve one authenticated connection until it ends (or the sink closes)."""


def crc_mismatch(header: framing.LayerHeader, index: int) -> ChecksumMismatch:
    """The error of ``header``'s tensor ``index`` whose bytes fail their CRC-64."""
    return ChecksumMismatch(
        f"request {header.request_id} layer {header.layer} tensor {index}: CRC-64 mismatch"
    )


class OpenTransfer(Protocol):
    """What a session knows of each transfer open on it."""

    descriptor: TransferDescriptor
    arrived: set[int]
    error: TransportError | None


SinkT = TypeVar("SinkT", bound=ListeningSink)
StateT = TypeVar("StateT", bound=OpenTransfer)


class ControlSession(ABC, Generic[SinkT, StateT]):
    """Receiver side of one record-only control connection of a :class:`ListeningSink`.

    :meth:`run` reads records until the connection ends or the sink closes (with the I/O
    timeout while a transfer is open) and hands each to :meth:`_open`, :meth:`_layer` or
    :meth:`_control`; then :meth:`end`. A failed connection fails every transfer in
    ``transfers`` (after :meth:`_forget` of each) with the reason and its layer count.
    """

    def __init__(self, sink: SinkT, conn: socket.socket) -> None:
        self.sink = sink
        self.conn = conn
        self.transfers: dict[int, StateT] = {}
        #: The same transfers by the request key their layer frames carry.
        self.by_key: dict[bytes, StateT] = {}
        self.alive = True
        self._label = sink._label
        self._table = sink._table
        self._send_lock = threading.Lock()

    def send(self, record: bytes) -> None:
        """Send a reply unless the session ended (a dead peer needs no answer)."""
        with self._send_lock:
            if self.alive:
                with contextlib.suppress(TransportError, OSError):
                    send_buffers(self.conn, [record])

    def run(self) -> None:
        closed, limits, io_timeout = self.sink._closed, self.sink._limits, self.sink._io_timeout
        try:
            while not closed.is_set():
                self.conn.settimeout(io_timeout if self.transfers else None)
                message = read_message(self.conn, limits)
                if isinstance(message, TransferMessage):
                    self._open(message)
                elif isinstance(message, LayerMessage):
                    self._layer(message)
                else:
                    self._control(message)
        except (PeerDied, TransferTimeout, FrameRejected) as exc:
            self.fail_open(type(exc)(f"{self._label} sender: {exc}"))
        except OSError as exc:
            self.fail_open(PeerDied(f"{self._label} control connection failed: {exc}"))
        finally:
            self.end()

    def fail_open(self, error: TransportError) -> None:
        """Fail every transfer still open on this connection."""
        for state in list(self.transfers.values()):
            rid = state.descriptor.request_id
            got, total = len(state.arrived), state.descriptor.layout.num_layers
            self._forget(state)
            self._table.fail(
                rid, type(error)(f"request {rid}: {error} (after {got}/{total} layers)")
            )

    def end(self) -> None:
        """The connection is over: no more replies."""
        self.alive = False

    def _add(self, state: StateT) -> None:
        """Open ``state`` on this connection (in ``transfers`` and ``by_key``)."""
        rid = state.descriptor.request_id
        self.transfers[rid] = state
        self.by_key[wire.request_key(str(rid))] = state

    def _drop(self, state: StateT) -> None:
        """Remove ``state`` from this connection's open transfers."""
        rid = state.descriptor.request_id
        self.transfers.pop(rid, None)
        self.by_key.pop(wire.request_key(str(rid)), None)

    def _forget(self, state: StateT) -> None:
        """Drop ``state`` from the open transfers and give back what it holds."""
        self._drop(state)

    def _open_for(self, raw: bytes) -> StateT:
        """The open transfer a layer frame belongs to, by the request key it carries."""
        state = self.by_key.get(bytes(raw[REQUEST_KEY_OFFSET:REQUEST_KEY_END]))
        if state is None:
            raise FrameRejected("layer frame for a request that is not open")
        return state

    def _check_open(self, message: TransferMessage) -> int:
        """The request id ``message`` opens; FrameRejected unless it comes on one stream
        (records only here) and is not open on this connection already."""
        rid = message.descriptor.request_id
        if message.streams != 1:
            raise FrameRejected(f"{self._label} transfers use one stream")
        if rid in self.transfers:
            raise FrameRejected(f"request {rid} opened twice")
        return rid

    def _arrive(self, state: StateT, header: framing.LayerHeader) -> None:
        """Count ``header``'s layer as arrived; FrameRejected if it already had."""
        if header.layer in state.arrived:
            raise FrameRejected(f"request {header.request_id}: layer {header.layer} sent twice")
        state.arrived.add(header.layer)

    def _deliver(self, state: StateT, layer: int, tensors: LayerTensors) -> None:
        """Hand a layer that passed its checks to the sink's ``on_layer`` callback (none
        while the transfer holds an error); what the callback raises becomes that error."""
        on_layer = self.sink._on_layer
        if state.error is None and on_layer is not None:
            try:
                on_layer(state.descriptor, layer, tensors)
            except Exception as exc:
                state.error = TransportError(f"on_layer callback raised: {exc!r}")

    def _check_complete(self, state: StateT) -> None:
        """At DONE: a transfer missing layers (and no earlier error) fails FrameRejected."""
        missing = state.descriptor.layout.num_layers - len(state.arrived)
        if state.error is None and missing:
            state.error = FrameRejected(
                f"request {state.descriptor.request_id}: {missing} layers never arrived"
            )

    @abstractmethod
    def _open(self, message: TransferMessage) -> None: ...

    @abstractmethod
    def _layer(self, message: LayerMessage) -> None: ...

    @abstractmethod
    def _control(self, control: framing.Control) -> None: ...
