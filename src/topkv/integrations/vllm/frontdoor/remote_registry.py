"""The front door reading its instances from a ``topkv orchestrator``'s registry (or etcd).

With ``topkv router --registry URL`` the vLLM instances register with the orchestrator (its
``POST /v1/workers``, worker tokens, leases), so the orchestrator's registry and policies
see them like any worker; the front door polls ``GET /v1/workers`` (an admin token) every
``poll_s`` and serves its picks from the last answer. A registry that stops answering is
trusted for ``stale_s`` more; after that the front door has no instances and says why
(``problem``), which its 503 passes on.

A dead instance the front door found (:meth:`forget`) is dropped from the cached list at once
and deregistered at the orchestrator with the admin token; if it was alive after all, its
next heartbeat finds no record and registers it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from topkv.relay.registry.base import Registration, RegistryError, WatchCallback
from topkv.relay.registry.etcd_access import is_etcd_url
from topkv.relay.registry.memory import open_registry, redact_registry_url
from topkv.relay.workers import RegistryEvent, Role, WorkerInfo
from topkv.service.http.auth import auth_headers
from topkv.service.orchestrator.models import WorkerList

log = logging.getLogger(__name__)

_TIMEOUT = aiohttp.ClientTimeout(total=5.0, connect=2.0)


class OrchestratorRegistry:
    """A read-only :class:`~topkv.relay.registry.base.WorkerRegistry` over an orchestrator's
    ``GET /v1/workers``; :meth:`start` it on the front door's event loop."""

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        poll_s: float = 0.5,
        stale_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise RegistryError(
                f"--registry {url!r}: give the orchestrator's URL, http://HOST:PORT"
            )
        self.url = url.rstrip("/")
        self.poll_s = poll_s
        self.stale_s = stale_s
        #: How long a worker the front door dropped stays hidden while still listed.
        self.hide_s = stale_s
        self._clock = clock
        self._headers = auth_headers(token)
        self._workers: dict[str, WorkerInfo] = {}
        self._fetched_at: float | None = None
        self._forgotten: dict[str, float] = {}  # worker id -> when the front door dropped it
        self._callbacks: list[WatchCallback] = []
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        #: Why the last poll failed (None: it answered).
        self.problem: str | None = None

    # -- WorkerRegistry -----------------------------------------------------------------------

    def register(self, info: WorkerInfo, ttl_s: float = 10.0) -> Registration:
        raise RegistryError(
            f"the front door reads its instances from {self.url}: register with it there"
        )

    def workers(self, role: Role | None = None) -> list[WorkerInfo]:
        if self._fetched_at is None or self._clock() - self._fetched_at > self.stale_s:
            return []
        return [w for w in self._workers.values() if role is None or w.role == role]

    def get(self, worker_id: str) -> WorkerInfo | None:
        return next((w for w in self.workers() if w.worker_id == worker_id), None)

    def watch(self, callback: WatchCallback) -> Callable[[], None]:
        self._callbacks.append(callback)
        return lambda: self._callbacks.remove(callback)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # -- polling ------------------------------------------------------------------------------

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=_TIMEOUT)
        return self._session

    async def _fetch(self) -> dict[str, WorkerInfo]:
        """The registered workers by id; raises RegistryError saying what went wrong."""
        try:
            async with self._client().get(self.url + "/v1/workers", headers=self._headers) as r:
                text = await r.text()
                if r.status in (401, 403):
                    raise RegistryError(
                        f"{self.url} refused the front door's token ({r.status}): give the "
                        "orchestrator's admin token with --registry-token-file"
                    )
                if r.status != 200:
                    raise RegistryError(f"GET {self.url}/v1/workers -> {r.status}: {text[:200]}")
            listed = WorkerList.model_validate_json(text)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise RegistryError(
                f"the registry at {self.url} is unreachable: {exc or type(exc).__name__}"
            ) from exc
        except ValueError as exc:
            raise RegistryError(f"GET {self.url}/v1/workers: not a worker list: {exc}") from exc
        return {v.worker.worker_id: v.worker for v in listed.workers}

    async def refresh(self) -> None:
        """Fetch the registry's workers once (``problem`` says why it failed)."""
        try:
            fresh = await self._fetch()
        except RegistryError as exc:
            self._failed(str(exc))
            return
        now = self._clock()
        # a worker dropped here stays dropped until the orchestrator's list (polled after the
        # DELETE) no longer has it, or its own heartbeat registered it again
        for worker_id, when in list(self._forgotten.items()):
            if worker_id not in fresh or now - when > self.hide_s:
                del self._forgotten[worker_id]
            else:
                fresh.pop(worker_id)
        self._emit(fresh)
        self._workers = fresh
        self._fetched_at = now
        if self.problem is not None:
            log.warning("router: the registry at %s answers again", self.url)
        self.problem = None

    def _failed(self, why: str) -> None:
        if self.problem != why:
            log.warning("router: %s", why)
        self.problem = why

    def _emit(self, fresh: dict[str, WorkerInfo]) -> None:
        events = [RegistryEvent("leave", w, None) for w in self._workers if w not in fresh]
        for worker_id, info in fresh.items():
            old = self._workers.get(worker_id)
            if old != info:
                events.append(RegistryEvent("join" if old is None else "update", worker_id, info))
        for event in events:
            for callback in list(self._callbacks):
                callback(event)

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.refresh()

    async def forget(self, worker_id: str) -> None:
        """Drop ``worker_id`` now and deregister it at the orchestrator (best effort)."""
        self._workers.pop(worker_id, None)
        self._forgotten[worker_id] = self._clock()
        await self._deregister(worker_id)

    async def _deregister(self, worker_id: str) -> None:
        url = f"{self.url}/v1/workers/{worker_id}"
        try:
            async with self._client().delete(url, headers=self._headers) as answer:
                if answer.status not in (204, 404):
                    log.warning("router: DELETE %s -> %s", url, answer.status)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.warning("router: deregistering %s at %s: %s", worker_id, self.url, exc)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._session is not None:
            await self._session.close()


class EtcdReadRegistry(OrchestratorRegistry):
    """The same, over an etcd registry (``etcd://`` or ``etcds://``, credentials from
    ``TOPKV_ETCD_*``): the instances hold their own leases there (a connector's
    ``registry_url`` of the same URL), and the front door lists them every ``poll_s`` (off
    its event loop). A dead instance is only hidden here until its lease runs out: its
    lease is its own."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__("http://etcd.invalid", None, **kwargs)
        self.url = redact_registry_url(url)
        self.hide_s = 15.0  # past a connector's 6 s lease
        self._etcd = open_registry(url)

    async def _fetch(self) -> dict[str, WorkerInfo]:
        try:
            listed = await asyncio.to_thread(self._etcd.workers)
        except RegistryError as exc:
            raise RegistryError(f"the registry at {self.url} is unreachable: {exc}") from exc
        return {w.worker_id: w for w in listed}

    async def _deregister(self, worker_id: str) -> None:
        return  # its lease expires on its own

    async def aclose(self) -> None:
        await super().aclose()
        await asyncio.to_thread(self._etcd.close)


def polled_registry(url: str, token: str | None) -> OrchestratorRegistry:
    """The front door's view of the registry at ``url``: an orchestrator (``http(s)://``)
    or etcd (``etcd(s)://``)."""
    if is_etcd_url(url):
        return EtcdReadRegistry(url)
    return OrchestratorRegistry(url, token)
