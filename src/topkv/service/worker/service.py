"""A worker process: registers, serves transfer endpoints, holds KV buffers, obeys a control API.

One worker is one GPU slot in the prefill or the decode pool. It

* hosts an engine (:mod:`topkv.service.compute.engines`): the synthetic stand-in, or a transformers
  model whose prefill publishes each layer's K/V as the layer finishes and whose decode
  continues from received K/V;
* offers every medium its host has (:mod:`topkv.service.worker.media`: tcp, shm, and nixl,
  mooncake, cuda when installed) and lists them in its registration; the tcp and shm sinks
  listen from the start, an arena medium's sink from its first receive;
* holds KV caches (:mod:`topkv.service.kvstore`): a prefill worker's from its prefill's
  start (a send streams each layer as it is published), a decode worker's as they land;
* registers itself, with a heartbeat, in etcd or through the orchestrator's HTTP API;
* answers a small control API (see ``docs/services.md``) through which the orchestrator's
  :class:`~topkv.service.orchestrator.executor.RemoteExecutor` drives each transfer attempt:
  ``POST /v1/receive`` on the destination, ``POST /v1/send`` on the source,
  ``POST /v1/kv/{id}/wait`` on the destination, ``DELETE /v1/kv/{id}`` on either side;
  ``POST /v1/kv/{id}/prefill`` and ``POST /v1/kv/{id}/decode`` run the engine.

The same class runs in-process (tests) and as ``topkv worker``. Fault injection (``topkv
chaos``; off unless ``$TOPKV_FAULTS`` or :attr:`WorkerConfig.faults` asks): :class:`WorkerFaults`
flips one bit in the frames of a fraction of the outgoing transfers *after* their CRC-64 was
taken (the receiver must catch it), and paces every send to a slow link."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
import time
import zlib
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from aiohttp import web

from topkv.relay.tasks import cancel_and_wait
from topkv.relay.workers import WorkerInfo
from topkv.service.compute.engines import (
    EngineRequestError,
    PrefillPlan,
    WorkerEngine,
    build_engine,
    register_pace_metrics,
)
from topkv.service.errors import ServiceError
from topkv.service.http.auth import Access, Route, secured_app, warn_insecure
from topkv.service.http.fencing import EpochFence
from topkv.service.http.tls import client_tls, served_url, server_context
from topkv.service.http.util import (
    error_response,
    format_host,
    int_param,
    model_response,
    read_model,
    site_url,
    write_ready_file,
)
from topkv.service.kvstore import (
    CapacityExceeded,
    HeldKV,
    KVStore,
    UnknownKV,
    received_kv,
    summarize,
)
from topkv.service.messages import (
    DecodeRequest,
    DecodeResult,
    GenerateRequest,
    GenerateResult,
    PrefillRequest,
    ReceiveReady,
    ReceiveRequest,
    Released,
    SendRequest,
    SendResult,
    WaitRequest,
)
from topkv.service.worker.config import FAULTS_ENV, SECRET_ENV, WorkerConfig, WorkerFaults
from topkv.service.worker.errors import made_medium, worker_error_middleware
from topkv.service.worker.experts import renew
from topkv.service.worker.inbox import Inbox
from topkv.service.worker.media import (
    MediaOffer,
    register_arena_media,
    resolve_media,
    sink_medium,
)
from topkv.service.worker.registrar import Registrar, open_registrar
from topkv.service.worker.role import RoleSwitch
from topkv.service.worker.send import SendStamps, paced_source, send_scheduled, wait_ended
from topkv.service.worker.tiers import WorkerTiers
from topkv.transport import catalog as transports
from topkv.transport.base import (
    OutgoingTransfer,
    TransferDescriptor,
    TransferSink,
    TransferSource,
)
from topkv.transport.errors import TransferTimeout, TransportError, TransportUnavailable
from topkv.transport.faults import CorruptingSource
from topkv.transport.shm import ShmSink
from topkv.transport.tcp import TcpSink

__all__ = ["FAULTS_ENV", "SECRET_ENV", "WorkerConfig", "WorkerFaults", "WorkerService"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Longest a ``GET /v1/kv/{id}`` waits for a prefill still running before answering 504.
SUMMARY_WAIT_S = 60.0


def _wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "::", "")


class WorkerService:
    """A running worker: engine, sinks, KV store, control API and registration."""

    def __init__(self, config: WorkerConfig, registrar: Registrar | None = None) -> None:
        """``registrar``: how the worker registers (default: from ``config``'s orchestrator
        URL or etcd registry; in-process users may hand one over a registry they hold)."""
        if not config.secret:
            raise ServiceError(
                f"a worker needs the cluster's transport secret: set {SECRET_ENV} "
                "(topkv cluster up does this for its workers)"
            )
        if registrar is None and not config.orchestrator_url and not config.registry_url:
            raise ServiceError("give the worker --orchestrator URL or --registry etcd://HOST:PORT")
        self.config = config
        self.worker_id = config.resolved_worker_id()
        self.offer: MediaOffer = resolve_media(config.media, shm=config.capabilities.shm)
        self.store = KVStore(config.capacity)
        self.tiers = WorkerTiers(config.tiers)  # --device-kv-capacity: KV memory tiers
        self.fence = EpochFence()  # refuses a deposed leader's calls (service.fencing)
        self.engine: WorkerEngine | None = None
        self._compute: ThreadPoolExecutor | None = None
        self._sinks: dict[str, TransferSink] = {}
        self._sinks_lock = asyncio.Lock()
        self._sources: dict[str, TransferSource] = {}
        self._sources_lock = threading.Lock()
        self._inbox = Inbox()
        self._outgoing: dict[int, OutgoingTransfer] = {}
        self._prefills: set[asyncio.Future[None]] = set()
        self._runner: web.AppRunner | None = None
        self._registrar: Registrar | None = registrar
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._advertise = config.resolved_advertise_host()
        self._tcp_address = ""
        self.info: WorkerInfo | None = None
        self.counters = {
            "prefilled": 0,
            "sent": 0,
            "received": 0,
            "send_failures": 0,
            "decoded": 0,
            "drained": 0,
        }
        self._corrupters: list[CorruptingSource] = []
        self.roles = RoleSwitch(self, config.role)  # POST /v1/role: the ADP's conversions

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> WorkerInfo:
        cfg = self.config
        advertise = self._advertise
        self.engine = await asyncio.to_thread(build_engine, cfg.engine)
        register_pace_metrics(self.tiers.registry, self.engine)  # --compute-pace: /metrics
        if self.engine.serial:
            self._compute = ThreadPoolExecutor(self.engine.threads, f"engine-{self.worker_id}")
        media = self.offer.media
        register_arena_media(media, advertise if _wildcard(cfg.bind_host) else cfg.bind_host)
        tcp_port = ""
        if "tcp" in media:
            tcp_sink = TcpSink(cfg.secret, host=cfg.bind_host, port=0, on_layer=self._inbox.landed)
            self._sinks["tcp"] = tcp_sink
            tcp_port = tcp_sink.address.rsplit(":", 1)[1]
            self._tcp_address = f"tcp://{format_host(advertise)}:{tcp_port}"
        if "shm" in media:
            self._sinks["shm"] = ShmSink(cfg.secret, on_layer=self._inbox.landed)
        self._runner = web.AppRunner(
            self.app(), access_log=None, handle_signals=False, shutdown_timeout=5.0
        )
        await self._runner.setup()
        tls = server_context(cfg.tls)
        await web.TCPSite(self._runner, cfg.bind_host, cfg.control_port, ssl_context=tls).start()
        control_url = served_url(site_url(self._runner, advertise), cfg.tls)
        capabilities = cfg.capabilities.model_copy(
            update={"tcp": "tcp" in media, "shm": "shm" in media, "media": media}
        )
        self.info = WorkerInfo(
            worker_id=self.worker_id,
            role=cfg.role,
            node=cfg.node,
            host_id=cfg.resolved_host_id(),
            gpus=cfg.gpus,
            nvlink_domain=cfg.nvlink_domain,
            capabilities=capabilities,
            capacity=cfg.capacity,
            address=f"{format_host(advertise)}:{tcp_port}" if tcp_port else "",
            control_url=control_url,
        )
        if self._registrar is None:
            auth = cfg.server_auth
            token = auth.client_token if auth is not None else None
            verify = client_tls(cfg.tls)
            self._registrar = open_registrar(cfg.orchestrator_url, cfg.registry_url, token, verify)
        await self._registrar.register(self.info, cfg.ttl_s)
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop())
        if cfg.ready_file is not None:
            write_ready_file(
                cfg.ready_file,
                {
                    "worker_id": self.worker_id,
                    "role": cfg.role,
                    "pid": os.getpid(),
                    "control_url": control_url,
                    "tcp": self._tcp_address,
                    "shm": self._sinks["shm"].address if "shm" in self._sinks else "",
                    "host_id": self.info.host_id,
                    "media": list(media),
                    "engine": self.engine.describe(),
                },
            )
        log.info("worker %s up: control %s, media %s", self.worker_id, control_url, media)
        return self.info

    async def stop(self) -> None:
        await cancel_and_wait(self._heartbeat_task)
        if self._registrar is not None:
            with contextlib.suppress(ServiceError):
                await self._registrar.deregister()
            await self._registrar.close()
        if self._runner is not None:
            await self._runner.cleanup()
        for out in list(self._outgoing.values()):
            out.cancel()
        self._inbox.drop_all()
        for sink in self._sinks.values():
            sink.close()
        with self._sources_lock:
            sources = list(self._sources.values())
        for source in sources:
            source.close()
        self.store.clear()  # fails running prefills: their next layer stops them
        self.tiers.close()
        if self._prefills:
            await asyncio.wait(set(self._prefills), timeout=30.0)
        if self._compute is not None:
            self._compute.shutdown(wait=False, cancel_futures=True)
        if self.engine is not None:
            self.engine.close()

    async def kill(self) -> None:
        """Die the way a crashed worker dies (for fault tests and chaos): no deregistration,
        no drain. Heartbeats stop, the control API and every sink close under the transfers in
        flight, and every held copy is lost. The registry forgets the worker when its TTL
        runs out, as it would a dead process."""
        await cancel_and_wait(self._heartbeat_task)
        self._heartbeat_task = None
        if self._registrar is not None:
            await self._registrar.close()
            self._registrar = None
        # A crash cuts the data plane first: transfers in flight fail now, not after the
        # control API finished answering its open requests.
        for out in list(self._outgoing.values()):
            out.cancel()
        self._inbox.drop_all()
        for sink in self._sinks.values():
            sink.close()
        if self._runner is not None:
            await self._runner.shutdown()  # stop accepting and close idle connections
        await self.stop()

    async def _heartbeat_loop(self) -> None:
        assert self._registrar is not None and self.info is not None
        interval = max(self.config.ttl_s / 3.0, 0.05)
        while True:
            await asyncio.sleep(interval)
            try:
                self.info = await renew(self._registrar, self.info, self.engine, self.config.ttl_s)
            except ServiceError as exc:
                log.warning("heartbeat failed (%s); registering again", exc)
                with contextlib.suppress(ServiceError):
                    await self._registrar.register(self.info, self.config.ttl_s)

    def transfers_in_flight(self) -> tuple[int, int]:
        """Sends in flight, and receives announced, not yet taken and kept (not drained)."""
        return len(self._outgoing), sum(1 for p in self._inbox.pending.values() if p.keep)

    async def reregister(self, info: WorkerInfo) -> None:
        """Replace this worker's registration with ``info`` (same id: a new role)."""
        if self._registrar is None:
            raise ServiceError(f"worker {self.worker_id} is not registered")
        await self._registrar.update(info, self.config.ttl_s)
        self.info = info

    def _run_engine(self, fn: Callable[[], T]) -> Awaitable[T]:
        """Run engine work off the loop: a model's on its own thread, one at a time."""
        if self._compute is not None:
            return asyncio.get_running_loop().run_in_executor(self._compute, fn)
        return asyncio.to_thread(fn)

    # -- control API -------------------------------------------------------------------------

    def app(self) -> web.Application:
        admin = Access.ADMIN  # the orchestrator's executor (an admin token) drives workers
        routes = [
            Route("GET", "/healthz", self._healthz, Access.PUBLIC),
            Route("GET", "/metrics", self.tiers.metrics, Access.METRICS),
            Route("GET", "/v1/info", self._info, admin),
            Route("GET", "/v1/kv", self._list_kv, admin),
            Route("GET", "/v1/kv/{request_id}", self._get_kv, admin),
            Route("DELETE", "/v1/kv/{request_id}", self._delete_kv, admin),
            Route("POST", "/v1/kv/{request_id}/prefill", self._prefill, admin),
            Route("POST", "/v1/kv/{request_id}/decode", self._decode, admin),
            Route("POST", "/v1/kv/{request_id}/wait", self._wait, admin),
            Route("POST", "/v1/kv/{request_id}/cancel", self._cancel_send, admin),
            Route("POST", "/v1/receive", self._receive, admin),
            Route("POST", "/v1/send", self._send, admin),
            Route("POST", "/v1/generate", self._generate, admin),
            Route("GET", "/v1/role", self.roles.current, admin),
            Route("POST", "/v1/role", self.roles.handle, admin),
        ]
        middlewares = [self.fence.middleware, worker_error_middleware]
        return secured_app(routes, self.config.server_auth, middlewares=middlewares)

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "worker_id": self.worker_id})

    async def _info(self, request: web.Request) -> web.Response:
        assert self.info is not None and self.engine is not None
        body: dict[str, object] = {
            "worker": self.info.model_dump(mode="json"),
            "held": len(self.store),
            "receiving": len(self._inbox),
            "sending": len(self._outgoing),
            "counters": dict(self.counters),
            "kv_tiers": self.tiers.describe(),
            "sinks": {kind: sink.address for kind, sink in self._sinks.items()},
            "media": list(self.offer.media),
            "media_unavailable": dict(self.offer.unavailable),
            "engine": self.engine.describe(),
        }
        faults = self.config.faults
        if faults.active:
            body["faults"] = {
                "corrupt_rate": faults.corrupt_rate,
                "seed": faults.seed,
                "slow_gbps": faults.slow_gbps,
                "corruptions_injected": sum(c.injected for c in self._corrupters),
            }
        return web.json_response(body)

    async def _list_kv(self, request: web.Request) -> web.Response:
        return web.json_response([summarize(kv).model_dump() for kv in self.store.all()])

    async def _get_kv(self, request: web.Request) -> web.Response:
        """The summary of a held KV; one still being produced is answered once it is whole."""
        kv = self.store.get(int_param(request, "request_id"))
        await wait_ended(kv, SUMMARY_WAIT_S)
        kv.check_whole()
        return model_response(summarize(kv))

    async def _prefill(self, request: web.Request) -> web.Response:
        request_id = int_param(request, "request_id")
        body = await read_model(request, PrefillRequest)
        assert self.engine is not None
        plan = self.roles.chunk(self.engine.plan(request_id, body))  # converted: chunked
        self.store.reserve_check(request_id)
        kv = HeldKV.producing(request_id, plan.model_id, plan.layout)
        self.store.put(kv)
        task = asyncio.ensure_future(self._run_prefill(kv, plan))
        self._prefills.add(task)
        task.add_done_callback(self._prefills.discard)
        if not body.wait:
            return model_response(summarize(kv), status=202)
        await wait_ended(kv, None)
        kv.check_whole()
        return model_response(summarize(kv), status=201)

    async def _run_prefill(self, kv: HeldKV, plan: PrefillPlan) -> None:
        engine = self.engine
        assert engine is not None

        def run() -> int | None:
            kv.forward_start_s = time.perf_counter()  # on the engine's thread: it took it
            try:
                return engine.prefill(plan, kv.publish)
            finally:  # its first pass began when it got the model (EngineTurns)
                kv.forward_start_s, kv.forward_end_s = engine.call_span(kv.forward_start_s)

        try:
            first_token = await self._run_engine(run)
        except Exception as exc:  # reported to every waiter through the KV
            if kv.error is None:
                log.warning("prefill of request %s failed: %s", kv.request_id, exc)
            kv.fail(f"prefill failed: {type(exc).__name__}: {exc}")
            return
        kv.finish(first_token)
        if kv.complete:
            self.counters["prefilled"] += 1

    async def _decode(self, request: web.Request) -> web.Response:
        request_id = int_param(request, "request_id")
        body = await read_model(request, DecodeRequest)
        engine = self.engine
        assert engine is not None
        kv = self.store.get(request_id)
        await wait_ended(kv, SUMMARY_WAIT_S)
        kv.check_whole()
        first_token = body.first_token if body.first_token is not None else kv.first_token
        if first_token is None:
            raise EngineRequestError(
                f"request {request_id}: give 'first_token' (prefill's token); this worker "
                "did not run the prefill"
            )
        stamps: list[float] = []
        ticket = self.tiers.begin_decode(kv, body.max_new_tokens)

        def run() -> list[int]:
            if ticket is not None:
                ticket.wait()  # its KV back on the device: the exposed promotion
            stamps.append(time.perf_counter())
            try:
                return engine.decode(kv, first_token, body.max_new_tokens)
            finally:  # it began when it got the model (EngineTurns), to now
                stamps[:] = engine.call_span(stamps[0])

        try:
            tokens = await self._run_engine(run)
        finally:
            self.tiers.end_decode(ticket, stamps, body.max_new_tokens)
        self.counters["decoded"] += 1
        return model_response(
            self.tiers.annotate(
                DecodeResult(
                    request_id=request_id,
                    model_id=kv.model_id,
                    prompt_len=kv.layout.seq_len,
                    tokens=tokens,
                    seconds=stamps[1] - stamps[0],
                    started_s=stamps[0],
                    ended_s=stamps[1],
                ),
                ticket,
            )
        )

    async def _generate(self, request: web.Request) -> web.Response:
        body = await read_model(request, GenerateRequest)
        engine = self.engine
        assert engine is not None
        plan = engine.plan(-1, body.prefill_request())
        started = time.perf_counter()
        tokens = await self._run_engine(lambda: engine.generate(plan, body.max_new_tokens))
        return model_response(
            GenerateResult(
                model_id=plan.model_id,
                prompt_len=plan.layout.seq_len,
                tokens=tokens,
                seconds=time.perf_counter() - started,
            )
        )

    async def _delete_kv(self, request: web.Request) -> web.Response:
        request_id = int_param(request, "request_id")
        released = False
        out = self._outgoing.pop(request_id, None)
        if out is not None:
            out.cancel()
            released = True
        if self._inbox.drop(request_id):
            released = True
        held = self.store.pop(request_id)
        if held is not None:
            await asyncio.to_thread(held.free)
            released = True
        await self.tiers.released(request_id)
        return model_response(Released(request_id=request_id, released=released))

    async def _sink(self, kind: str) -> TransferSink | None:
        """This worker's sink of ``kind``; an arena medium's is made on first use."""
        sink = self._sinks.get(kind)
        if sink is not None or kind not in self.offer.media:
            return sink
        async with self._sinks_lock:
            sink = self._sinks.get(kind)
            if sink is None:
                make = transports.get(kind).make_sink
                sink = await asyncio.to_thread(made_medium, make, self.config.secret, kind, "sink")
                self._sinks[kind] = sink
        return sink

    def _sink_address(self, kind: str, sink: TransferSink) -> str:
        """Where peers reach ``sink``: a wildcard listening address becomes the advertised."""
        if kind == "tcp":
            return self._tcp_address
        address = sink.address
        scheme, sep, rest = address.partition("://")
        if sep and not rest.startswith("/") and _wildcard(self.config.bind_host):
            port = rest.rsplit(":", 1)[1]
            return f"{scheme}://{format_host(self._advertise)}:{port}"
        return address

    async def _receive(self, request: web.Request) -> web.Response:
        body = await read_model(request, ReceiveRequest)
        try:
            kind = sink_medium(body.medium)
        except TransportError as exc:
            return error_response(400, "transport", str(exc), type(exc).__name__)
        sink = await self._sink(kind)
        if sink is None:
            return error_response(
                400,
                "transport",
                f"worker {self.worker_id} has no {kind} sink (it offers "
                f"{', '.join(self.offer.media)})",
                "TransportError",
            )
        if body.keep:
            self.store.reserve_check(body.request_id)
        descriptor = TransferDescriptor(body.request_id, body.model_id, body.layout.to_layout())
        self._inbox.expect(sink, kind, descriptor, body.medium, keep=body.keep)
        address = self._sink_address(kind, sink)
        ready = ReceiveReady(request_id=body.request_id, medium=body.medium, address=address)
        return model_response(ready)

    async def _wait(self, request: web.Request) -> web.Response:
        request_id = int_param(request, "request_id")
        body = await read_model(request, WaitRequest)
        pending = self._inbox.pending.get(request_id)
        if pending is None:
            held = self.store.get(request_id)  # raises UnknownKV
            if held.origin == "received":
                return model_response(summarize(held))
            raise UnknownKV(f"worker {self.worker_id} expects no KV for request {request_id}")
        wrapped = asyncio.wrap_future(pending.future)
        done, _ = await asyncio.wait({wrapped}, timeout=body.timeout_s)
        if not done:
            raise TransferTimeout(
                f"request {request_id}: nothing verified arrived within {body.timeout_s} s"
            )
        received = wrapped.result()  # raises the transport's error, if any
        if not self._inbox.take(pending):
            raise UnknownKV(f"the receive of request {request_id} was discarded")
        if not pending.keep:
            received.release()
            self.counters["drained"] += 1
            return model_response(pending.summary())
        kv = await asyncio.to_thread(
            received_kv,
            request_id,
            pending.model_id,
            pending.descriptor.layout,
            received.layers,
            pending.medium,
            received.release,
        )
        kv.arrivals_s, kv.verified_s = pending.arrivals(), pending.verified_s
        try:
            self.store.put(kv)
        except CapacityExceeded:
            kv.free()
            raise
        await self.tiers.admitted(kv, self.store)  # beyond K on the device: demote one
        self.counters["received"] += 1
        return model_response(summarize(kv))

    async def _send(self, request: web.Request) -> web.Response:
        body = await read_model(request, SendRequest)
        kv = self.store.get(body.request_id)
        if kv.error is not None:
            kv.check_whole()  # raises PrefillFailed: the source lost this KV
        transfer_id = body.request_id if body.transfer_id is None else body.transfer_id
        descriptor = TransferDescriptor(transfer_id, kv.model_id, kv.layout)
        stamps = SendStamps()
        try:
            source = self._source(body.medium)
            if (link := body.link) is not None:
                source = paced_source(
                    source, link.mode, link.bandwidth_gbps, link.setup_s, dilation=link.dilation
                )
            started = time.perf_counter()
            out = await asyncio.to_thread(source.open, descriptor, body.destination)
        except TransportError as exc:  # a plain one: no medium or address of ours (400)
            if type(exc) is not TransportError:
                raise  # the transport's own failure (a peer gone, a library down): 502
            return error_response(400, "transport", str(exc), "TransportError")
        self._outgoing[transfer_id] = out
        try:
            await send_scheduled(
                out,
                kv,
                body.schedule,
                body.timeout_s,
                stamps,
                off_loop=self.config.faults.slow_gbps is not None,
            )
            wrapped = asyncio.wrap_future(out.finish())
            done, _ = await asyncio.wait({wrapped}, timeout=body.timeout_s)
            if not done:
                out.cancel()
                raise TransferTimeout(
                    f"request {body.request_id}: no acknowledgement within {body.timeout_s} s"
                )
            result = wrapped.result()
        except BaseException:
            self.counters["send_failures"] += 1
            out.cancel()
            raise
        finally:
            if self._outgoing.get(transfer_id) is out:
                del self._outgoing[transfer_id]
        ended = time.perf_counter()
        self.counters["sent"] += 1
        offered = stamps.offered(kv.layout.num_layers)
        return model_response(
            SendResult(
                request_id=body.request_id,
                medium=body.medium,
                mode=result.mode.value,
                size_bytes=result.size_bytes,
                seconds=result.seconds,
                wall_seconds=result.wall_seconds
                if result.wall_seconds is not None
                else ended - started,
                emulated=result.emulated,
                dilation=result.dilation,
                transfer_id=transfer_id,
                started_s=started,
                ended_s=ended,
                offered_s=offered,
                handed_s=SendStamps.handed(out, offered),
            )
        )

    async def _cancel_send(self, request: web.Request) -> web.Response:
        request_id = int_param(request, "request_id")
        out = self._outgoing.pop(request_id, None)
        if out is not None:
            out.cancel()
        return model_response(Released(request_id=request_id, released=out is not None))

    def _source(self, medium: str) -> TransferSource:
        try:
            carrier = sink_medium(medium)
        except TransportUnavailable as exc:  # no such medium: the request's fault
            raise TransportError(str(exc)) from None
        if carrier not in self.offer.media:
            raise TransportError(
                f"worker {self.worker_id} does not offer {carrier} (it offers "
                f"{', '.join(self.offer.media)})"
            )
        with self._sources_lock:
            source = self._sources.get(medium)
            if source is None:
                make = transports.get(medium).make_source
                source = made_medium(make, self.config.secret, medium, "source")
                source = self._with_faults(medium, source)
                self._sources[medium] = source
            return source

    def _with_faults(self, medium: str, source: TransferSource) -> TransferSource:
        faults = self.config.faults
        if faults.slow_gbps is not None:  # a slowed link: 50 us setup per chunk
            source = paced_source(source, source.mode, faults.slow_gbps, 50e-6)
        if faults.corrupt_rate > 0:
            seed = faults.seed * 1_000_003 + zlib.crc32(medium.encode())
            corrupter = CorruptingSource(source, faults.corrupt_rate, seed)
            self._corrupters.append(corrupter)
            source = corrupter
        return source


async def serve_worker(config: WorkerConfig, stop: asyncio.Event) -> None:
    """Run a worker until ``stop`` is set, then deregister and release everything."""
    # Transport threads (senders, receivers, link pacers) must get the GIL at once while the
    # engine's thread computes, or their stamps and departures carry GIL waits (5 ms default).
    sys.setswitchinterval(0.0005)
    if config.server_auth is None:
        warn_insecure(f"worker {config.resolved_worker_id()}")
    service = WorkerService(config)
    try:
        await service.start()
        await stop.wait()
    finally:
        await service.stop()
