"""etcd backend of the worker registry (through etcd's v3 HTTP gateway, via ``etcd3gw``).

Layout: one key per worker, ``<prefix>/workers/<worker_id>``, whose value is the
:class:`WorkerInfo` JSON, attached to a lease of the worker's TTL. A worker that stops
heartbeating loses its lease and etcd deletes the key; a prefix watch turns puts and
deletes into join/update/leave events. An orchestrator that restarts simply lists the
prefix again, so its view is rebuilt from etcd alone.

Why etcd3gw: it is maintained (OpenStack), typed, and speaks the gRPC gateway over plain
HTTP, so it avoids the protobuf/grpc version pinning that broke the older ``etcd3`` client.

Access (docs/etcd.md): ``etcds://`` speaks TLS (a CA file, optionally a client certificate);
a user and password log in to an etcd with ``auth enable`` (:mod:`topkv.relay.registry.etcd_access`
parses them, :mod:`topkv.relay.registry.etcd_session` sends the token and explains refusals).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping
from typing import Any

from etcd3gw.client import Etcd3Client
from etcd3gw.lease import Lease

from topkv.errors import ConfigError
from topkv.relay.registry.base import RegistryError, WatchCallback
from topkv.relay.registry.etcd_access import DEFAULT_PREFIX, EtcdLogin, EtcdTLS, parse_etcd_url
from topkv.relay.registry.etcd_session import ETCD_ERRORS, EtcdSession, explain_failure
from topkv.relay.workers import RegistryEvent, Role, WorkerInfo

__all__ = ["DEFAULT_PREFIX", "EtcdRegistry"]
_ETCD_ERRORS = ETCD_ERRORS


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
            raise self._registry._explain(exc, "renewing the lease (heartbeat)") from exc
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
            raise self._registry._explain(exc, "revoking the lease (deregister)") from exc


class EtcdRegistry:
    """Worker registry kept in etcd with leases (TTL) and prefix watches."""

    def __init__(
        self,
        host: str,
        port: int,
        prefix: str = DEFAULT_PREFIX,
        timeout_s: float = 5.0,
        *,
        tls: EtcdTLS | None = None,
        login: EtcdLogin | None = None,
    ) -> None:
        if tls is not None:
            tls.check()
        self._endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._tls = tls
        self._login = login
        self._session = EtcdSession(self._endpoint, tls, login, timeout_s)
        self._client = Etcd3Client(
            host=host,
            port=port,
            protocol="https" if tls is not None else "http",
            timeout=timeout_s,
            session=self._session,
        )
        self._prefix = prefix.rstrip("/") + "/workers/"
        self._cancels: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        try:
            self._client.status()
            self._session.log_in(self._client.get_url("/auth/authenticate"))
        except _ETCD_ERRORS as exc:
            self._session.close()
            raise self._explain(exc, "connecting") from exc
        except RegistryError:
            self._session.close()
            raise

    @classmethod
    def from_url(cls, url: str, env: Mapping[str, str] | None = None) -> EtcdRegistry:
        """Open ``etcd[s]://[USER@]HOST:PORT[/prefix][?ca=&cert=&key=]``; credentials and TLS
        files may come from the ``TOPKV_ETCD_*`` variables of ``env`` (default: os.environ)."""
        access = parse_etcd_url(url, env)
        return cls(access.host, access.port, access.prefix, tls=access.tls, login=access.login)

    def register(self, info: WorkerInfo, ttl_s: float = 10.0) -> _EtcdRegistration:
        if ttl_s <= 0:
            raise ConfigError(f"registry TTL must be positive, got {ttl_s}")
        try:
            lease = self._client.lease(ttl=max(1, round(ttl_s)))
        except _ETCD_ERRORS as exc:
            raise self._explain(exc, "granting a lease") from exc
        try:
            self._put(info, lease)
        except RegistryError:
            with contextlib.suppress(*_ETCD_ERRORS, RegistryError):
                lease.revoke()
            raise
        return _EtcdRegistration(self, info, lease)

    def workers(self, role: Role | None = None) -> list[WorkerInfo]:
        try:
            values = self._client.get_prefix(self._prefix)
        except _ETCD_ERRORS as exc:
            raise self._explain(exc, "reading workers") from exc
        infos = [WorkerInfo.from_json(_text(value)) for value, _meta in values]
        return sorted(
            (i for i in infos if role is None or i.role == role), key=lambda i: i.worker_id
        )

    def get(self, worker_id: str) -> WorkerInfo | None:
        try:
            values = self._client.get(self._prefix + worker_id)
        except _ETCD_ERRORS as exc:
            raise self._explain(exc, "reading workers") from exc
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

        try:
            events, cancel = self._client.watch_prefix(self._prefix)
        except _ETCD_ERRORS as exc:
            raise self._explain(exc, "watching workers") from exc

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
            raise self._explain(exc, "writing a worker record") from exc

    def _explain(self, exc: Exception, action: str) -> RegistryError:
        return explain_failure(
            exc,
            action=action,
            endpoint=self._endpoint,
            prefix=self._prefix,
            login=self._login,
            tls=self._tls,
        )
