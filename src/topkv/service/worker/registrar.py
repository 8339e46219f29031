"""How a worker process registers itself: in etcd directly, or through the orchestrator.

An orchestrator with an embedded (``memory``) registry keeps it in its own process, so
workers in other processes register over its HTTP API (``POST /v1/workers``, heartbeat with
``PUT /v1/workers/{id}/heartbeat``, ``DELETE /v1/workers/{id}``). With etcd every worker
holds its own lease.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol, TypeVar

import aiohttp

from topkv.errors import TopKVError
from topkv.relay.registry.etcd_access import is_etcd_url
from topkv.relay.registry.memory import Registration, WorkerRegistry, open_registry
from topkv.relay.workers import WorkerInfo
from topkv.service.errors import ServiceError, ServiceUnreachable
from topkv.service.http.auth import auth_headers
from topkv.service.http.tls import ClientTLS, client_context, tls_failure
from topkv.service.messages import RegisterRequest

_TIMEOUT = aiohttp.ClientTimeout(total=5.0)


T = TypeVar("T")


class Registrar(Protocol):
    async def register(self, info: WorkerInfo, ttl_s: float) -> None: ...

    async def update(self, info: WorkerInfo, ttl_s: float) -> None:
        """Replace the registered record (same worker id, e.g. a new role), keeping the
        lease where the backend has one; registers ``info`` when nothing is registered."""
        ...

    async def heartbeat(self) -> None:
        """Extend the lease; raise ServiceError when the record is gone (register again)."""
        ...

    async def deregister(self) -> None: ...

    async def close(self) -> None: ...


class HttpRegistrar:
    """Registers through an orchestrator's ``/v1/workers`` endpoints."""

    def __init__(
        self, orchestrator_url: str, token: str | None = None, tls: ClientTLS | None = None
    ) -> None:
        """``token``: this worker's worker token (None: the orchestrator runs open).
        ``tls``: how an ``https://`` orchestrator is verified (None: the system's store)."""
        self._base = orchestrator_url.rstrip("/")
        self._tls = tls
        self._headers = {"Content-Type": "application/json", **auth_headers(token)}
        self._session: aiohttp.ClientSession | None = None
        self._worker_id = ""

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=client_context(self._tls) or True)
            self._session = aiohttp.ClientSession(timeout=_TIMEOUT, connector=connector)
        return self._session

    async def _call(self, method: str, path: str, body: str | None = None) -> int:
        url = f"{self._base}{path}"
        try:
            async with self._client().request(
                method, url, data=body, headers=self._headers
            ) as response:
                text = await response.text()
                if response.status == 401:
                    raise ServiceError(
                        f"{method} {url} -> 401: the orchestrator does not accept this "
                        "worker's token; give the cluster's worker token with --token-file "
                        "(or $TOPKV_TOKEN_FILE)"
                    )
                if response.status == 403:
                    raise ServiceError(f"{method} {url} -> 403: {text[:300]}")
                if response.status == 429:
                    retry = response.headers.get("Retry-After", "a while")
                    raise ServiceError(
                        f"{method} {url} -> 429: registrations throttled; retrying after "
                        f"{retry} s (at the next heartbeat)"
                    )
                if response.status >= 500 or response.status in (400, 409, 422):
                    raise ServiceError(f"{method} {url} -> {response.status}: {text[:300]}")
                return response.status
        except (TimeoutError, aiohttp.ClientError) as exc:
            failure = tls_failure(url, exc, self._tls)
            if failure is not None:
                raise failure from None
            raise ServiceUnreachable(f"orchestrator at {self._base} unreachable: {exc}") from exc

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        self._worker_id = info.worker_id
        body = RegisterRequest(worker=info, ttl_s=ttl_s).model_dump_json()
        await self._call("POST", "/v1/workers", body)

    async def update(self, info: WorkerInfo, ttl_s: float) -> None:
        """Registering the same worker id again replaces its record (200)."""
        await self.register(info, ttl_s)

    async def heartbeat(self) -> None:
        status = await self._call("PUT", f"/v1/workers/{self._worker_id}/heartbeat")
        if status == 404:
            raise ServiceError(f"orchestrator forgot worker {self._worker_id} (lease expired)")

    async def deregister(self) -> None:
        if self._worker_id:
            await self._call("DELETE", f"/v1/workers/{self._worker_id}")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class DirectRegistrar:
    """Registers in a registry backend from this process.

    ``in_thread``: backend calls run in a thread (etcd: network round trips); false runs
    them on the calling event-loop thread (an in-memory registry shared with an
    orchestrator in this loop, whose view then sees the change at once). ``owns_registry``:
    :meth:`close` closes the registry; false leaves it open for the party that owns it.
    """

    def __init__(
        self, registry: WorkerRegistry, *, in_thread: bool = True, owns_registry: bool = True
    ) -> None:
        self._registry = registry
        self._registration: Registration | None = None
        self._in_thread = in_thread
        self._owns_registry = owns_registry

    async def _run(self, call: Callable[[], T]) -> T:
        return await asyncio.to_thread(call) if self._in_thread else call()

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        try:
            self._registration = await self._run(lambda: self._registry.register(info, ttl_s))
        except TopKVError as exc:
            raise ServiceError(f"registration failed: {exc}") from exc

    async def update(self, info: WorkerInfo, ttl_s: float) -> None:
        registration = self._registration
        if registration is None:
            await self.register(info, ttl_s)
            return
        try:
            await self._run(lambda: registration.update(info))
        except TopKVError as exc:
            raise ServiceError(f"updating the registration failed: {exc}") from exc

    async def heartbeat(self) -> None:
        registration = self._registration
        if registration is None:
            raise ServiceError("not registered")
        try:
            await self._run(registration.heartbeat)
        except TopKVError as exc:
            raise ServiceError(str(exc)) from exc

    async def deregister(self) -> None:
        registration, self._registration = self._registration, None
        if registration is not None:
            try:
                await self._run(registration.deregister)
            except TopKVError as exc:
                raise ServiceError(str(exc)) from exc

    async def close(self) -> None:
        if self._owns_registry:
            await asyncio.to_thread(self._registry.close)


def open_registrar(
    orchestrator_url: str,
    registry_url: str,
    token: str | None = None,
    tls: ClientTLS | None = None,
) -> Registrar:
    """Direct registration for ``etcd://`` registries, else through the orchestrator (with
    ``token``, this worker's worker token, verifying an ``https://`` one with ``tls``)."""
    if registry_url and is_etcd_url(registry_url):
        return DirectRegistrar(open_registry(registry_url))
    if orchestrator_url:
        return HttpRegistrar(orchestrator_url, token, tls)
    raise ServiceError(
        f"registry {registry_url!r} lives inside the orchestrator: give --orchestrator URL"
    )
