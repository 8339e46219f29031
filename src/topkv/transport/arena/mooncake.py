"""Arena transport over the Mooncake Transfer Engine: batched writes into the sink's arena.

Mapping onto the contract (see :mod:`topkv.transport.arena.protocol` for the shared protocol):

* :class:`MooncakeSink` starts a ``TransferEngine`` with the P2P handshake (no metadata
  server: ``"P2PHANDSHAKE"``), registers its host arena and sends its session id
  (``host:rpc_port``) and the arena's base address over the control channel.
* :class:`MooncakeSource` starts its own ``TransferEngine`` and, per layer, writes K and V
  with one ``batch_transfer_sync_write`` to that session; the call returns once the bytes are in
  the sink's memory, and then the layer's frame header (with CRC-64s) follows for the sink
  to verify.

``protocol`` is Mooncake's transport: ``tcp`` here; ``rdma`` where NICs exist. The write
call is synchronous and cannot be interrupted; if the sink dies mid-call, the transfer's
future fails at once through the control channel and the call is abandoned on its thread.

The package is an optional extra (``scripts/install-peers.sh``; it needs the Debian
libraries libibverbs1, libnl-3-200 and libnl-route-3-200).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Unpack

from topkv.transport.arena.protocol import (
    INSTALL_HINT,
    HostSinkDriver,
    HostSourceDriver,
    buffer_address,
    dumps_metadata,
    loads_metadata,
)
from topkv.transport.arena.sink import ArenaSink, ArenaSinkOptions
from topkv.transport.arena.source import ArenaSource, ArenaSourceOptions
from topkv.transport.base import TransportMode
from topkv.transport.errors import PeerDied, TransportError, TransportUnavailable

try:
    from mooncake.engine import TransferEngine
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise TransportUnavailable(
        f"mooncake-transfer-engine is not installed ({INSTALL_HINT}): {exc}"
    ) from exc

DEFAULT_ARENA_BYTES = 1 << 30
P2P_HANDSHAKE = "P2PHANDSHAKE"


def _start_transfer_engine(host: str, protocol: str, device: str) -> Any:
    transfer_engine = TransferEngine()
    status = transfer_engine.initialize(host, P2P_HANDSHAKE, protocol, device)
    if status != 0:
        raise TransportUnavailable(
            f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) "
            f"returned {status}"
        )
    return transfer_engine


class _MooncakeSinkDriver(HostSinkDriver):
    def __init__(self, capacity: int, host: str, protocol: str, device: str) -> None:
        self.host = host
        self.transfer_engine = _start_transfer_engine(host, protocol, device)
        super().__init__(capacity)
        status = self.transfer_engine.register_memory(self.arena.address, capacity)
        if status != 0:
            raise TransportUnavailable(f"Mooncake could not register the arena (status {status})")

    def metadata(self) -> bytes:
        port = self.transfer_engine.get_rpc_port()
        return dumps_metadata({"rpc_port": port, "base": self.arena.address})

    def deregister(self) -> None:
        self.transfer_engine.unregister_memory(self.arena.address)


class _MooncakePeer:
    def __init__(self, session: str, base: int) -> None:
        self.session = session
        self.base = base


class _MooncakeSourceDriver(HostSourceDriver):
    def __init__(self, host: str, protocol: str, device: str) -> None:
        self.transfer_engine = _start_transfer_engine(host, protocol, device)
        self._lock = threading.Lock()

    def attach(self, metadata: bytes, host: str) -> _MooncakePeer:
        fields = loads_metadata(metadata, ("rpc_port", "base"))
        wrapped = f"[{host}]" if ":" in host else host
        return _MooncakePeer(f"{wrapped}:{int(fields['rpc_port'])}", int(fields["base"]))

    def write(
        self,
        peer: _MooncakePeer,
        pieces: Sequence[tuple[Any, int]],
        timeout: float,
        abort: threading.Event,
    ) -> None:
        if abort.is_set():
            raise PeerDied("Mooncake write abandoned: the sink's control channel died")
        addresses = [buffer_address(view) for view, _ in pieces]
        lengths = [len(view) for view, _ in pieces]
        targets = [peer.base + offset for _, offset in pieces]
        transfer_engine = self.transfer_engine
        # Local buffers are registered for the duration of the write, as Mooncake expects.
        status = transfer_engine.batch_register_memory(addresses, lengths)
        if status != 0:
            raise TransportError(f"Mooncake could not register the layer's buffers ({status})")
        try:
            status = transfer_engine.batch_transfer_sync_write(
                peer.session, addresses, targets, lengths
            )
        except Exception as exc:  # the binding raises RuntimeError on its failures
            raise PeerDied(f"Mooncake write to {peer.session} failed: {exc}") from exc
        finally:
            transfer_engine.batch_unregister_memory(addresses)
        if status != 0:
            raise PeerDied(f"Mooncake write to {peer.session} failed (status {status})")

    def detach(self, peer: _MooncakePeer) -> None:
        """Mooncake drops a dead peer's segment itself on the next failed write."""

    def close(self) -> None:
        """The ``TransferEngine`` shuts down with the object."""


def _mode(protocol: str) -> TransportMode:
    return TransportMode.RDMA if protocol == "rdma" else TransportMode.TCP


class MooncakeSink(ArenaSink):
    """Receives KV written by :class:`MooncakeSource` (address ``mooncake://host:port``)."""

    name = "mooncake"
    mode = TransportMode.TCP

    def __init__(
        self,
        secret: bytes,
        *,
        host: str = "127.0.0.1",
        capacity_bytes: int = DEFAULT_ARENA_BYTES,
        protocol: str = "tcp",
        device: str = "",
        **options: Unpack[ArenaSinkOptions],
    ) -> None:
        self.mode = _mode(protocol)
        driver = _MooncakeSinkDriver(capacity_bytes, host, protocol, device)
        super().__init__(driver, secret, scheme="mooncake", host=host, **options)


class MooncakeSource(ArenaSource):
    """Sends KV to :class:`MooncakeSink` through Mooncake batch writes."""

    name = "mooncake"
    mode = TransportMode.TCP

    def __init__(
        self,
        secret: bytes,
        *,
        host: str = "127.0.0.1",
        protocol: str = "tcp",
        device: str = "",
        **options: Unpack[ArenaSourceOptions],
    ) -> None:
        self.mode = _mode(protocol)
        driver = _MooncakeSourceDriver(host, protocol, device)
        super().__init__(driver, secret, scheme="mooncake", **options)
