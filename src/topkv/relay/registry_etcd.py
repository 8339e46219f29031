"""etcd backend of the worker registry (through etcd's v3 HTTP gateway, via ``etcd3gw``).

Layout: one key per worker, ``<prefix>/workers/<worker_id>``, whose value is the
:class:`WorkerInfo` JSON, attached to a lease of the worker's TTL. A worker that stops
heartbeating loses its lease and etcd deletes the key; a prefix watch turns puts and
deletes into join/update/leave events. An orchestrator that restarts simply lists the
prefix again, so its view is rebuilt from etcd alone.

Why etcd3gw: it is maintained (OpenStack), typed, and speaks the gRPC gateway over plain
HTTP, so it avoids the protobuf/grpc version pinning that broke the older ``etcd3`` client.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import requests
from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import Etcd3Exception
from etcd3gw.lease import Lease

from topkv.errors import ConfigError
from topkv.relay.registry_base import RegistryError, WatchCallback
from topkv.relay.workers import RegistryEvent, Role, WorkerInfo

DEFAULT_PREFIX = "/topkv"
_ETCD_ERRORS = (requests.RequestException, Etcd3Exception)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _EtcdRegistration:
    def __init__(self, registry: EtcdRegistry, info: WorkerInfo, lease: Lease) -> None:
        self._registry = registry
        self._worker_id = info.worker_id
        self._lease = lease

    def heartbeat(self) -> None:
        try:
            remaining = self._lease.refresh()
        except _ETCD_ERRORS as exc:
            raise RegistryError(f"etcd heartbeat failed: {exc}") from exc
        if remaining <= 0:
            raise RegistryError(f"worker {self._worker_id!r} lease expired in etcd; register again")

    def update(self, info: WorkerInfo) -> None:
        if info.worker_id != self._worker_id:
            raise RegistryError(f"cannot change worker id {self._worker_id!r} in an update")
        self._registry._put(info, self._lease)

    def deregister(self) -> None:
        try:
            self._lease.revoke()
        except _ETCD_ERRORS as exc:
            raise RegistryError(f"etcd deregister failed: {exc}") from exc


class EtcdRegistry:
    """Worker registry kept in etcd with leases (TTL) and prefix watches."""

    def __init__(self, host: str, port: int, prefix: str = DEFAULT_PREFIX, timeout_s: float = 5.0):
        self._client = Etcd3Client(host=host, port=port, timeout=timeout_s)
        self._prefix = prefix.rstrip("/") + "/workers/"
        self._endpoint = f"{host}:{port}"
        self._cancels: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        try:
            self._client.status()
        except _ETCD_ERRORS as exc:
            raise RegistryError(
                f"cannot reach etcd at {self._endpoint}: {exc.__class__.__name__}; "
                "is etcd running and is the address right?"
            ) from exc

    @classmethod
    def from_url(cls, url: str) -> EtcdRegistry:
        parsed = urlparse(url)
        if parsed.scheme != "etcd" or not parsed.hostname or not parsed.port:
            raise ConfigError(f"bad etcd registry URL {url!r}: expected etcd://HOST:PORT[/prefix]")
        prefix = parsed.path if parsed.path not in ("", "/") else DEFAULT_PREFIX
        return cls(parsed.hostname, parsed.port, prefix)

    def register(self, info: WorkerInfo, ttl_s: float = 10.0) -> _EtcdRegistration:
        if ttl_s <= 0:
            raise ConfigError(f"registry TTL must be positive, got {ttl_s}")
        try:
            lease = self._client.lease(ttl=max(1, round(ttl_s)))
        except _ETCD_ERRORS as exc:
            raise RegistryError(f"etcd lease grant failed at {self._endpoint}: {exc}") from exc
        self._put(info, lease)
        return _EtcdRegistration(self, info, lease)

    def workers(self, role: Role | None = None) -> list[WorkerInfo]:
        try:
            values = self._client.get_prefix(self._prefix)
        except _ETCD_ERRORS as exc:
            raise RegistryError(f"etcd read failed at {self._endpoint}: {exc}") from exc
        infos = [WorkerInfo.from_json(_text(value)) for value, _meta in values]
        return sorted(
            (i for i in infos if role is None or i.role == role), key=lambda i: i.worker_id
        )

    def get(self, worker_id: str) -> WorkerInfo | None:
        try:
            values = self._client.get(self._prefix + worker_id)
        except _ETCD_ERRORS as exc:
            raise RegistryError(f"etcd read failed at {self._endpoint}: {exc}") from exc
        return WorkerInfo.from_json(_text(values[0])) if values else None

    def watch(self, callback: WatchCallback) -> Callable[[], None]:
        known: set[str] = {w.worker_id for w in self.workers()}

        def on_event(event: dict[str, Any]) -> None:
            kv = event.get("kv", {})
            worker_id = _text(kv.get("key", "")).removeprefix(self._prefix)
            if event.get("type") == "DELETE":
                known.discard(worker_id)
                callback(RegistryEvent("leave", worker_id, None))
                return
            info = WorkerInfo.from_json(_text(kv.get("value", "")))
            is_update = worker_id in known
            known.add(worker_id)
            callback(RegistryEvent("update" if is_update else "join", worker_id, info))

        events, cancel = self._client.watch_prefix(self._prefix)

        def pump() -> None:
            try:
                for event in events:
                    on_event(dict(event))
            except _ETCD_ERRORS:
                return

        thread = threading.Thread(target=pump, name="topkv-etcd-watch", daemon=True)
        thread.start()
        with self._lock:
            self._cancels.append(cancel)
        return cancel

    def close(self) -> None:
        with self._lock:
            cancels, self._cancels = self._cancels, []
        for cancel in cancels:
            cancel()
        self._client.session.close()

    def _put(self, info: WorkerInfo, lease: Lease) -> None:
        try:
            self._client.put(self._prefix + info.worker_id, info.to_json(), lease=lease)
        except _ETCD_ERRORS as exc:
            raise RegistryError(f"etcd write failed at {self._endpoint}: {exc}") from exc
