"""The transport contract: how one request's KV cache moves from a source to a sink.

Unit of transfer
    The KV cache of one request, described by a :class:`TransferDescriptor` (request id,
    model id, :class:`KVLayout`) and sent as one *per-layer frame* per layer: a frame
    header followed by the layer's K bytes then V bytes (or a single latent tensor for MLA).
    Tensor layout inside a layer is ``[seq_len][kv_heads][head_dim]`` (row-major bytes).

Sides and who calls what
    Sender (prefill worker)::

        source = SomeSource(...)                     # one per process, reused
        out = source.open(descriptor, destination)   # -> OutgoingTransfer
        for layer in range(L):                       # as each layer's KV becomes ready
            out.send_layer(layer, (k_view, v_view))  # returns at once (queued)
        result = out.finish().result(timeout)        # TransferResult or an exception

    Receiver (decode worker)::

        sink = SomeSink(..., on_layer=cb)            # listens at ``sink.address``
        fut = sink.receive(request_id)               # before or after the bytes arrive
        kv = fut.result(timeout)                     # ReceivedKV: verified layers
        ... use kv.layers ...
        kv.release()                                 # hand destination storage back

    ``on_layer(descriptor, layer, tensors)`` runs on a transport thread as soon as a layer
    has arrived *and* its CRC-64 matched; it must not block for long. Layers may arrive out
    of order when a transfer uses parallel streams.

Buffer ownership
    * The source owns its buffers throughout. The transport only *borrows* them read-only
      from ``send_layer`` until the future returned by ``finish()`` resolves (with a result
      or an exception). The caller must neither modify nor free them before then. When the
      future fails, nothing is lost: the same buffers can be sent again, over another
      transport if need be (the relay's failover).
    * The future resolves successfully only after the destination *acknowledged a verified
      copy* (every layer received and its CRC-64 checked).
    * The destination storage (``ReceivedKV.layers``) belongs to the receiver until it calls
      ``ReceivedKV.release()``; after that the views must not be used. For ``shm`` the views
      point into the shared segment (read in place) and releasing lets the sender reuse it.

Completion and errors
    Futures are :class:`concurrent.futures.Future`. They fail with a subclass of
    :class:`~topkv.transport.errors.TransportError`: ``PeerDied`` (peer closed/crashed),
    ``AuthenticationFailed`` (handshake refused), ``TransferTimeout`` (no progress within the
    timeout), ``TransferCancelled``, ``FrameRejected`` (protocol or limit violation, raised
    before allocating anything) and its subclass ``ChecksumMismatch`` (corruption; resend).
    Every blocking wait inside a transport is bounded by a timeout, so a dead peer always
    surfaces as an error within a bounded time.

Cancellation
    ``OutgoingTransfer.cancel()`` stops sending, tells the receiver, and fails the
    ``finish()`` future with ``TransferCancelled``; the receiver's future for that request
    fails with ``TransferCancelled`` too. Cancelling a finished transfer does nothing.

Modes and media
    :class:`TransportMode` is the *class* of path a transfer takes (nvlink, nvswitch, pcie,
    rdma, tcp) as chosen by the selection policy. A transport is a *medium* that serves one
    mode: here ``shm`` (same host, serves pcie-class same-node paths through host memory),
    ``tcp``, and ``emulated-<mode>`` (a paced wrapper over a real medium for modes whose
    hardware is absent). Every :class:`TransferResult` says whether it was emulated and, if
    so, the time-dilation factor used.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from typing_extensions import Buffer as Buffer  # collections.abc.Buffer is 3.12+

from topkv.dtypes import KV_DTYPES


class TransportMode(enum.StrEnum):
    """Class of interconnect path; the selection policy chooses one per transfer."""

    NVLINK = "nvlink"
    NVSWITCH = "nvswitch"
    PCIE = "pcie"
    RDMA = "rdma"
    TCP = "tcp"


@dataclass(frozen=True)
class KVLayout:
    """Shape of one request's KV cache.

    ``latent=True`` is MLA: one tensor per layer of ``seq_len * kv_heads * head_dim``
    elements (use ``kv_heads=1`` and ``head_dim = d_c + d_rope``) instead of K and V.
    """

    num_layers: int
    seq_len: int
    kv_heads: int
    head_dim: int
    dtype: str = "fp16"
    latent: bool = False

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype``, from the one table (:data:`topkv.dtypes.KV_DTYPES`)."""
        return KV_DTYPES[self.dtype].itemsize

    @property
    def tensors_per_layer(self) -> int:
        return 1 if self.latent else 2

    @property
    def tensor_bytes(self) -> int:
        """Bytes of one tensor (K, V or latent) of one layer."""
        return self.seq_len * self.kv_heads * self.head_dim * self.itemsize

    @property
    def layer_bytes(self) -> int:
        return self.tensor_bytes * self.tensors_per_layer

    @property
    def total_bytes(self) -> int:
        return self.layer_bytes * self.num_layers


@dataclass(frozen=True)
class TransferDescriptor:
    """What is being moved: one request's KV cache."""

    request_id: int
    model_id: str
    layout: KVLayout


@dataclass(frozen=True)
class TransferResult:
    """Outcome of a completed (acknowledged, verified) transfer, seen by the sender.

    ``medium`` is the registered transport that moved the bytes (``shm``, ``tcp``, ``nixl``,
    ``emulated-<mode>`` ...); ``mode`` is its transport mode."""

    request_id: int
    medium: str
    mode: TransportMode
    size_bytes: int
    seconds: float
    checksum_verified: bool
    emulated: bool = False
    dilation: float = 1.0
    wall_seconds: float | None = None

    @property
    def gbps(self) -> float:
        """Decimal GB/s over ``seconds`` (for emulated results: modelled link time)."""
        return self.size_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


LayerTensors = tuple[memoryview, ...]
LayerCallback = Callable[[TransferDescriptor, int, LayerTensors], None]


@dataclass
class ReceivedKV:
    """A verified KV cache at the destination.

    ``layers[i]`` holds layer i's tensors (K, V) or (latent,) as byte memoryviews. Call
    :meth:`release` once done with them; the views are invalid afterwards.
    """

    descriptor: TransferDescriptor
    layers: list[LayerTensors]
    checksum_verified: bool
    _release: Callable[[], None] | None = field(default=None, repr=False)

    def release(self) -> None:
        """Give the destination storage back to the transport (idempotent)."""
        release, self._release = self._release, None
        self.layers = []
        if release is not None:
            release()


class OutgoingTransfer(ABC):
    """Sender-side handle of one transfer. Created by :meth:`TransferSource.open`."""

    descriptor: TransferDescriptor

    @abstractmethod
    def send_layer(
        self, layer: int, tensors: Sequence[Buffer], crcs: Sequence[int] | None = None
    ) -> None:
        """Queue layer ``layer`` for sending and return at once.

        ``tensors`` are (K, V) or (latent,) buffers of ``layout.tensor_bytes`` each,
        borrowed read-only until the ``finish()`` future resolves. ``crcs`` are their
        CRC-64/NVME values when the producer already has them; otherwise the transport
        computes them. Raises ``FrameRejected`` for a wrong layer index or size.
        """

    @abstractmethod
    def finish(self) -> Future[TransferResult]:
        """Declare that every layer was queued; the future resolves on verified receipt."""

    @abstractmethod
    def cancel(self) -> None:
        """Abort: the ``finish()`` future fails with ``TransferCancelled``."""


class TransferSource(ABC):
    """Sender side of a transport. Thread-safe; many concurrent transfers."""

    name: str
    mode: TransportMode
    emulated: bool = False

    @abstractmethod
    def open(self, descriptor: TransferDescriptor, destination: str) -> OutgoingTransfer:
        """Start a transfer to the sink listening at ``destination`` (its ``address``)."""

    @abstractmethod
    def close(self) -> None:
        """Release connections and segments; in-flight transfers fail with PeerDied."""


class TransferSink(ABC):
    """Receiver side of a transport: listens at :attr:`address`."""

    name: str
    mode: TransportMode

    @property
    @abstractmethod
    def address(self) -> str:
        """Where sources send to, e.g. ``tcp://127.0.0.1:5555`` or ``shm:///run/x.sock``."""

    @abstractmethod
    def receive(self, request_id: int) -> Future[ReceivedKV]:
        """Future of the verified KV of ``request_id`` (call before or after it arrives)."""

    @abstractmethod
    def close(self) -> None:
        """Stop listening; pending receive futures fail with TransferCancelled."""
