"""The arena protocol every arena transport (NIXL, Mooncake TE, CUDA) shares.

Their libraries move bytes one-sidedly: the initiator *writes* into memory the target has
registered. TopKV maps that onto its contract (:mod:`topkv.transport.base`) the same way for
every library, with a small control channel beside the library's data path:

* The sink owns a registered **arena** (host memory for NIXL and Mooncake, a device tensor
  for CUDA) and listens on an authenticated TCP control socket (the HMAC handshake of
  :mod:`topkv.transport.stream.handshake`). Its address is ``<transport>://host:port``.
* After the handshake the sink sends an *arena hello*: the arena size and the library's own
  metadata (NIXL agent metadata, the Mooncake P2P session, a CUDA IPC handle).
* Per transfer the source sends the transfer header; the sink reserves a region of the arena
  and answers ``USE_SEGMENT(offset)`` (or a failed ACK when it cannot).
* Per layer the source has the **library** write K and V into the region, waits for the
  library's completion, then sends the wire format's per-layer frame header (CRC-64 of each
  tensor) on the control socket. The sink verifies the landed bytes against those CRCs and
  calls ``on_layer``. ``DONE`` -> the sink ACKs; the source's future resolves.
* ``ReceivedKV.layers`` are views into the arena; ``release()`` returns the region.

Death of either side closes the control socket: every pending future fails with
``PeerDied`` at once, even when a library call is stuck (the call is abandoned on its
thread, bounded by the transport's I/O timeout).

Modules: this one holds what a library's drivers implement (:class:`SinkDriver`,
:class:`SourceDriver`: the per-side object that drives the library), the arenas, and the
hello and metadata records; :mod:`topkv.transport.arena.sink` and
:mod:`topkv.transport.arena.source` the two ends of the control channel;
:mod:`topkv.transport.arena.factory` the factory and registration. The transports
(:mod:`~topkv.transport.arena.nixl`, :mod:`~topkv.transport.arena.mooncake`,
:mod:`~topkv.transport.arena.cuda`) import these modules; only the factory imports them.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import mmap
import os
import socket
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from topkv.transport import framing
from topkv.transport.base import LayerTensors, TransferDescriptor
from topkv.transport.errors import (
    FrameRejected,
    TransferCancelled,
    TransportError,
    wait_for_release,
)
from topkv.transport.stream.receiving import carve_layers
from topkv.transport.stream.sending import as_bytes_view, check_layer_tensors
from topkv.transport.stream.sockio import recv_exactly, send_buffers

ARENA_ALIGN = 4096
HELLO_MAGIC = b"TKVENG01"
HELLO = struct.Struct("<8sQI")  # magic, arena capacity, metadata length
MAX_METADATA_BYTES = 1 << 20
WRITE_WINDOW = 2  # library writes in flight per transfer
INSTALL_HINT = "install the optional peers with scripts/install-peers.sh"

_agent_ids = itertools.count(1)


def unique_name(prefix: str) -> str:
    """A process-unique name for a library's agent."""
    return f"{prefix}-{os.getpid()}-{next(_agent_ids)}-{os.urandom(3).hex()}"


@dataclass(frozen=True)
class ArenaLayer:
    """One validated layer queued for a library write (tensors in the driver's own type)."""

    layer: int
    tensors: tuple[Any, ...]
    crcs: tuple[int, ...] | None


class SinkDriver(ABC):
    """Drives a library on the sink's side: a registered arena and what sources need to
    reach it."""

    capacity: int

    @abstractmethod
    def metadata(self) -> bytes:
        """Opaque bytes a source passes to :meth:`SourceDriver.attach`."""

    @abstractmethod
    def crc(self, offset: int, nbytes: int) -> int:
        """CRC-64 of arena bytes ``[offset, offset + nbytes)``."""

    @abstractmethod
    def carve(self, offset: int, descriptor: TransferDescriptor) -> list[LayerTensors]:
        """Per-layer views of a transfer's region of the arena."""

    @abstractmethod
    def close(self) -> None:
        """Deregister the arena and shut the library down."""


class SourceDriver(ABC):
    """Drives a library on the initiator's (source's) side."""

    def check(
        self,
        descriptor: TransferDescriptor,
        layer: int,
        tensors: Sequence[Any],
        crcs: Sequence[int] | None,
    ) -> ArenaLayer:
        """Validate a ``send_layer`` call (raises ``FrameRejected``): the layout's checks
        (:func:`~topkv.transport.stream.sending.check_layer_tensors`) over the tensors as
        :meth:`flatten` makes them."""
        flat, checked = check_layer_tensors(
            descriptor, layer, tensors, crcs, self.flatten, self.nbytes
        )
        return ArenaLayer(layer, flat, checked)

    @abstractmethod
    def flatten(self, tensor: Any) -> Any:
        """One ``send_layer`` tensor as the library writes it (flat bytes, no copy)."""

    @abstractmethod
    def nbytes(self, flat: Any) -> int:
        """Bytes of a tensor :meth:`flatten` returned."""

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
        set (the control channel died) or the library reports a failure.
        """

    @abstractmethod
    def detach(self, peer: Any) -> None:
        """Forget a peer (its sink went away)."""

    @abstractmethod
    def close(self) -> None:
        """Shut the library down."""


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
                wait_for_release(
                    self._cond,
                    deadline,
                    f"no {nbytes}-byte region free in the sink's arena within {timeout} s",
                )

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
    """Anonymous, page-aligned host memory for a sink driver to register."""

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


class HostSinkDriver(SinkDriver):
    """A sink driver whose arena is a :class:`HostArena` (NIXL, Mooncake).

    Subclasses start their library, call ``super().__init__(capacity)``, register
    ``self.arena`` with the library and undo that registration in :meth:`deregister`.
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
        """Drop the library's registration of the arena (once, before the arena is freed)."""


class HostSourceDriver(SourceDriver):
    """A source driver that writes host buffers (NIXL, Mooncake): checked as byte views."""

    def flatten(self, tensor: Any) -> memoryview:
        return as_bytes_view(tensor)

    def nbytes(self, flat: memoryview) -> int:
        return flat.nbytes

    def crc(self, tensor: Any) -> int:
        return framing.crc64(tensor)


def buffer_address(view: memoryview) -> int:
    """Virtual address of a C-contiguous buffer's first byte (read-only buffers too)."""
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def parse_arena_address(address: str, scheme: str) -> tuple[str, int]:
    prefix = f"{scheme}://"
    if not address.startswith(prefix):
        raise TransportError(f"not a {scheme} address: {address!r} (expected {prefix}host:port)")
    host, sep, port = address[len(prefix) :].rpartition(":")
    if not sep or not port.isdigit():
        raise TransportError(f"bad {scheme} address {address!r} (expected {prefix}host:port)")
    return host.strip("[]"), int(port)


def send_hello(sock: socket.socket, capacity: int, metadata: bytes) -> None:
    send_buffers(sock, [HELLO.pack(HELLO_MAGIC, capacity, len(metadata)), metadata])


def read_hello(sock: socket.socket) -> tuple[int, bytes]:
    magic, capacity, length = HELLO.unpack(recv_exactly(sock, HELLO.size, "arena hello"))
    if magic != HELLO_MAGIC:
        raise FrameRejected(f"bad arena hello magic {magic!r}")
    if length > MAX_METADATA_BYTES:
        raise FrameRejected(f"library metadata of {length} bytes exceeds {MAX_METADATA_BYTES}")
    return capacity, recv_exactly(sock, length, "library metadata")


def control_record(kind: framing.ControlKind, request_id: int = 0, **kw: Any) -> bytes:
    return framing.encode_control(framing.Control(kind, request_id, **kw))


def dumps_metadata(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields, sort_keys=True).encode()


def loads_metadata(data: bytes, required: Sequence[str]) -> dict[str, Any]:
    try:
        fields = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FrameRejected(f"library metadata is not JSON: {exc}") from exc
    if not isinstance(fields, dict) or any(key not in fields for key in required):
        raise FrameRejected(f"library metadata lacks one of {list(required)}")
    return fields
