"""Sending end of the arena protocol (:mod:`topkv.transport.arena.protocol`).

:class:`ArenaSource` keeps one authenticated control connection per sink and the library
peer its driver attached through it; each transfer pipelines up to ``WRITE_WINDOW`` library
writes and sends a layer's frame header only once its write completed.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import socket
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Unpack

from topkv.transport import framing
from topkv.transport.arena.protocol import (
    WRITE_WINDOW,
    ArenaLayer,
    SourceDriver,
    control_record,
    parse_arena_address,
    read_hello,
)
from topkv.transport.base import OutgoingTransfer, TransferDescriptor, TransportMode
from topkv.transport.errors import (
    FrameRejected,
    PeerDied,
    TransferCancelled,
    TransferTimeout,
    TransportError,
)
from topkv.transport.stream.handshake import client_handshake
from topkv.transport.stream.options import SourceOptions, StreamSource
from topkv.transport.stream.receiving import error_from_ack, read_replies
from topkv.transport.stream.sending import (
    FINISH,
    ControlChannel,
    ControlConnections,
    QueuedOutgoing,
)


class _Connection(ControlChannel):
    """One control connection to a sink and the library peer attached through it."""

    def __init__(self, source: ArenaSource, host: str, port: int) -> None:
        self.source = source
        try:
            sock = socket.create_connection((host, port), timeout=source.connect_timeout)
        except OSError as exc:
            raise PeerDied(f"cannot connect to {source.name} sink at {host}:{port}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client_handshake(sock, source.secret)
            self.capacity, metadata = read_hello(sock)
            self.peer = source.driver.attach(metadata, host)
        except BaseException:
            sock.close()
            raise
        super().__init__(sock, source.io_timeout)
        self.lock = threading.Lock()
        self.replies: dict[int, queue.SimpleQueue[framing.Control | TransportError]] = {}
        self.abort = threading.Event()
        self.outgoing: set[_ArenaOutgoing] = set()
        threading.Thread(
            target=self._read_loop, name=f"{source.name}-src-read", daemon=True
        ).start()

    def expect(self, request_id: int) -> queue.SimpleQueue[framing.Control | TransportError]:
        return self._wait_for_reply(self.lock, self.replies, request_id, queue.SimpleQueue())

    def forget(self, request_id: int) -> None:
        with self.lock:
            self.replies.pop(request_id, None)

    def _read_loop(self) -> None:
        self._die(read_replies(self.sock, self._on_reply, self.source.name))

    def _on_reply(self, message: framing.Control) -> None:
        with self.lock:
            replies = self.replies.get(message.request_id)
        if replies is not None:
            replies.put(message)

    def _die(self, error: TransportError) -> None:
        with self.lock:
            if self.dead is None:
                self.dead = error
            replies, self.replies = self.replies, {}
            outgoing, self.outgoing = self.outgoing, set()
        self.abort.set()
        for waiting in replies.values():
            waiting.put(error)
        for transfer in outgoing:  # fail at once, even while a library call is stuck
            transfer.fail(error)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.source.forget(self)
        with contextlib.suppress(Exception):
            self.source.driver.detach(self.peer)

    def close(self) -> None:
        self._die(PeerDied(f"{self.source.name} source closed"))


class _ArenaOutgoing(QueuedOutgoing[ArenaLayer]):
    def __init__(self, conn: _Connection, descriptor: TransferDescriptor) -> None:
        super().__init__(descriptor)
        self._conn = conn
        self._driver = conn.source.driver
        self._replies = conn.expect(descriptor.request_id)
        with conn.lock:
            conn.outgoing.add(self)
        threading.Thread(target=self._run, name=f"{conn.source.name}-send", daemon=True).start()

    def _check(self, layer: int, tensors: Sequence[Any], crcs: Sequence[int] | None) -> ArenaLayer:
        return self._driver.check(self.descriptor, layer, tensors, crcs)

    def cancel(self) -> None:
        if self._fail(TransferCancelled(f"request {self.descriptor.request_id} cancelled")):
            with contextlib.suppress(TransportError, OSError):
                self._conn.send(
                    control_record(framing.ControlKind.CANCEL, self.descriptor.request_id)
                )
        self._queue.put(FINISH)

    def _fail(self, error: BaseException) -> bool:
        with self._lock:
            if self._future.done():
                return False
            self._future.set_exception(error)
            return True

    def fail(self, error: TransportError) -> None:
        """Called by the connection when it dies."""
        self._fail(error)
        self._queue.put(FINISH)

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
        """Library writes of up to ``WRITE_WINDOW`` layers in flight; CRCs computed meanwhile.

        Headers go out in queue order, each only after its layer's write completed, and
        as soon as it completed when the producer has nothing more queued yet (so
        ``on_layer`` fires at the receiver without waiting for later layers).
        """
        conn, source, layout = self._conn, self._conn.source, self.descriptor.layout
        pending: collections.deque[tuple[ArenaLayer, Future[None], tuple[int, ...]]]
        pending = collections.deque()
        finishing = False
        while True:
            if pending and (finishing or len(pending) >= WRITE_WINDOW or self._queue.empty()):
                item, write, crcs = pending.popleft()
                try:
                    write.result(source.io_timeout + 5)
                except TimeoutError:
                    raise TransferTimeout(
                        f"library write of layer {item.layer} did not complete in time"
                    ) from None
                conn.send(framing.encode_layer_header(self.descriptor, item.layer, crcs))
                continue
            if finishing or self._future.done():
                break
            entry = self._queue.get()
            if entry is FINISH:
                finishing = True  # send the headers of the writes still in flight, then stop
                continue
            if self._future.done():
                break
            assert isinstance(entry, ArenaLayer)
            base = offset + entry.layer * layout.layer_bytes
            pieces = [
                (tensor, base + index * layout.tensor_bytes)
                for index, tensor in enumerate(entry.tensors)
            ]
            write = source.executor().submit(
                self._driver.write, conn.peer, pieces, source.io_timeout, conn.abort
            )
            crcs = entry.crcs or tuple(self._driver.crc(t) for t in entry.tensors)
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
            conn.send(control_record(framing.ControlKind.DONE, rid))
            reply = self._reply(source.ack_timeout, "ack")
            if reply.kind != framing.ControlKind.ACK or reply.status != framing.ControlStatus.OK:
                raise error_from_ack(reply)
            self._succeed(source.name, source.mode)
        except TransportError as exc:
            self._fail(exc)
        except OSError as exc:
            self._fail(PeerDied(f"{source.name} transfer failed: {exc}"))
        finally:
            conn.forget(rid)
            with conn.lock:
                conn.outgoing.discard(self)


#: Control-channel options every arena transport's source passes on to :class:`ArenaSource`.
ArenaSourceOptions = SourceOptions


class ArenaSource(StreamSource):
    """Sends KV to :class:`ArenaSink` instances through a library's one-sided writes."""

    name = "arena"
    mode = TransportMode.TCP

    def __init__(
        self,
        driver: SourceDriver,
        secret: bytes,
        *,
        scheme: str,
        **options: Unpack[SourceOptions],
    ) -> None:
        super().__init__(secret, **options)
        self.driver = driver
        self.scheme = scheme
        self._conns: ControlConnections[tuple[str, int], _Connection] = ControlConnections()
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    def executor(self) -> ThreadPoolExecutor:
        """Threads that run library writes (shared by this source's transfers)."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=2 * WRITE_WINDOW, thread_name_prefix=f"{self.name}-write"
                )
            return self._executor

    def _connection(self, destination: str) -> _Connection:
        key = parse_arena_address(destination, self.scheme)
        return self._conns.get(key, lambda: _Connection(self, *key))

    def forget(self, conn: _Connection) -> None:
        self._conns.forget(conn)

    def open(self, descriptor: TransferDescriptor, destination: str) -> OutgoingTransfer:
        framing.validate_layout(descriptor.layout)
        return _ArenaOutgoing(self._connection(destination), descriptor)

    def close(self) -> None:
        self._conns.close()
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        self.driver.close()
