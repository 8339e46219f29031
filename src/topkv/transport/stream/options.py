"""The keyword options the stream transports (shm, tcp and the arena transports) share, and
their defaults: :class:`SinkOptions` of every sink, :class:`SourceOptions` of every source,
and :class:`StreamSource`, the source base that holds them."""

from __future__ import annotations

from typing import TypedDict, Unpack

from topkv.transport import framing
from topkv.transport.base import LayerCallback, TransferSource

#: Seconds a source has to connect to a sink and authenticate.
DEFAULT_CONNECT_TIMEOUT = 5.0
#: Seconds a sink gives a new connection to pass the HMAC handshake.
DEFAULT_HANDSHAKE_TIMEOUT = 5.0
#: Seconds a started transfer's socket may block, on either side.
DEFAULT_IO_TIMEOUT = 30.0
#: Seconds a source waits for its sink's acknowledgement of a transfer.
DEFAULT_ACK_TIMEOUT = 30.0


class SinkOptions(TypedDict, total=False):
    """What every stream sink takes as keywords (read by ``ListeningSink``)."""

    #: Called with each verified layer as it lands (default: none).
    on_layer: LayerCallback | None
    #: What a sender may announce (default: ``framing.ReceiveLimits()``).
    limits: framing.ReceiveLimits | None
    #: Seconds an open transfer may stall (default: :data:`DEFAULT_IO_TIMEOUT`).
    io_timeout: float
    #: Seconds to authenticate a connection (default: :data:`DEFAULT_HANDSHAKE_TIMEOUT`).
    handshake_timeout: float
    #: Check each tensor's CRC-64 before ``on_layer`` and ``receive()`` see it (default: yes).
    verify: bool


class SourceOptions(TypedDict, total=False):
    """What every stream source takes as keywords (read by :class:`StreamSource`)."""

    #: Seconds to connect and authenticate (default: :data:`DEFAULT_CONNECT_TIMEOUT`).
    connect_timeout: float
    #: Seconds a started transfer's socket may block (default: :data:`DEFAULT_IO_TIMEOUT`).
    io_timeout: float
    #: Seconds to wait for the sink's acknowledgement (default: :data:`DEFAULT_ACK_TIMEOUT`).
    ack_timeout: float


class StreamSource(TransferSource):
    """A source that reaches its sinks over authenticated stream connections: the shared
    secret and the :class:`SourceOptions` timeouts its connections use."""

    def __init__(self, secret: bytes, **options: Unpack[SourceOptions]) -> None:
        self.secret = secret
        self.connect_timeout = options.get("connect_timeout", DEFAULT_CONNECT_TIMEOUT)
        self.io_timeout = options.get("io_timeout", DEFAULT_IO_TIMEOUT)
        self.ack_timeout = options.get("ack_timeout", DEFAULT_ACK_TIMEOUT)
