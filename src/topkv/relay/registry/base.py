"""The worker registry's interface: what every backend implements and raises.

Both backends build on it: the embedded one (:mod:`topkv.relay.registry.memory`, which also opens a
backend by URL) and etcd (:mod:`topkv.relay.registry.etcd`, which does not import the
embedded one, so the two modules form no import cycle).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from topkv.errors import TopKVError
from topkv.relay.workers import RegistryEvent, Role, WorkerInfo

WatchCallback = Callable[[RegistryEvent], None]


class RegistryError(TopKVError):
    """The registry backend is unreachable or refused an operation."""


class Registration(Protocol):
    """Handle a worker keeps while registered."""

    def heartbeat(self) -> None:
        """Extend the record's lease; raise RegistryError if it already expired."""

    def update(self, info: WorkerInfo) -> None:
        """Replace the record (same worker id) keeping the lease."""

    def deregister(self) -> None:
        """Remove the record now; idempotent."""


class WorkerRegistry(Protocol):
    """Registry of live workers (embedded or etcd)."""

    def register(self, info: WorkerInfo, ttl_s: float = 10.0) -> Registration: ...

    def workers(self, role: Role | None = None) -> list[WorkerInfo]: ...

    def get(self, worker_id: str) -> WorkerInfo | None: ...

    def watch(self, callback: WatchCallback) -> Callable[[], None]:
        """Call ``callback`` on every join/update/leave; returns a cancel function."""
        ...

    def close(self) -> None: ...
