"""Receiving end of the arena protocol (:mod:`topkv.transport.arena.protocol`).

:class:`ArenaSink` owns the arena its driver registered with the library and the
authenticated control socket; one :class:`_SinkSession` per source connection reserves
regions, verifies each layer the library wrote against its frame header's CRC-64s and
acknowledges the transfer.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Unpack

from topkv.transport import framing
from topkv.transport.arena.protocol import (
    Arena,
    SinkDriver,
    control_record,
    send_hello,
)
from topkv.transport.base import (
    LayerTensors,
    ReceivedKV,
    TransferDescriptor,
    TransportMode,
)
from topkv.transport.errors import (
    FrameRejected,
    PeerDied,
    ResourceExhausted,
    TransferCancelled,
    TransportError,
)
from topkv.transport.stream.listening import ControlSession, ListeningSink, crc_mismatch
from topkv.transport.stream.options import SinkOptions
from topkv.transport.stream.receiving import LayerMessage, TransferMessage, status_for


@dataclass
class _Incoming:
    descriptor: TransferDescriptor
    offset: int
    layers: list[LayerTensors]
    arrived: set[int] = field(default_factory=set)
    error: TransportError | None = None


class ArenaSinkOptions(SinkOptions, total=False):
    """Control-channel options every arena transport's sink passes on to :class:`ArenaSink`."""

    port: int


class ArenaSink(ListeningSink):
    """Receives KV a library wrote into this sink's arena (see the module docstring)."""

    name = "arena"
    mode = TransportMode.TCP

    def __init__(
        self,
        driver: SinkDriver,
        secret: bytes,
        *,
        scheme: str,
        host: str = "127.0.0.1",
        port: int = 0,
        **options: Unpack[SinkOptions],
    ) -> None:
        super().__init__(secret, label=scheme, **options)
        self.driver = driver
        self._scheme = scheme
        self._arena = Arena(driver.capacity)
        listener = socket.create_server((host, port))
        self._host = host
        self._port = listener.getsockname()[1]
        self._listen(listener)

    @property
    def address(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{self._scheme}://{host}:{self._port}"

    def close(self) -> None:
        if not self._stop_listening():
            return
        self._arena.close()
        self._table.close()
        self.driver.close()

    def _prepare(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _greet(self, conn: socket.socket) -> None:
        send_hello(conn, self.driver.capacity, self.driver.metadata())

    def _session(self, conn: socket.socket) -> None:
        _SinkSession(self, conn).run()


class _SinkSession(ControlSession[ArenaSink, _Incoming]):
    """Receiver side of one control connection: layers land in the arena by library writes."""

    def end(self) -> None:
        super().end()
        self.fail_open(PeerDied(f"{self.sink._scheme} sender went away"))

    def _forget(self, state: _Incoming) -> None:
        self._drop(state)
        self.sink._arena.free(state.offset, state.descriptor.layout.total_bytes)

    def _open(self, message: TransferMessage) -> None:
        descriptor = message.descriptor
        rid = self._check_open(message)
        try:
            self._table.claimable(rid)
            offset = self.sink._arena.allocate(descriptor.layout.total_bytes, self.sink._io_timeout)
        except (ResourceExhausted, FrameRejected, TransferCancelled) as exc:
            self.send(
                control_record(framing.ControlKind.ACK, rid, status=status_for(exc), text=str(exc))
            )
            return
        state = _Incoming(descriptor, offset, self.sink.driver.carve(offset, descriptor))
        self._add(state)
        self.send(
            control_record(
                framing.ControlKind.USE_SEGMENT,
                rid,
                arg0=offset,
                arg1=descriptor.layout.total_bytes,
            )
        )

    def _layer(self, message: LayerMessage) -> None:
        state = self._open_for(message.raw)
        header = framing.decode_layer_header(message.raw, state.descriptor)
        self._arrive(state, header)
        if state.error is not None:
            return
        layout = state.descriptor.layout
        if self.sink._verify:
            base = state.offset + header.layer * layout.layer_bytes
            for index, crc in enumerate(header.crcs):
                start = base + index * layout.tensor_bytes
                if self.sink.driver.crc(start, layout.tensor_bytes) != crc:
                    state.error = crc_mismatch(header, index)
                    return
        self._deliver(state, header.layer, state.layers[header.layer])

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
                self._forget(state)
                self._table.fail(rid, TransferCancelled(f"sender cancelled request {rid}"))
        else:
            raise FrameRejected(f"unexpected control record {control.kind.name} from a sender")

    def _done(self, state: _Incoming) -> None:
        rid = state.descriptor.request_id
        self._check_complete(state)
        if state.error is not None:
            error = state.error
            self._forget(state)
            self.send(
                control_record(
                    framing.ControlKind.ACK, rid, status=status_for(error), text=str(error)
                )
            )
            self._table.fail(rid, error)
            return
        self._drop(state)
        arena, offset, size = self.sink._arena, state.offset, state.descriptor.layout.total_bytes

        def release() -> None:
            arena.free(offset, size)

        self.send(control_record(framing.ControlKind.ACK, rid))
        self._table.complete(ReceivedKV(state.descriptor, state.layers, self.sink._verify, release))
