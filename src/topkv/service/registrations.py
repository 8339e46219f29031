"""The worker registration endpoints over an embedded registry (:class:`Registrations`):
``POST /v1/workers``, ``PUT /v1/workers/{id}/heartbeat``, ``DELETE /v1/workers/{id}``.

Served by ``topkv orchestrator`` (embedded registry) and, through
:class:`RegistrationServer`, by the chaos supervisor and the demo; all hold every worker's
registration handle here."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from aiohttp import web

from topkv.errors import TopKVError
from topkv.relay.registry import MemoryRegistry, Registration, WorkerRegistry
from topkv.service.api_models import HeartbeatAck, WorkerView
from topkv.service.auth import Access, Route, ServerAuth, forbidden, principal_of, secured_app
from topkv.service.httputil import error_response, model_response, read_model, site_url
from topkv.service.messages import RegisterRequest

if TYPE_CHECKING:
    from topkv.service.tls import TLSConfig


class Registrations:
    """The registration of every worker that registered over HTTP, by worker id.

    With authentication on, a worker id belongs to the worker token that registered it for
    as long as it stays registered: only that token (or an admin one) may re-register,
    heartbeat or deregister it; any other worker token gets 403.
    """

    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry
        self.by_worker: dict[str, Registration] = {}
        self.owner: dict[str, bytes] = {}  # worker id -> the digest of the token that holds it

    def _refused(self, request: web.Request, worker_id: str) -> web.Response | None:
        """403 unless the request's principal may act for ``worker_id``."""
        principal = principal_of(request)
        if principal is None or principal.admin:
            return None
        owner = self.owner.get(worker_id)
        if worker_id in self.by_worker and owner is not None and owner != principal.token_digest:
            return forbidden(f"worker {worker_id!r} is registered under another worker token")
        return None

    def _claim(self, request: web.Request, worker_id: str) -> None:
        principal = principal_of(request)
        if principal is not None and not principal.admin:
            self.owner[worker_id] = principal.token_digest

    def routes(self) -> list[Route]:
        return [
            Route("POST", "/v1/workers", self.register, Access.WORKER),
            Route("PUT", "/v1/workers/{worker_id}/heartbeat", self.heartbeat, Access.WORKER),
            Route("DELETE", "/v1/workers/{worker_id}", self.deregister, Access.WORKER),
        ]

    async def register(self, request: web.Request) -> web.Response:
        """Register (201) or re-register (200) the worker in the body."""
        body = await read_model(request, RegisterRequest)
        refused = self._refused(request, body.worker.worker_id)
        if refused is not None:
            return refused
        self._claim(request, body.worker.worker_id)
        old = self.by_worker.pop(body.worker.worker_id, None)
        self.by_worker[body.worker.worker_id] = self.registry.register(body.worker, body.ttl_s)
        answer = WorkerView(worker=body.worker, slots_used=0)
        return model_response(answer, status=200 if old is not None else 201)

    async def heartbeat(self, request: web.Request) -> web.Response:
        """Renew the worker's lease; 404 when it is not (or no longer) registered."""
        worker_id = request.match_info["worker_id"]
        registration = self.by_worker.get(worker_id)
        if registration is None:
            return not_registered(worker_id)
        refused = self._refused(request, worker_id)
        if refused is not None:
            return refused
        try:
            registration.heartbeat()
        except TopKVError as exc:
            self.by_worker.pop(worker_id, None)
            return error_response(404, "not_found", str(exc))
        return model_response(HeartbeatAck(worker_id=worker_id, ok=True))

    def forget(self, worker_id: str) -> bool:
        """Deregister ``worker_id`` now (False: it held no registration here)."""
        registration = self.by_worker.pop(worker_id, None)
        self.owner.pop(worker_id, None)
        if registration is None:
            return False
        registration.deregister()
        return True

    async def deregister(self, request: web.Request) -> web.Response:
        """Deregister the worker (204); 404 when it is not registered."""
        worker_id = request.match_info["worker_id"]
        refused = self._refused(request, worker_id)
        if refused is not None:
            return refused
        if not self.forget(worker_id):
            return not_registered(worker_id)
        return web.Response(status=204)


def not_registered(worker_id: str) -> web.Response:
    return error_response(404, "not_found", f"worker {worker_id!r} is not registered")


class RegistrationServer:
    """An embedded registry's worker endpoints, served from this process on loopback.

    Workers in other processes register, heartbeat and deregister here (the same
    ``/v1/workers`` endpoints as ``topkv orchestrator``); expired leases are swept every
    ``expire_interval_s``. Holding every registration lets a supervisor (chaos, the demo)
    remove a worker it saw die (:meth:`forget`), as a node agent would.
    """

    def __init__(
        self,
        registry: MemoryRegistry,
        auth: ServerAuth | None,
        expire_interval_s: float = 0.25,
    ) -> None:
        """``auth``: the worker tokens it accepts (None: open, on purpose)."""
        self.registry = registry
        self.auth = auth
        self.expire_interval_s = expire_interval_s
        self._registrations = Registrations(registry)
        self._runner: web.AppRunner | None = None
        self._expire: asyncio.Task[None] | None = None

    async def start(self, tls: TLSConfig | None = None) -> str:
        """Serve on a free loopback port (HTTPS with ``tls``); the URL workers register at."""
        from topkv.service.tls import served_url, server_context

        app = secured_app(self._registrations.routes(), self.auth)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=server_context(tls)).start()
        self._expire = asyncio.create_task(self._expire_loop())
        return served_url(site_url(self._runner, "127.0.0.1"), tls)

    async def close(self) -> None:
        if self._expire is not None:
            self._expire.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expire
        if self._runner is not None:
            await self._runner.cleanup()

    def forget(self, worker_id: str) -> None:
        """Remove ``worker_id`` from the registry now (its process is known to be dead)."""
        self._registrations.forget(worker_id)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self.expire_interval_s)
            self.registry.expire()
