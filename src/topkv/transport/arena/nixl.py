"""Arena transport over NIXL: one-sided UCX writes into the sink's registered host arena.

Mapping onto the contract (see :mod:`topkv.transport.arena.protocol` for the shared protocol):

* :class:`NixlSink` creates a NIXL agent with the UCX backend, registers its host arena
  (``DRAM``) and sends the agent metadata to each source over the control channel.
* :class:`NixlSource` loads that metadata (``add_remote_agent``), registers the caller's K/V
  buffers for the duration of each layer write, and issues a ``WRITE`` transfer request
  (``initialize_xfer`` + ``transfer``), polling ``check_xfer_state`` until ``DONE``; only
  then does it send the layer's frame header (with CRC-64s) for the sink to verify.

UCX picks the medium: on one host its shared-memory paths (cma/knem/xpmem), across hosts
RDMA when a NIC exists, else TCP. ``ucx_tls`` (e.g. ``"tcp"``) restricts it; UCX reads it
from the environment when the agent is created, so it is set process-wide (``UCX_TLS``).

The package is an optional extra (``scripts/install-peers.sh``); importing this module
without it raises :class:`~topkv.transport.errors.TransportUnavailable`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Unpack

from topkv.transport.arena.protocol import (
    INSTALL_HINT,
    HostSinkDriver,
    HostSourceDriver,
    buffer_address,
    dumps_metadata,
    loads_metadata,
    unique_name,
)
from topkv.transport.arena.sink import ArenaSink, ArenaSinkOptions
from topkv.transport.arena.source import ArenaSource, ArenaSourceOptions
from topkv.transport.base import TransportMode
from topkv.transport.errors import PeerDied, TransferTimeout, TransportError, TransportUnavailable

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs INFO to stdout otherwise

try:
    from nixl_cu12 import nixl_agent, nixl_agent_config, nixl_thread_sync_t
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise TransportUnavailable(f"nixl is not installed ({INSTALL_HINT}): {exc}") from exc

POLL_SECONDS = 50e-6
DEFAULT_ARENA_BYTES = 1 << 30


def _make_agent(prefix: str, ucx_tls: str | None) -> Any:
    if ucx_tls is not None:
        os.environ["UCX_TLS"] = ucx_tls  # UCX reads it when the backend is created
    config = nixl_agent_config(
        enable_prog_thread=True,
        backends=["UCX"],
        sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    try:
        agent = nixl_agent(unique_name(prefix), config)
    except Exception as exc:
        raise TransportUnavailable(f"cannot create a NIXL agent: {exc}") from exc
    if "UCX" not in agent.backends:
        raise TransportUnavailable("NIXL's UCX plugin is not available in this installation")
    return agent


class _NixlSinkDriver(HostSinkDriver):
    def __init__(self, capacity: int, ucx_tls: str | None) -> None:
        self.agent = _make_agent("topkv-sink", ucx_tls)
        super().__init__(capacity)
        self._registered = self.agent.register_memory(
            [(self.arena.address, capacity, 0, "topkv-arena")], "DRAM"
        )

    def metadata(self) -> bytes:
        fields = {"base": self.arena.address, "agent": self.agent.get_agent_metadata().hex()}
        return dumps_metadata(fields)

    def deregister(self) -> None:
        self.agent.deregister_memory(self._registered)


class _NixlPeer:
    def __init__(self, name: Any, base: int) -> None:
        self.name = name
        self.base = base


class _NixlSourceDriver(HostSourceDriver):
    def __init__(self, ucx_tls: str | None) -> None:
        self.agent = _make_agent("topkv-source", ucx_tls)
        self._lock = threading.Lock()

    def attach(self, metadata: bytes, host: str) -> _NixlPeer:
        fields = loads_metadata(metadata, ("base", "agent"))
        try:
            with self._lock:
                name = self.agent.add_remote_agent(bytes.fromhex(fields["agent"]))
        except Exception as exc:
            raise PeerDied(f"NIXL could not load the sink's agent metadata: {exc}") from exc
        return _NixlPeer(name, int(fields["base"]))

    def write(
        self,
        peer: _NixlPeer,
        pieces: Sequence[tuple[Any, int]],
        timeout: float,
        abort: threading.Event,
    ) -> None:
        local = [(buffer_address(view), len(view), 0) for view, _ in pieces]
        remote = [(peer.base + offset, len(view), 0) for view, offset in pieces]
        agent = self.agent
        registered = agent.register_memory([(a, n, 0, "") for a, n, _ in local], "DRAM")
        try:
            handle = agent.initialize_xfer(
                "WRITE",
                agent.get_xfer_descs(local, "DRAM"),
                agent.get_xfer_descs(remote, "DRAM"),
                peer.name,
            )
            try:
                state = agent.transfer(handle)
                deadline = time.monotonic() + timeout
                while state == "PROC":
                    if abort.is_set():
                        raise PeerDied("NIXL write abandoned: the sink's control channel died")
                    if time.monotonic() > deadline:
                        raise TransferTimeout(f"NIXL write did not complete within {timeout} s")
                    time.sleep(POLL_SECONDS)
                    state = agent.check_xfer_state(handle)
                if state != "DONE":
                    raise PeerDied(f"NIXL write failed (state {state})")
            finally:
                handle.release()
        except TransportError:
            raise
        except Exception as exc:  # nixl raises its bindings' own exception types
            raise PeerDied(f"NIXL write failed: {exc}") from exc
        finally:
            agent.deregister_memory(registered)

    def detach(self, peer: _NixlPeer) -> None:
        with self._lock:
            self.agent.remove_remote_agent(peer.name)

    def close(self) -> None:
        """The agent is torn down with the object; nothing is held beyond it."""


class NixlSink(ArenaSink):
    """Receives KV written by :class:`NixlSource` agents (address ``nixl://host:port``)."""

    name = "nixl"
    mode = TransportMode.RDMA

    def __init__(
        self,
        secret: bytes,
        *,
        host: str = "127.0.0.1",
        capacity_bytes: int = DEFAULT_ARENA_BYTES,
        ucx_tls: str | None = None,
        **options: Unpack[ArenaSinkOptions],
    ) -> None:
        driver = _NixlSinkDriver(capacity_bytes, ucx_tls)
        super().__init__(driver, secret, scheme="nixl", host=host, **options)


class NixlSource(ArenaSource):
    """Sends KV to :class:`NixlSink` through NIXL ``WRITE`` requests."""

    name = "nixl"
    mode = TransportMode.RDMA

    def __init__(
        self, secret: bytes, *, ucx_tls: str | None = None, **options: Unpack[ArenaSourceOptions]
    ) -> None:
        super().__init__(_NixlSourceDriver(ucx_tls), secret, scheme="nixl", **options)
