"""Shared-memory transport between processes on one host: one copy, read in place.

The sender copies each layer into a segment in ``/dev/shm`` that the receiver has mapped,
fusing the CRC-64 of the *source* into the copy (:mod:`topkv.transport.copying`: one pass
in C when the extension is built), so the receiver's check covers the copy too; the receiver
verifies each layer in place as its header arrives and hands out read-only views *into the
segment* (no second copy). A unix socket carries the control records (transfer header,
per-layer frame headers, acks, releases) and the same HMAC handshake as TCP.

Segments are named, created, mapped, unlinked at once and swept by
:mod:`topkv.transport.shm_segments` (which says why none leaks when either side crashes);
they are reused across transfers and loaned to the receiver from the OK ack until
``ReceivedKV.release()``.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import shutil
import socket
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Unpack

from topkv.transport import framing
from topkv.transport.base import (
    LayerTensors,
    OutgoingTransfer,
    ReceivedKV,
    TransferDescriptor,
    TransportMode,
)
from topkv.transport.copying import copy_into, copy_with_crc
from topkv.transport.errors import (
    FrameRejected,
    PeerDied,
    ResourceExhausted,
    TransferCancelled,
    TransferTimeout,
    TransportError,
    TransportUnavailable,
    wait_for_release,
)
from topkv.transport.shm_segments import (
    SEGMENT_DIR,
    create_segment,
    is_segment_name,
    map_segment,
    segment_name,
    sweep_stale_segments,
)
from topkv.transport.shm_segments import segments_of as segments_of  # for leak checks
from topkv.transport.stream.handshake import client_handshake
from topkv.transport.stream.listening import ControlSession, ListeningSink, crc_mismatch
from topkv.transport.stream.options import SinkOptions, SourceOptions, StreamSource
from topkv.transport.stream.receiving import (
    LayerMessage,
    TransferMessage,
    carve_layers,
    error_from_ack,
    read_replies,
    status_for,
)
from topkv.transport.stream.sending import (
    FINISH,
    ControlChannel,
    ControlConnections,
    HostOutgoing,
    LayerItem,
)

_connection_ids = itertools.count(1)


def parse_shm_address(address: str) -> str:
    if not address.startswith("shm://"):
        raise TransportError(f"not an shm address: {address!r} (expected shm:///path.sock)")
    return address[len("shm://") :]


# -- sender ----------------------------------------------------------------------------------


@dataclass
class _Segment:
    id: int
    size: int
    map: mmap.mmap
    view: memoryview
    busy: bool = False


class _Connection(ControlChannel):
    """One control connection to a sink, with the segments that sink has mapped."""

    def __init__(self, source: ShmSource, path: str) -> None:
        self.source = source
        self.id = next(_connection_ids)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(source.connect_timeout)
        try:
            sock.connect(path)
            client_handshake(sock, source.secret)
        except OSError as exc:
            sock.close()
            raise PeerDied(f"cannot connect to shm sink at {path}: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        super().__init__(sock, source.io_timeout)
        self.cond = threading.Condition()
        self.create_lock = threading.Lock()
        self.segments: dict[int, _Segment] = {}
        self.mapped: dict[int, threading.Event] = {}
        self.acks: dict[int, Future[framing.Control]] = {}
        self._next_segment = itertools.count(1)
        threading.Thread(target=self._read_loop, name="shm-src-read", daemon=True).start()

    def control(self, kind: framing.ControlKind, request_id: int = 0, **kw: int) -> None:
        self.send(framing.encode_control(framing.Control(kind, request_id, **kw)))  # type: ignore[arg-type]

    def _read_loop(self) -> None:
        self._die(read_replies(self.sock, self._on_reply, "shm"))

    def _on_reply(self, message: framing.Control) -> None:
        if message.kind == framing.ControlKind.ACK:
            with self.cond:
                future = self.acks.pop(message.request_id, None)
            if future is not None:
                future.set_result(message)
        elif message.kind == framing.ControlKind.RELEASE:
            self.free(message.arg0)
        elif message.kind == framing.ControlKind.SEGMENT_MAPPED:
            with self.cond:
                event = self.mapped.get(message.arg0)
            if event is not None:
                event.set()

    def _die(self, error: TransportError) -> None:
        with self.cond:
            if self.dead is None:
                self.dead = error
            acks, self.acks = self.acks, {}
            events = list(self.mapped.values())
            self.cond.notify_all()
        for future in acks.values():
            with contextlib.suppress(Exception):
                future.set_exception(error)
        for event in events:
            event.set()
        with contextlib.suppress(OSError):
            self.sock.close()
        self.source.forget(self)

    def free(self, segment_id: int) -> None:
        with self.cond:
            segment = self.segments.get(segment_id)
            if segment is not None:
                segment.busy = False
                self.cond.notify_all()

    def expect_ack(self, request_id: int) -> Future[framing.Control]:
        return self._wait_for_reply(self.cond, self.acks, request_id, Future())

    def acquire(self, nbytes: int) -> _Segment:
        deadline = time.monotonic() + self.source.io_timeout
        with self.cond:
            while True:
                if self.dead is not None:
                    raise self.dead
                free = [s for s in self.segments.values() if not s.busy and s.size >= nbytes]
                if free:
                    segment = min(free, key=lambda s: s.size)
                    segment.busy = True
                    return segment
                idle = [s for s in self.segments.values() if not s.busy]
                if len(self.segments) - len(idle) < self.source.max_segments:
                    for small in idle:  # too small: drop it, a bigger one replaces it
                        del self.segments[small.id]
                    break
                wait_for_release(
                    self.cond,
                    deadline,
                    f"all {self.source.max_segments} shm segments are loaned out",
                )
        segment = self._create(nbytes)
        with self.cond:
            self.segments[segment.id] = segment
        return segment

    def _create(self, nbytes: int) -> _Segment:
        segment_id = next(self._next_segment)
        name = segment_name(os.getpid(), self.id, segment_id)
        path = self.source.segment_dir / name
        event = threading.Event()
        with self.cond:
            self.mapped[segment_id] = event
        try:
            mapping = create_segment(path, nbytes)
            self.control(
                framing.ControlKind.SEGMENT,
                arg0=segment_id,
                arg1=nbytes,
                text=name,  # type: ignore[arg-type]
            )
            if not event.wait(self.source.io_timeout) or self.dead is not None:
                mapping.close()
                raise self.dead or TransferTimeout("shm sink did not map the segment in time")
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            with self.cond:
                self.mapped.pop(segment_id, None)
        return _Segment(segment_id, nbytes, mapping, memoryview(mapping), busy=True)

    def close(self) -> None:
        self._die(PeerDied("shm source closed"))


class _ShmOutgoing(HostOutgoing):
    """One worker thread copies the layers into a segment; it resolves the future (with
    the first error, if any) once it stops copying."""

    def __init__(self, conn: _Connection, descriptor: TransferDescriptor) -> None:
        super().__init__(descriptor)
        self._conn = conn
        threading.Thread(target=self._run, name="shm-send", daemon=True).start()

    def _wake(self) -> None:
        self._queue.put(FINISH)

    def _run(self) -> None:
        conn = self._conn
        rid = self.descriptor.request_id
        layout = self.descriptor.layout
        segment: _Segment | None = None
        loaned = False
        try:
            segment = conn.acquire(layout.total_bytes)
            ack = conn.expect_ack(rid)
            conn.send(framing.encode_transfer_header(self.descriptor))
            conn.control(framing.ControlKind.USE_SEGMENT, rid, arg0=segment.id)
            while True:
                item = self._queue.get()
                if item is FINISH or self._error is not None:
                    break
                assert isinstance(item, LayerItem)
                base = item.layer * layout.layer_bytes
                crcs: list[int] = []
                for index, tensor in enumerate(item.tensors):
                    start = base + index * layout.tensor_bytes
                    dst = segment.view[start : start + layout.tensor_bytes]
                    if item.crcs is None:
                        crcs.append(copy_with_crc(dst, tensor))
                    else:
                        copy_into(dst, tensor)
                if item.crcs is not None:
                    crcs = list(item.crcs)
                conn.send(framing.encode_layer_header(self.descriptor, item.layer, tuple(crcs)))
            if self._error is not None:
                conn.control(framing.ControlKind.CANCEL, rid)
                return
            conn.control(framing.ControlKind.DONE, rid)
            try:
                reply = ack.result(conn.source.ack_timeout)
            except TimeoutError as exc:
                raise TransferTimeout(f"no ack for request {rid} within the timeout") from exc
            if reply.status != framing.ControlStatus.OK:
                raise error_from_ack(reply)
            loaned = True
            self._succeed("shm", ShmSource.mode)
        except TransportError as exc:
            self._fail(exc)
        except OSError as exc:
            self._fail(PeerDied(f"shm transfer failed: {exc}"))
        finally:
            with conn.cond:
                conn.acks.pop(rid, None)
            if segment is not None and not loaned:
                conn.free(segment.id)
            if self._error is not None:
                with contextlib.suppress(Exception):
                    self._future.set_exception(self._error)


class ShmSource(StreamSource):
    """Sends KV to :class:`ShmSink` instances on the same host."""

    name = "shm"
    mode = TransportMode.PCIE  # the same-node path class; host memory is the medium here

    def __init__(
        self,
        secret: bytes,
        *,
        max_segments: int = 8,
        segment_dir: Path = SEGMENT_DIR,
        **options: Unpack[SourceOptions],
    ) -> None:
        if not segment_dir.is_dir():
            raise TransportUnavailable(f"shared-memory directory {segment_dir} does not exist")
        super().__init__(secret, **options)
        self.max_segments = max_segments
        self.segment_dir = segment_dir
        self._conns: ControlConnections[str, _Connection] = ControlConnections()
        sweep_stale_segments(segment_dir)

    def _connection(self, destination: str) -> _Connection:
        path = parse_shm_address(destination)
        return self._conns.get(path, lambda: _Connection(self, path))

    def forget(self, conn: _Connection) -> None:
        self._conns.forget(conn)

    def open(self, descriptor: TransferDescriptor, destination: str) -> OutgoingTransfer:
        return _ShmOutgoing(self._connection(destination), descriptor)

    def close(self) -> None:
        self._conns.close()


# -- receiver --------------------------------------------------------------------------------


@dataclass
class _Incoming:
    descriptor: TransferDescriptor
    layers: list[LayerTensors] = field(default_factory=list)
    segment: int = 0
    arrived: set[int] = field(default_factory=set)
    error: TransportError | None = None


class ShmSink(ListeningSink):
    """Receives KV in place from :class:`ShmSource` senders on this host."""

    name = "shm"
    mode = TransportMode.PCIE

    def __init__(
        self,
        secret: bytes,
        socket_path: str | None = None,
        *,
        segment_dir: Path = SEGMENT_DIR,
        **options: Unpack[SinkOptions],
    ) -> None:
        super().__init__(secret, label="shm", **options)
        self._segment_dir = segment_dir
        self._tmpdir: str | None = None
        if socket_path is None:
            self._tmpdir = tempfile.mkdtemp(prefix="topkv-shm-sink-")
            socket_path = os.path.join(self._tmpdir, "sink.sock")
        self._path = socket_path
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(socket_path)
        os.chmod(socket_path, 0o600)
        listener.listen(64)
        sweep_stale_segments(segment_dir)
        self._listen(listener)

    @property
    def address(self) -> str:
        return f"shm://{self._path}"

    def close(self) -> None:
        if not self._stop_listening():
            return
        self._table.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def _session(self, conn: socket.socket) -> None:
        _SinkSession(self, conn).run()


class _SinkSession(ControlSession[ShmSink, _Incoming]):
    """Receiver side of one control connection: layers land in the sender's segments."""

    def __init__(self, sink: ShmSink, conn: socket.socket) -> None:
        super().__init__(sink, conn)
        self.segments: dict[int, memoryview] = {}
        self.announced: list[str] = []

    def send_control(self, control: framing.Control) -> None:
        self.send(framing.encode_control(control))

    def end(self) -> None:
        super().end()
        for name in self.announced:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.sink._segment_dir / name)
        sweep_stale_segments(self.sink._segment_dir)

    def _open(self, message: TransferMessage) -> None:
        rid = self._check_open(message)
        try:
            self._table.claimable(rid)
        except ResourceExhausted as exc:
            self.send_control(
                framing.Control(framing.ControlKind.ACK, rid, status_for(exc), text=str(exc))
            )
            raise FrameRejected(str(exc)) from exc
        self._add(_Incoming(message.descriptor))

    def _state(self, rid: int) -> _Incoming:
        state = self.transfers.get(rid)
        if state is None:
            raise FrameRejected(f"record for request {rid}, which is not open")
        return state

    def _layer(self, message: LayerMessage) -> None:
        # The layer header names its request by key; find the open transfer it belongs to.
        state = self._match(message.raw)
        header = framing.decode_layer_header(message.raw, state.descriptor)
        if not state.layers:
            raise FrameRejected(f"request {header.request_id}: layer before USE_SEGMENT")
        self._arrive(state, header)
        views = state.layers[header.layer]
        if state.error is None and self.sink._verify:
            for index, (view, crc) in enumerate(zip(views, header.crcs, strict=True)):
                if framing.crc64(view) != crc:
                    state.error = crc_mismatch(header, index)
        self._deliver(state, header.layer, views)

    def _match(self, raw: bytes) -> _Incoming:
        if len(self.transfers) == 1:
            return next(iter(self.transfers.values()))
        return self._open_for(raw)

    def _control(self, control: framing.Control) -> None:
        kind = control.kind
        if kind == framing.ControlKind.SEGMENT:
            self._map(control)
        elif kind == framing.ControlKind.USE_SEGMENT:
            state = self._state(control.request_id)
            segment = self.segments.get(control.arg0)
            total = state.descriptor.layout.total_bytes
            if segment is None or len(segment) < total:
                raise FrameRejected(f"request {control.request_id}: bad segment {control.arg0}")
            state.segment = control.arg0
            state.layers = carve_layers(segment[:total], state.descriptor)
        elif kind == framing.ControlKind.DONE:
            self._done(self._state(control.request_id))
        elif kind == framing.ControlKind.CANCEL:
            cancelled = self.transfers.get(control.request_id)
            if cancelled is not None:
                self._drop(cancelled)
                self._table.fail(
                    control.request_id, TransferCancelled(f"sender cancelled {control.request_id}")
                )
        else:
            raise FrameRejected(f"unexpected control record {kind.name} from an shm sender")

    def _map(self, control: framing.Control) -> None:
        name = control.text
        if not is_segment_name(name):
            raise FrameRejected(f"refusing to map {name!r}: not a TopKV segment name")
        if control.arg1 > self.sink._limits.max_transfer_bytes:
            raise FrameRejected(
                f"segment of {control.arg1} bytes exceeds the limit "
                f"{self.sink._limits.max_transfer_bytes}"
            )
        self.announced.append(name)
        mapping = map_segment(self.sink._segment_dir / name, control.arg1)
        self.segments[control.arg0] = memoryview(mapping)
        self.send_control(framing.Control(framing.ControlKind.SEGMENT_MAPPED, arg0=control.arg0))

    def _done(self, state: _Incoming) -> None:
        rid = state.descriptor.request_id
        self._drop(state)
        self._check_complete(state)
        if state.error is not None:
            self.send_control(
                framing.Control(
                    framing.ControlKind.ACK, rid, status_for(state.error), text=str(state.error)
                )
            )
            self._table.fail(rid, state.error)
            return
        segment_id = state.segment

        def release() -> None:
            self.send_control(framing.Control(framing.ControlKind.RELEASE, arg0=segment_id))

        self.send_control(framing.Control(framing.ControlKind.ACK, rid))
        self._table.complete(ReceivedKV(state.descriptor, state.layers, self.sink._verify, release))
