"""CUDA transport through PyTorch: GPU->GPU and host->GPU, between processes or in one.

Mapping onto the contract (see :mod:`topkv.transport.arena.protocol` for the shared protocol):

* :class:`CudaSink` allocates its arena as one ``uint8`` tensor on ``cuda:<device>`` and
  shares it with each authenticated source as a **CUDA IPC handle** (PyTorch's own
  ``reduce_tensor``; the handle is decoded by a restricted unpickler that admits only the
  few torch names that rebuild a CUDA tensor, nothing else).
* :class:`CudaSource` opens that handle (``rebuild_cuda_tensor``) and, per layer, copies K
  and V into the arena on a dedicated stream: a **peer copy** (``copy_`` between devices,
  NVLink/PCIe P2P when the GPUs allow it) for CUDA tensors, and **pinned host staging**
  (memcpy into page-locked memory, then an asynchronous H2D copy) for host buffers. It waits
  for the copy's event (bounded by the I/O timeout, abandoned if the sink dies), then sends
  the layer's frame header; the sink verifies the landed bytes' CRC-64.
* Within one process (sink and source both here, e.g. two GPUs of one worker) the source
  uses the sink's arena directly instead of an IPC handle.

Tensors: ``send_layer`` accepts CUDA or CPU ``torch.Tensor`` (contiguous, any dtype; the
bytes are moved) and any host buffer. On the receiving side ``ReceivedKV.layers`` holds
flat ``uint8`` CUDA tensors (views into the arena) in place of memoryviews: device memory
has no memoryview. ``release()`` returns the region, as for every transport.

Verification copies the bytes to pinned host memory for CRC-64 (the checksum of
:mod:`topkv.wire`); producers that already know their CRCs pass them to ``send_layer``, and
``verify=False`` on the sink skips the check (``checksum_verified`` then says so).

This module needs a CUDA build of PyTorch and a GPU; without one, constructing a source or
sink raises :class:`~topkv.transport.errors.TransportUnavailable`. It has not been run on a
GPU in this repository's CI machine (none is present there); its tests skip cleanly.
"""

from __future__ import annotations

import io
import os
import pickle
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any, Unpack, cast

from topkv.transport import framing
from topkv.transport.arena.protocol import (
    SinkDriver,
    SourceDriver,
    dumps_metadata,
    loads_metadata,
)
from topkv.transport.arena.sink import ArenaSink, ArenaSinkOptions
from topkv.transport.arena.source import ArenaSource, ArenaSourceOptions
from topkv.transport.base import LayerTensors, TransferDescriptor, TransportMode
from topkv.transport.errors import (
    FrameRejected,
    PeerDied,
    TransferTimeout,
    TransportError,
    TransportUnavailable,
)

DEFAULT_ARENA_BYTES = 1 << 30
POLL_SECONDS = 20e-6

#: The only globals a CUDA IPC handle may name (what ``reduce_tensor`` pickles).
_HANDLE_GLOBALS = frozenset(
    {
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
        ("torch", "Tensor"),
        ("torch._tensor", "Tensor"),
        ("torch", "Size"),
        ("torch", "uint8"),
        ("torch", "device"),
        ("torch", "TypedStorage"),
        ("torch.storage", "TypedStorage"),
        ("torch", "UntypedStorage"),
        ("torch.storage", "UntypedStorage"),
    }
)

#: Arenas of sinks living in this process, by token (same-process transfers skip IPC).
_LOCAL_ARENAS: dict[str, Any] = {}
_LOCAL_LOCK = threading.Lock()


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise TransportUnavailable(f"cuda transport needs PyTorch: {exc}") from exc
    if not torch.cuda.is_available():
        raise TransportUnavailable("cuda transport needs a GPU: torch.cuda.is_available() is False")
    return torch


class _HandleUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _HANDLE_GLOBALS:
            raise FrameRejected(f"CUDA IPC handle names {module}.{name}, which is not allowed")
        return super().find_class(module, name)


def encode_ipc_handle(tensor: Any) -> bytes:
    """Pickle the CUDA IPC handle of ``tensor`` (PyTorch's ``reduce_tensor``)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    rebuild, args = reduce_tensor(tensor)  # type: ignore[no-untyped-call]
    if rebuild is not rebuild_cuda_tensor:
        raise TransportError("the arena is not a CUDA tensor; cannot share it by IPC")
    return pickle.dumps((rebuild, args), protocol=pickle.HIGHEST_PROTOCOL)


def decode_ipc_handle(data: bytes) -> tuple[Any, tuple[Any, ...]]:
    """Unpickle a handle from :func:`encode_ipc_handle`, refusing any other global."""
    try:
        rebuild, args = _HandleUnpickler(io.BytesIO(data)).load()
    except FrameRejected:
        raise
    except Exception as exc:
        raise FrameRejected(f"malformed CUDA IPC handle: {exc}") from exc
    if getattr(rebuild, "__name__", "") != "rebuild_cuda_tensor" or not isinstance(args, tuple):
        raise FrameRejected("CUDA IPC handle does not rebuild a CUDA tensor")
    return rebuild, args


def flat_bytes(tensor: Any) -> Any:
    """A flat ``uint8`` view of a contiguous torch tensor or a host buffer (no copy)."""
    import torch

    if isinstance(tensor, torch.Tensor):
        if not tensor.is_contiguous():
            raise FrameRejected("tensors must be contiguous")
        return tensor.reshape(-1).view(torch.uint8)
    view = memoryview(tensor)
    if not view.c_contiguous:
        raise FrameRejected("tensor buffers must be C-contiguous")
    with warnings.catch_warnings():  # read-only host buffers are only ever read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view.cast("B"), dtype=torch.uint8)


class _PinnedStaging:
    """A growing page-locked host buffer, one per stream user."""

    def __init__(self) -> None:
        self._buffer: Any = None

    def get(self, nbytes: int) -> Any:
        torch = _torch()
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._buffer[:nbytes]


def _host_crc(tensor: Any, staging: _PinnedStaging) -> int:
    if tensor.device.type == "cpu":
        return framing.crc64(tensor.numpy())
    host = staging.get(tensor.numel())
    host.copy_(tensor)  # synchronous D2H into pinned memory
    return framing.crc64(host.numpy())


class _CudaSinkDriver(SinkDriver):
    def __init__(self, capacity: int, device: int) -> None:
        torch = _torch()
        self.capacity = capacity
        self.device = torch.device("cuda", device)
        self.arena = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        self.token = f"{os.getpid()}-{id(self)}-{os.urandom(4).hex()}"
        self._staging = _PinnedStaging()
        self._lock = threading.Lock()
        self._handle: bytes | None = None
        with _LOCAL_LOCK:
            _LOCAL_ARENAS[self.token] = self.arena

    def metadata(self) -> bytes:
        with self._lock:
            if self._handle is None:
                self._handle = encode_ipc_handle(self.arena)
            handle = self._handle
        fields = {"pid": os.getpid(), "token": self.token, "handle": handle.hex()}
        return dumps_metadata(fields)

    def crc(self, offset: int, nbytes: int) -> int:
        with self._lock:
            return _host_crc(self.arena[offset : offset + nbytes], self._staging)

    def carve(self, offset: int, descriptor: TransferDescriptor) -> list[LayerTensors]:
        layout = descriptor.layout
        size, per = layout.tensor_bytes, layout.tensors_per_layer
        base = offset
        layers = [
            tuple(
                self.arena[base + (layer * per + t) * size : base + (layer * per + t + 1) * size]
                for t in range(per)
            )
            for layer in range(layout.num_layers)
        ]
        return cast(list[LayerTensors], layers)

    def close(self) -> None:
        with _LOCAL_LOCK:
            _LOCAL_ARENAS.pop(self.token, None)


class _CudaSourceDriver(SourceDriver):
    def __init__(self) -> None:
        self.torch = _torch()
        self._staging = _PinnedStaging()
        self._spare: list[_PinnedStaging] = []  # staging buffers not in use by a write
        self._streams: dict[int, Any] = {}
        self._lock = threading.Lock()

    def flatten(self, tensor: Any) -> Any:
        return flat_bytes(tensor)

    def nbytes(self, flat: Any) -> int:
        return int(flat.numel())  # one byte per element of a flat_bytes tensor

    def crc(self, tensor: Any) -> int:
        with self._lock:
            return _host_crc(tensor, self._staging)

    def attach(self, metadata: bytes, host: str) -> Any:
        fields = loads_metadata(metadata, ("pid", "token", "handle"))
        if fields["pid"] == os.getpid():
            with _LOCAL_LOCK:
                arena = _LOCAL_ARENAS.get(str(fields["token"]))
            if arena is None:
                raise PeerDied("the in-process CUDA sink is gone")
            return arena
        rebuild, args = decode_ipc_handle(bytes.fromhex(str(fields["handle"])))
        try:
            return rebuild(*args)
        except Exception as exc:
            raise TransportUnavailable(
                f"cannot open the sink's CUDA IPC handle (same host and driver needed): {exc}"
            ) from exc

    def _stream(self, device: Any) -> Any:
        index = device.index
        with self._lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = self.torch.cuda.Stream(device=device)
                self._streams[index] = stream
            return stream

    def write(
        self,
        peer: Any,
        pieces: Sequence[tuple[Any, int]],
        timeout: float,
        abort: threading.Event,
    ) -> None:
        stream = self._stream(peer.device)
        with self._lock:  # one staging buffer per concurrent write; reused afterwards
            staging = self._spare.pop() if self._spare else _PinnedStaging()
        self._copy(peer, pieces, stream, staging, timeout, abort)
        with self._lock:  # only after the copy finished reading it (not on timeout/abort)
            self._spare.append(staging)

    def _copy(
        self,
        peer: Any,
        pieces: Sequence[tuple[Any, int]],
        stream: Any,
        staging: _PinnedStaging,
        timeout: float,
        abort: threading.Event,
    ) -> None:
        torch = self.torch
        host_bytes = sum(t.numel() for t, _ in pieces if t.device.type == "cpu")
        pinned = staging.get(host_bytes) if host_bytes else None
        used = 0
        with torch.cuda.device(peer.device), torch.cuda.stream(stream):
            for tensor, offset in pieces:
                target = peer[offset : offset + tensor.numel()]
                if tensor.device.type == "cpu":
                    assert pinned is not None
                    chunk = pinned[used : used + tensor.numel()]
                    chunk.copy_(tensor)  # host memcpy into page-locked memory
                    target.copy_(chunk, non_blocking=True)
                    used += tensor.numel()
                else:
                    # Peer copy between devices (or within one); the source's producer
                    # stream must be done with it, so wait on that device's current stream.
                    stream.wait_stream(torch.cuda.current_stream(tensor.device))
                    target.copy_(tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        deadline = time.monotonic() + timeout
        while not done.query():
            if abort.is_set():
                raise PeerDied("CUDA copy abandoned: the sink's control channel died")
            if time.monotonic() > deadline:
                raise TransferTimeout(f"CUDA copy did not complete within {timeout} s")
            time.sleep(POLL_SECONDS)

    def detach(self, peer: Any) -> None:
        """The IPC mapping is dropped with the last reference to the rebuilt tensor."""

    def close(self) -> None:
        with self._lock:
            self._streams.clear()


class CudaSink(ArenaSink):
    """Receives KV into an arena on ``cuda:<device>`` (address ``cuda://host:port``)."""

    name = "cuda"
    mode = TransportMode.NVLINK

    def __init__(
        self,
        secret: bytes,
        *,
        device: int = 0,
        host: str = "127.0.0.1",
        capacity_bytes: int = DEFAULT_ARENA_BYTES,
        **options: Unpack[ArenaSinkOptions],
    ) -> None:
        driver = _CudaSinkDriver(capacity_bytes, device)
        super().__init__(driver, secret, scheme="cuda", host=host, **options)


class CudaSource(ArenaSource):
    """Copies KV into :class:`CudaSink` arenas (peer copies / pinned staging over IPC)."""

    name = "cuda"
    mode = TransportMode.NVLINK

    def __init__(self, secret: bytes, **options: Unpack[ArenaSourceOptions]) -> None:
        super().__init__(_CudaSourceDriver(), secret, scheme="cuda", **options)
