"""The orchestrator as a service: an aiohttp app around :class:`topkv.relay.Orchestrator`.

Endpoints (full reference with bodies in ``docs/services.md``; schema at ``/openapi.json``):

* ``POST /v1/requests`` submit, ``GET /v1/requests/{id}`` status, ``DELETE`` abort;
* ``GET /v1/transfers`` the active-transfer registry (plus recent history);
* ``GET /v1/workers``; ``POST /v1/workers``, ``PUT /v1/workers/{id}/heartbeat``,
  ``DELETE /v1/workers/{id}`` (registration for workers in other processes when the
  registry is embedded; with etcd workers register there directly);
* ``GET /v1/experts`` (MoE expert registry, filters ``expert``/``domain``/``worker``),
  ``GET /v1/topology``, ``GET /healthz``, ``GET /readyz``, ``GET /metrics``,
  ``GET /openapi.json``.

Transfers are executed by :class:`~topkv.service.orchestrator.executor.RemoteExecutor`, which
drives the workers' control APIs. A *decode stand-in* consumes each completion: it reads
the delivered KV's digest at the decode worker, checks it against the source's, for a
prompt request with ``new_tokens`` has the decode worker's model generate them from that KV
(``decode_check.tokens``), then frees the copy and the decode slot.

A prompt request (``prompt`` or ``prompt_seed``) starts the prefill worker's model on the
prompt without waiting and submits the transfer with a deferred digest at once, so the
first attempt streams each layer while prefill still computes the next. A prefill worker
that fails the start or answers nonsense is benched and the request started on another
(:mod:`~topkv.service.orchestrator.prefill_start`): 502/503 only when none is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter

from topkv.errors import ConfigError, TopKVError
from topkv.policy.adapters import cluster_from_json, pair_view_from_cluster
from topkv.policy.adp.pool import ADPConfig
from topkv.policy.view import PairView
from topkv.relay.completions import Completion
from topkv.relay.executor import AttemptFailed
from topkv.relay.orchestrator import Orchestrator, OrchestratorClosed, QueueFull, UnknownWorker
from topkv.relay.orchestrator_config import OrchestratorConfig
from topkv.relay.pairs import PairViewCache, endpoint_of
from topkv.relay.registry.memory import (
    MemoryRegistry,
    WorkerRegistry,
    open_registry,
    redact_registry_url,
)
from topkv.relay.transfers import (
    DuplicateRequest,
    Outcome,
    TransferRecord,
    TransferState,
    UnknownRequest,
)
from topkv.relay.workers import WorkerInfo
from topkv.service.http.auth import (
    REQUIRED,
    Access,
    Required,
    Route,
    ServerAuth,
    chosen_auth,
    secured_app,
    warn_insecure,
)
from topkv.service.http.tls import TLSConfig, client_tls, served_url, server_context
from topkv.service.http.util import (
    MAX_BODY_BYTES,
    count_param,
    error_middleware,
    error_response,
    int_param,
    model_response,
    read_model,
)
from topkv.service.messages import LayoutModel, PrefillRequest
from topkv.service.orchestrator.adp import ServiceADP, adp_handler
from topkv.service.orchestrator.executor import RemoteExecutor
from topkv.service.orchestrator.experts import ExpertsApi
from topkv.service.orchestrator.leadership import LeaderElectConfig, Leadership
from topkv.service.orchestrator.models import (
    DecodeCheck,
    Health,
    PairPaths,
    PathView,
    Readiness,
    SubmitRequest,
    TopologyView,
    TransferList,
    TransferView,
    WorkerList,
    WorkerView,
)
from topkv.service.orchestrator.openapi import openapi_document
from topkv.service.orchestrator.prefill_start import (
    PrefillHealth,
    PrefillStarter,
    PrefillUnavailable,
)
from topkv.service.orchestrator.registrations import RegistrationLimits, Registrations
from topkv.service.worker.media import check_medium_name
from topkv.topology.model import Cluster, TopologyError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OrchestratorServiceConfig:
    """``auth``: the tokens the orchestrator accepts and the admin token its executor sends
    to the workers, or None for no authentication at all (``--insecure-no-auth``); there is
    no default, so nothing runs open by omission. ``tls``: HTTPS for its API and how its
    executor verifies the workers (None: plain HTTP, the system's trust store)."""

    auth: ServerAuth | Required | None = REQUIRED
    registry: str = "memory"
    topology_file: Path | None = None
    relay: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    expire_interval_s: float = 0.25
    decode_checks_kept: int = 10_000
    #: Largest request body read (bytes); a larger one gets 413 unread (docs/security.md).
    max_body_bytes: int = MAX_BODY_BYTES
    #: How fast one worker token may register, and how many worker ids it may hold.
    registration_limits: RegistrationLimits = field(default_factory=RegistrationLimits)
    tls: TLSConfig | None = None
    #: Campaign for leadership (``--leader-elect``); None: this orchestrator always leads.
    leader_elect: LeaderElectConfig | None = None
    #: The live Adaptive Decoder Pool (``--adp on``; docs/adp.md), ticking every
    #: ``adp_tick_s`` while this orchestrator leads; None: off.
    adp: ADPConfig | None = None
    adp_tick_s: float = 1.0

    def __post_init__(self) -> None:
        if self.leader_elect is not None and self.registry == "memory":
            raise ConfigError(
                "--leader-elect needs a registry the orchestrators share: --registry etcd://..."
            )
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        chosen_auth(self.auth, "the orchestrator needs auth=ServerAuth(...) (tokens)")

    @property
    def server_auth(self) -> ServerAuth | None:
        assert not isinstance(self.auth, Required)
        return self.auth


class TopologyPairs:
    """Pair views from a discovered topology file, falling back to the registrations."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._fallback = PairViewCache()
        self._cache: dict[tuple[WorkerInfo, WorkerInfo], PairView] = {}

    def __call__(self, src: WorkerInfo, dst: WorkerInfo) -> PairView:
        key = (src, dst)
        view = self._cache.get(key)
        if view is None:
            try:
                view = pair_view_from_cluster(self.cluster, endpoint_of(src), endpoint_of(dst))
            except TopologyError:
                view = self._fallback(src, dst)
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[key] = view
        return view


def load_topology(path: Path) -> Cluster:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read topology file {path}: {exc.strerror}") from None
    return cluster_from_json(text, origin=str(path))


class OrchestratorService:
    """Registry + orchestrator + remote executor + decode stand-in, served over HTTP."""

    def __init__(self, config: OrchestratorServiceConfig) -> None:
        self.config = config
        self.registry: WorkerRegistry = open_registry(config.registry)
        self.embedded = isinstance(self.registry, MemoryRegistry)
        self.cluster = load_topology(config.topology_file) if config.topology_file else None
        self.pairs = TopologyPairs(self.cluster) if self.cluster is not None else PairViewCache()
        auth = config.server_auth
        self.executor = RemoteExecutor(
            call_timeout_s=config.relay.executor_call_timeout_s,
            token=auth.client_token if auth is not None else None,
            tls=client_tls(config.tls),
        )
        self.orchestrator = Orchestrator(
            self.registry, self.executor, config=config.relay, pair_view=self.pairs
        )
        self.decode_checks = Counter(
            "topkv_decode_checks",
            "Delivered KV checked by the decode stand-in against the source digest",
            ["result"],
            registry=self.orchestrator.metrics.registry,
        )
        self.leadership = Leadership(config.leader_elect, self.executor)
        self.adp = (
            ServiceADP(
                self.orchestrator,
                self.executor,
                config.adp,
                tick_s=config.adp_tick_s,
                acting=self.leadership.acting,
            )
            if config.adp is not None
            else None
        )
        self._registrations = Registrations(self.registry, config.registration_limits)
        self._checks: OrderedDict[int, DecodeCheck] = OrderedDict()
        self._generate: OrderedDict[int, int] = OrderedDict()  # request -> new_tokens
        self._ids = itertools.count(1)
        self.prefill_health = PrefillHealth(self.orchestrator.metrics.registry)
        self.prefill = PrefillStarter(self.executor, self.prefill_health, self._prefill_pool)
        self._tasks: list[asyncio.Task[None]] = []
        self._decode_tasks: set[asyncio.Task[None]] = set()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        await self.orchestrator.start()
        self._tasks.append(asyncio.create_task(self._consume_completions(), name="decode"))
        if self.embedded:
            self._tasks.append(asyncio.create_task(self._expire_loop(), name="expire"))
        if self.adp is not None:
            self.adp.start()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self.leadership.stop()
        if self.adp is not None:
            await self.adp.stop()
        await self.orchestrator.close()
        for task in list(self._decode_tasks):
            task.cancel()
        await asyncio.gather(*self._decode_tasks, return_exceptions=True)
        await self.prefill.close()
        await self.executor.close()
        await asyncio.to_thread(self.registry.close)

    async def _expire_loop(self) -> None:
        assert isinstance(self.registry, MemoryRegistry)
        while True:
            await asyncio.sleep(self.config.expire_interval_s)
            self.registry.expire()

    async def _consume_completions(self) -> None:
        """The decode stand-in: check each delivered KV, then free it and its slot."""
        while True:
            try:
                completion = await self.orchestrator.next_completion(3600.0)
            except TimeoutError:
                continue
            if completion.outcome == Outcome.DELIVERED:
                task = asyncio.create_task(self._decode(completion))
                self._decode_tasks.add(task)
                task.add_done_callback(self._decode_tasks.discard)

    async def _decode(self, completion: Completion) -> None:
        rid = completion.request_id
        record = self.orchestrator.transfers.get(rid)
        worker = self.orchestrator.view.get(completion.destination or "")
        check: DecodeCheck
        if worker is None or record is None:
            check = DecodeCheck(
                worker=completion.destination or "",
                digest=None,
                matches_source=False,
                detail="the decode worker left before decode took the KV",
            )
        else:
            if self.adp is not None:
                self.adp.delivered(record)  # the first token is out: a TTFT
            check = await self._check_and_generate(worker, rid, record.source_digest)
            await self.executor.discard_destination(worker, rid)
        self.decode_checks.labels("match" if check.matches_source else "mismatch").inc()
        self._checks[rid] = check
        while len(self._checks) > self.config.decode_checks_kept:
            self._checks.popitem(last=False)
        with contextlib.suppress(UnknownRequest):
            self.orchestrator.release_decode_slot(rid)

    async def _check_and_generate(
        self, worker: WorkerInfo, rid: int, source_digest: int | None
    ) -> DecodeCheck:
        """The held KV's digest against the source's; then the tokens asked for, if any."""
        new_tokens = self._generate.pop(rid, 0)
        try:
            digest = await self.executor.held_digest(worker, rid)
        except AttemptFailed as exc:
            return DecodeCheck(
                worker=worker.worker_id, digest=None, matches_source=False, detail=str(exc)
            )
        check = DecodeCheck(
            worker=worker.worker_id, digest=digest, matches_source=digest == source_digest
        )
        if new_tokens and check.matches_source:
            first_token = self.executor.first_token(rid)
            try:
                decoded = await self.executor.decode(worker, rid, first_token, new_tokens)
            except (AttemptFailed, ConfigError) as exc:
                check.detail = f"decode failed: {exc}"
            else:
                check.tokens = decoded.tokens
        return check

    # -- helpers -----------------------------------------------------------------------------

    def view_of(self, record: TransferRecord) -> TransferView:
        data = record.to_dict()
        data["source_digest"] = record.source_digest
        data["decode_check"] = self._checks.get(record.request_id)
        return TransferView.model_validate(data)

    def _prefill_pool(self) -> list[WorkerInfo]:
        if self.adp is not None:  # converted workers in, drained ones out
            return list(self.adp.prefill_workers())
        return list(self.orchestrator.view.workers("prefill"))

    def _pick_source(self) -> WorkerInfo:
        """The next healthy prefill worker (for a request that starts no prefill)."""
        return self.prefill.candidates()[0]

    def _next_id(self) -> int:
        while True:
            rid = next(self._ids)
            if self.orchestrator.transfers.get(rid) is None:
                return rid

    # -- HTTP --------------------------------------------------------------------------------

    def app(self) -> web.Application:
        routes = [
            Route("POST", "/v1/requests", self.submit, Access.ADMIN),
            Route("GET", "/v1/requests/{request_id}", self.get_request, Access.ADMIN),
            Route("DELETE", "/v1/requests/{request_id}", self.abort_request, Access.ADMIN),
            Route("GET", "/v1/transfers", self.list_transfers, Access.ADMIN),
            Route("GET", "/v1/workers", self.list_workers, Access.ADMIN),
            Route("POST", "/v1/workers", self.register_worker, Access.WORKER),
            Route("PUT", "/v1/workers/{worker_id}/heartbeat", self.heartbeat_worker, Access.WORKER),
            Route("DELETE", "/v1/workers/{worker_id}", self.deregister_worker, Access.WORKER),
            Route("GET", "/v1/topology", self.topology, Access.ADMIN),
            *ExpertsApi(self.orchestrator.view, self.orchestrator.clock).routes(),
            Route("GET", "/v1/adp", adp_handler(self.adp), Access.ADMIN),
            Route("GET", "/v1/leader", self.leadership.leader, Access.PUBLIC),
            Route("GET", "/healthz", self.healthz, Access.PUBLIC),
            Route("GET", "/readyz", self.readyz, Access.PUBLIC),
            Route("GET", "/metrics", self.metrics, Access.METRICS),
            Route("GET", "/openapi.json", self.openapi, Access.PUBLIC),
        ]
        return secured_app(
            routes,
            self.config.server_auth,
            middlewares=[self.leadership.middleware, _error_middleware],
            client_max_size=self.config.max_body_bytes,
        )

    async def submit(self, request: web.Request) -> web.Response:
        body = await read_model(request, SubmitRequest)
        layout = None if body.is_prompt else body.resolved_layout().to_layout()
        starts_prefill = body.is_prompt or body.prefill
        chosen = self.orchestrator.view.get(body.source) if body.source else None
        if body.source and (chosen is None or chosen.role != "prefill"):
            raise UnknownWorker(f"{body.source!r} is not a registered prefill worker")
        if chosen is None and not self._prefill_pool():
            raise UnknownWorker("no prefill worker is registered")
        if chosen is None and not starts_prefill:
            chosen = self._pick_source()
        rid = body.request_id if body.request_id is not None else self._next_id()
        existing = self.orchestrator.transfers.get(rid)
        if existing is not None and not existing.terminal:
            raise DuplicateRequest(f"request {rid} is already being transferred")
        if body.medium is not None:
            check_medium_name(body.medium)
        self.executor.force_medium(rid, body.medium)
        if body.is_prompt:
            record = await self._submit_prompt(body, rid, chosen)
            if self.adp is not None:
                self.adp.arrived(record.layout.seq_len)
            return model_response(self.view_of(record), status=202)
        assert layout is not None
        digest: int | None = None
        if body.prefill:
            source, held = await self.prefill.start(
                rid, PrefillRequest(model_id=body.model, layout=LayoutModel.of(layout)), chosen
            )
            digest = held.digest
        else:
            assert chosen is not None
            source = chosen
        record = await self.orchestrator.submit(
            rid,
            body.model,
            layout,
            source.worker_id,
            block=False,
            source_digest=digest,
            manual_override=body.transport,
        )
        if self.adp is not None:
            self.adp.arrived(layout.seq_len)
        return model_response(self.view_of(record), status=202)

    async def _submit_prompt(
        self, body: SubmitRequest, rid: int, chosen: WorkerInfo | None
    ) -> TransferRecord:
        """Start a healthy prefill worker's (or the ``chosen`` one's) prefill of the prompt,
        then the transfer while it computes."""
        source, started = await self.prefill.start(
            rid,
            PrefillRequest(
                model_id=body.model,
                prompt=body.prompt,
                prompt_seed=body.prompt_seed,
                prompt_tokens=body.prompt_tokens,
                wait=False,
            ),
            chosen,
        )
        try:
            record = await self.orchestrator.submit(
                rid,
                started.model_id,
                started.layout.to_layout(),
                source.worker_id,
                block=False,
                defer_digest=True,
                manual_override=body.transport,
            )
        except BaseException:
            await self.executor.release_source(source, rid)
            raise
        self._generate.pop(rid, None)
        if body.new_tokens:
            self._generate[rid] = body.new_tokens
            while len(self._generate) > self.config.decode_checks_kept:
                self._generate.popitem(last=False)
        return record

    async def get_request(self, request: web.Request) -> web.Response:
        record = self.orchestrator.transfer(int_param(request, "request_id"))
        return model_response(self.view_of(record))

    async def abort_request(self, request: web.Request) -> web.Response:
        record = await self.orchestrator.abort(int_param(request, "request_id"))
        return model_response(self.view_of(record))

    async def list_transfers(self, request: web.Request) -> web.Response:
        state_text = request.query.get("state")
        try:
            state = TransferState(state_text) if state_text else None
        except ValueError:
            states = ", ".join(s.value for s in TransferState)
            return error_response(
                400, "bad_request", f"state {state_text!r} is not one of: {states}"
            )
        limit = count_param(request, "limit", 100, 2**31)
        records = self.orchestrator.query(state, request.query.get("worker"), limit)
        status = self.orchestrator.status()
        listing = TransferList(
            counts=self.orchestrator.transfers.counts(),
            in_flight=self.orchestrator.in_flight,
            queued=int(status["queued"]),  # type: ignore[call-overload]
            transfers=[self.view_of(r) for r in records],
        )
        return model_response(listing)

    async def list_workers(self, request: web.Request) -> web.Response:
        workers = [
            WorkerView(worker=w, slots_used=self.orchestrator.slots_used(w.worker_id))
            for w in self.orchestrator.view.workers()
        ]
        return model_response(
            WorkerList(registry=redact_registry_url(self.config.registry), workers=workers)
        )

    async def _embedded_only(
        self, handler: Callable[[web.Request], Awaitable[web.Response]], request: web.Request
    ) -> web.Response:
        """``handler``'s answer while the registry is embedded; 409 with etcd, where the
        workers register directly."""
        if self.embedded:
            return await handler(request)
        return error_response(
            409,
            "registry",
            f"this orchestrator uses {redact_registry_url(self.config.registry)}; workers "
            "register there directly",
        )

    async def register_worker(self, request: web.Request) -> web.Response:
        return await self._embedded_only(self._registrations.register, request)

    async def heartbeat_worker(self, request: web.Request) -> web.Response:
        return await self._embedded_only(self._registrations.heartbeat, request)

    async def deregister_worker(self, request: web.Request) -> web.Response:
        return await self._embedded_only(self._registrations.deregister, request)

    async def topology(self, request: web.Request) -> web.Response:
        view = self.orchestrator.view
        pairs: list[PairPaths] = []
        for src in view.workers("prefill"):
            for dst in view.workers("decode"):
                try:
                    pair = self.pairs(src, dst)
                except TopKVError as exc:
                    log.warning("no pair view for %s -> %s: %s", src.worker_id, dst.worker_id, exc)
                    continue
                pairs.append(
                    PairPaths(
                        source=src.worker_id,
                        destination=dst.worker_id,
                        same_node=pair.same_node,
                        same_host=bool(src.host_id) and src.host_id == dst.host_id,
                        candidates=[
                            PathView(
                                transport=c.transport,
                                bandwidth_gbps=c.bandwidth_gbps,
                                setup_latency_s=c.setup_latency_s,
                                links=list(c.links),
                            )
                            for c in pair.candidates
                        ],
                    )
                )
        topo = TopologyView(
            source="file" if self.cluster is not None else "registrations",
            topology_file=str(self.config.topology_file) if self.config.topology_file else None,
            cluster=self.cluster.model_dump(mode="json") if self.cluster is not None else None,
            pairs=pairs,
        )
        return model_response(topo)

    async def healthz(self, request: web.Request) -> web.Response:
        return model_response(Health(ok=True))

    async def readyz(self, request: web.Request) -> web.Response:
        running = bool(self.orchestrator.status()["running"])
        try:
            registered = await asyncio.wait_for(asyncio.to_thread(self.registry.workers), 5.0)
            reachable = True
        except (TopKVError, TimeoutError, OSError):
            registered, reachable = [], False
        prefill = sum(1 for w in registered if w.role == "prefill")
        decode = sum(1 for w in registered if w.role == "decode")
        missing = [
            what
            for what, ok in (
                ("orchestrator not running", running),
                ("registry unreachable", reachable),
                ("no prefill worker", prefill > 0),
                ("no decode worker", decode > 0),
            )
            if not ok
        ]
        body = Readiness(
            ready=not missing,
            running=running,
            registry_reachable=reachable,
            prefill_workers=prefill,
            decode_workers=decode,
            detail="; ".join(missing),
        )
        return model_response(body, status=200 if body.ready else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        body = self.orchestrator.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document())


def _special_error(exc: TopKVError) -> tuple[int, str] | None:
    if isinstance(exc, PrefillUnavailable):
        return exc.status, exc.kind
    return (502, exc.kind.value) if isinstance(exc, AttemptFailed) else None


#: TopKV errors become JSON answers with a specific status.
_error_middleware = error_middleware(
    (
        (UnknownRequest, 404, "not_found"),
        ((UnknownWorker, DuplicateRequest), 409, "conflict"),
        (QueueFull, 429, "queue_full"),
        (OrchestratorClosed, 503, "unavailable"),
        (ConfigError, 400, "bad_request"),
        (TopKVError, 500, "internal"),
    ),
    _special_error,
)


async def serve_orchestrator(
    config: OrchestratorServiceConfig,
    host: str,
    port: int,
    stop: asyncio.Event,
    on_ready: asyncio.Future[str] | None = None,
) -> None:
    """Run the orchestrator service on ``host:port`` until ``stop`` is set."""
    from topkv.service.http.util import site_url

    if config.server_auth is None:
        warn_insecure("orchestrator")
    service = OrchestratorService(config)
    await service.start()
    runner = web.AppRunner(service.app(), access_log=None, handle_signals=False)
    try:
        await runner.setup()
        await web.TCPSite(runner, host, port, ssl_context=server_context(config.tls)).start()
        url = served_url(site_url(runner, host), config.tls)
        log.info(
            "orchestrator listening on %s (registry %s)", url, redact_registry_url(config.registry)
        )
        service.leadership.start(url)
        if on_ready is not None and not on_ready.done():
            on_ready.set_result(url)
        await stop.wait()
    finally:
        await runner.cleanup()
        await service.stop()
