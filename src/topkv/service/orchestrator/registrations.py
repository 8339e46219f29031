"""The worker registration endpoints over an embedded registry (:class:`Registrations`):
``POST /v1/workers``, ``PUT /v1/workers/{id}/heartbeat``, ``DELETE /v1/workers/{id}``.

Served by ``topkv orchestrator`` (embedded registry) and, through
:class:`RegistrationServer`, by the chaos supervisor and the demo; all hold every worker's
registration handle here."""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from topkv.errors import ConfigError, TopKVError
from topkv.relay.registry.memory import MemoryRegistry, Registration, WorkerRegistry
from topkv.relay.tasks import cancel_and_wait
from topkv.service.http.auth import Access, Route, ServerAuth, forbidden, principal_of, secured_app
from topkv.service.http.util import error_response, model_response, read_model, site_url
from topkv.service.messages import RegisterRequest
from topkv.service.orchestrator.models import HeartbeatAck, WorkerView

if TYPE_CHECKING:
    from topkv.service.http.tls import TLSConfig

#: Who registers, for the limits: a worker token's digest, or (authentication off) the
#: remote address.
Registrant = tuple[str, bytes | str]


@dataclass(frozen=True)
class RegistrationLimits:
    """How hard one worker token may register (``POST /v1/workers``; with authentication
    off, one remote address). Heartbeats and deregistrations are not limited, nor is an
    admin token.

    A worker registers once when it starts and again only after it lost its lease (its
    heartbeat, every ttl/3, found the record gone: the orchestrator restarted, or a
    partition outlasted the TTL). So a token registers about once per worker per lease
    loss, and the defaults never bite a real cluster:

    * ``burst`` registrations at once, then ``rate_per_s`` (a token bucket): a token shared
      by ``burst`` workers that all re-register the moment the orchestrator comes back fits
      in the burst (``topkv cluster up`` gives each worker its own token anyway); a worker
      refused with 429 retries at its next heartbeat. A flood gets 429 with
      ``Retry-After``;
    * ``max_ids`` distinct worker ids held by one token at once (409 beyond): far more
      workers than share one token in any deployment, yet it bounds what a stolen worker
      token can make the orchestrator hold (each record is at most a few KiB:
      :class:`~topkv.service.messages.RegisteredWorker`).
    """

    rate_per_s: float = 10.0
    burst: int = 100
    max_ids: int = 1024
    #: Remote addresses tracked with authentication off (the least recent are forgotten).
    max_registrants: int = 10_000

    def __post_init__(self) -> None:
        if not (self.rate_per_s > 0 and self.burst >= 1 and self.max_ids >= 1):
            raise ConfigError(
                "registration limits need rate_per_s > 0, burst >= 1 and max_ids >= 1"
            )


class _Bucket:
    """A token bucket: ``burst`` tokens, refilled at ``rate_per_s``."""

    __slots__ = ("stamp", "tokens")

    def __init__(self, burst: int, now: float) -> None:
        self.tokens = float(burst)
        self.stamp = now

    def take(self, limits: RegistrationLimits, now: float) -> float:
        """Take one token; 0.0 when it was there, else the seconds until one will be."""
        self.tokens = min(float(limits.burst), self.tokens + (now - self.stamp) * limits.rate_per_s)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / limits.rate_per_s


class Registrations:
    """The registration of every worker that registered over HTTP, by worker id.

    With authentication on, a worker id belongs to the worker token that registered it for
    as long as it stays registered: only that token (or an admin one) may re-register,
    heartbeat or deregister it; any other worker token gets 403 (so does every worker token
    for an id an admin token registered). Registrations of one worker token (with
    authentication off, of one remote address) are limited by :class:`RegistrationLimits`.
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        limits: RegistrationLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.limits = limits or RegistrationLimits()
        self.by_worker: dict[str, Registration] = {}
        self.owner: dict[str, bytes] = {}  # worker id -> the digest of the token that holds it
        self._clock = clock
        self._buckets: OrderedDict[Registrant, _Bucket] = OrderedDict()
        self._held: dict[Registrant, set[str]] = {}  # registrant -> the worker ids it holds
        self._holder: dict[str, Registrant] = {}  # worker id -> its registrant

    def _refused(
        self, request: web.Request, worker_id: str, *, registering: bool = False
    ) -> web.Response | None:
        """403 unless the request's principal may act for ``worker_id``: a registered id is
        its worker token's (one an admin token registered is no worker token's)."""
        principal = principal_of(request)
        if principal is None or principal.admin or worker_id not in self.by_worker:
            return None
        if self.owner.get(worker_id) == principal.token_digest:
            return None
        if registering and self.registry.get(worker_id) is None:
            self.by_worker.pop(worker_id, None)  # its lease ran out: the id is free again
            self.owner.pop(worker_id, None)
            return None
        return forbidden(
            f"worker {worker_id!r} is registered under another token (only that token or an "
            "admin token may act for it)"
        )

    def _claim(self, request: web.Request, worker_id: str) -> None:
        principal = principal_of(request)
        if principal is not None and not principal.admin:
            self.owner[worker_id] = principal.token_digest
        else:
            self.owner.pop(worker_id, None)  # an admin's registration: no worker token's

    # -- limits ------------------------------------------------------------------------------

    @staticmethod
    def _registrant(request: web.Request) -> Registrant | None:
        """Whose limits a registration counts against (None: an admin token, unlimited)."""
        principal = principal_of(request)
        if principal is None:
            return ("address", request.remote or "")
        return None if principal.admin else ("token", principal.token_digest)

    def _throttled(self, registrant: Registrant) -> web.Response | None:
        """429 with ``Retry-After`` when ``registrant`` registers faster than allowed."""
        now = self._clock()
        bucket = self._buckets.get(registrant)
        if bucket is None:
            bucket = self._buckets[registrant] = _Bucket(self.limits.burst, now)
            while len(self._buckets) > self.limits.max_registrants:
                self._buckets.popitem(last=False)
        self._buckets.move_to_end(registrant)
        wait_s = bucket.take(self.limits, now)
        if wait_s == 0.0:
            return None
        answer = error_response(
            429,
            "rate_limited",
            f"too many registrations from this {registrant[0]}: at most {self.limits.burst} "
            f"at once and {self.limits.rate_per_s:g}/s; retry in {wait_s:.1f} s",
            "RateLimited",
        )
        answer.headers["Retry-After"] = str(max(1, math.ceil(wait_s)))
        return answer

    def _over_cap(self, registrant: Registrant, worker_id: str) -> web.Response | None:
        """409 when ``worker_id`` would be one id too many for ``registrant``."""
        held = self._held.get(registrant, set())
        if worker_id in held or len(held) < self.limits.max_ids:
            return None
        live = {w.worker_id for w in self.registry.workers()}
        for stale in [w for w in held if w not in live]:  # their leases ran out
            self._release(stale)
            self.by_worker.pop(stale, None)
            self.owner.pop(stale, None)
        if len(self._held.get(registrant, ())) < self.limits.max_ids:
            return None
        return error_response(
            409,
            "too_many_workers",
            f"this {registrant[0]} already holds {self.limits.max_ids} registered worker ids, "
            "the most one may hold; deregister one first, or give each worker its own token",
            "TooManyWorkers",
        )

    def _hold(self, registrant: Registrant | None, worker_id: str) -> None:
        self._release(worker_id)
        if registrant is not None:
            self._held.setdefault(registrant, set()).add(worker_id)
            self._holder[worker_id] = registrant

    def _release(self, worker_id: str) -> None:
        registrant = self._holder.pop(worker_id, None)
        if registrant is None:
            return
        held = self._held.get(registrant)
        if held is not None:
            held.discard(worker_id)
            if not held:
                del self._held[registrant]

    # -- endpoints ---------------------------------------------------------------------------

    def routes(self) -> list[Route]:
        return [
            Route("POST", "/v1/workers", self.register, Access.WORKER),
            Route("PUT", "/v1/workers/{worker_id}/heartbeat", self.heartbeat, Access.WORKER),
            Route("DELETE", "/v1/workers/{worker_id}", self.deregister, Access.WORKER),
        ]

    async def register(self, request: web.Request) -> web.Response:
        """Register (201) or re-register (200) the worker in the body; 429 when its token
        registers too fast, 409 when it would hold too many worker ids."""
        registrant = self._registrant(request)
        throttled = self._throttled(registrant) if registrant is not None else None
        if throttled is not None:
            return throttled
        body = await read_model(request, RegisterRequest)
        worker_id = body.worker.worker_id
        refused = self._refused(request, worker_id, registering=True)
        if refused is None and registrant is not None:
            refused = self._over_cap(registrant, worker_id)
        if refused is not None:
            return refused
        self._claim(request, worker_id)
        old = self.by_worker.pop(worker_id, None)
        self.by_worker[worker_id] = self.registry.register(body.worker, body.ttl_s)
        self._hold(registrant, worker_id)
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
            self._release(worker_id)
            return error_response(404, "not_found", str(exc))
        return model_response(HeartbeatAck(worker_id=worker_id, ok=True))

    def forget(self, worker_id: str) -> bool:
        """Deregister ``worker_id`` now (False: it held no registration here)."""
        registration = self.by_worker.pop(worker_id, None)
        self.owner.pop(worker_id, None)
        self._release(worker_id)
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
        from topkv.service.http.tls import served_url, server_context

        app = secured_app(self._registrations.routes(), self.auth)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=server_context(tls)).start()
        self._expire = asyncio.create_task(self._expire_loop())
        return served_url(site_url(self._runner, "127.0.0.1"), tls)

    async def close(self) -> None:
        await cancel_and_wait(self._expire)
        if self._runner is not None:
            await self._runner.cleanup()

    def forget(self, worker_id: str) -> None:
        """Remove ``worker_id`` from the registry now (its process is known to be dead)."""
        self._registrations.forget(worker_id)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self.expire_interval_s)
            self.registry.expire()
