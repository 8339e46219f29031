"""Worker registry: the embedded in-process backend and a URL opener.

The interface (:class:`WorkerRegistry`, :class:`Registration`, :class:`RegistryError`) is
defined in :mod:`topkv.relay.registry.base` and importable from here too.

Every backend keeps one record per worker under a time-to-live: a worker that stops
heartbeating vanishes after its TTL, and watchers hear ``leave`` at once. Watch callbacks
run on a backend thread (etcd) or synchronously (memory); they must be quick and
thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from topkv.errors import ConfigError
from topkv.policy.clock import Clock, MonotonicClock
from topkv.relay.registry.base import Registration, RegistryError, WatchCallback, WorkerRegistry
from topkv.relay.registry.etcd_access import is_etcd_url, redact_url
from topkv.relay.workers import RegistryEvent, Role, WorkerInfo

__all__ = [
    "MemoryRegistry",
    "Registration",
    "RegistryError",
    "WatchCallback",
    "WorkerRegistry",
    "open_registry",
    "redact_registry_url",
]


class _MemoryRegistration:
    def __init__(self, registry: MemoryRegistry, worker_id: str, ttl_s: float) -> None:
        self._registry = registry
        self._worker_id = worker_id
        self._ttl_s = ttl_s

    def heartbeat(self) -> None:
        self._registry._heartbeat(self._worker_id, self._ttl_s)

    def update(self, info: WorkerInfo) -> None:
        if info.worker_id != self._worker_id:
            raise RegistryError(f"cannot change worker id {self._worker_id!r} in an update")
        self._registry._put(info, self._ttl_s, kind="update")

    def deregister(self) -> None:
        self._registry._remove(self._worker_id)


class MemoryRegistry:
    """Embedded in-process registry with TTLs enforced against an injected clock.

    Expiry is checked on every read and by :meth:`expire`, so tests drive it with a
    manual clock and no sleeps.
    """

    def __init__(self, clock: Clock | None = None) -> None:
        self._clock = clock or MonotonicClock()
        self._lock = threading.RLock()
        self._records: dict[str, tuple[WorkerInfo, float]] = {}
        self._watchers: dict[int, WatchCallback] = {}
        self._next_watch = 0

    def register(self, info: WorkerInfo, ttl_s: float = 10.0) -> Registration:
        if ttl_s <= 0:
            raise ConfigError(f"registry TTL must be positive, got {ttl_s}")
        self.expire()
        with self._lock:
            kind = "update" if info.worker_id in self._records else "join"
        self._put(info, ttl_s, kind=kind)
        return _MemoryRegistration(self, info.worker_id, ttl_s)

    def workers(self, role: Role | None = None) -> list[WorkerInfo]:
        self.expire()
        with self._lock:
            infos = [info for info, _ in self._records.values()]
        return sorted(
            (i for i in infos if role is None or i.role == role), key=lambda i: i.worker_id
        )

    def get(self, worker_id: str) -> WorkerInfo | None:
        self.expire()
        with self._lock:
            record = self._records.get(worker_id)
        return record[0] if record else None

    def watch(self, callback: WatchCallback) -> Callable[[], None]:
        with self._lock:
            watch_id = self._next_watch
            self._next_watch += 1
            self._watchers[watch_id] = callback

        def cancel() -> None:
            with self._lock:
                self._watchers.pop(watch_id, None)

        return cancel

    def expire(self) -> None:
        """Drop every record whose lease has run out and tell the watchers."""
        now = self._clock.now()
        with self._lock:
            dead = [wid for wid, (_, deadline) in self._records.items() if deadline <= now]
            for wid in dead:
                del self._records[wid]
        for wid in dead:
            self._emit(RegistryEvent("leave", wid, None))

    def close(self) -> None:
        with self._lock:
            self._watchers.clear()

    def _put(self, info: WorkerInfo, ttl_s: float, kind: str) -> None:
        with self._lock:
            self._records[info.worker_id] = (info, self._clock.now() + ttl_s)
        self._emit(RegistryEvent("join" if kind == "join" else "update", info.worker_id, info))

    def _heartbeat(self, worker_id: str, ttl_s: float) -> None:
        self.expire()
        with self._lock:
            record = self._records.get(worker_id)
            if record is None:
                raise RegistryError(
                    f"worker {worker_id!r} is no longer registered (lease expired); register again"
                )
            self._records[worker_id] = (record[0], self._clock.now() + ttl_s)

    def _remove(self, worker_id: str) -> None:
        with self._lock:
            existed = self._records.pop(worker_id, None) is not None
        if existed:
            self._emit(RegistryEvent("leave", worker_id, None))

    def _emit(self, event: RegistryEvent) -> None:
        with self._lock:
            callbacks = list(self._watchers.values())
        for callback in callbacks:
            callback(event)


def open_registry(url: str, clock: Clock | None = None) -> WorkerRegistry:
    """Open ``memory`` (embedded) or ``etcd[s]://[USER@]HOST:PORT[/prefix][?ca=&cert=&key=]``.

    ``etcds://`` is etcd over TLS; a user logs in to an etcd with auth enabled, its password
    and the TLS files coming from ``TOPKV_ETCD_*`` variables (docs/etcd.md). Log the URL
    through :func:`redact_registry_url`: it may carry an inline password.
    """
    if url in ("memory", "memory://"):
        return MemoryRegistry(clock)
    if is_etcd_url(url):
        from topkv.relay.registry.etcd import EtcdRegistry

        return EtcdRegistry.from_url(url)
    raise ConfigError(
        f"unknown registry {redact_url(url)!r}: use 'memory', 'etcd://HOST:PORT' "
        "or 'etcds://HOST:PORT' (TLS)"
    )


def redact_registry_url(url: str) -> str:
    """The registry URL with any inline password replaced by ``***`` (safe to log or show)."""
    return redact_url(url)
