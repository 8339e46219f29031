"""A worker process: registers, serves transfer endpoints, holds KV buffers, obeys a control API.

One worker is one (simulated) GPU slot in the prefill or the decode pool. It

* listens on a TCP sink and a shared-memory sink (the transfer endpoints);
* holds KV caches: a prefill worker produces them on request (:func:`synthetic_kv`, a
  deterministic stand-in for a model's prefill output); a decode worker receives them;
* registers itself, with a heartbeat, in an etcd registry directly or through the
  orchestrator's HTTP API (when the orchestrator keeps an embedded registry);
* answers a small control API (see ``docs/services.md``) through which the orchestrator's
  :class:`~topkv.service.remote_executor.RemoteExecutor` drives each transfer attempt:
  ``POST /v1/receive`` on the destination, ``POST /v1/send`` on the source,
  ``POST /v1/kv/{id}/wait`` on the destination, ``DELETE /v1/kv/{id}`` on either side.

Fault injection (for ``topkv chaos``; off unless ``$TOPKV_FAULTS`` or
:attr:`WorkerConfig.faults` asks): :class:`WorkerFaults` can flip one bit in the frames of a
fraction of this worker's outgoing transfers *after* their CRC-64 was taken (the receiver
must catch it), and pace every send to a slow link.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler

from topkv.errors import ConfigError
from topkv.relay.executor import classify_failure
from topkv.relay.workers import Role, WorkerCapabilities, WorkerInfo
from topkv.service.errors import ServiceError
from topkv.service.httputil import (
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
    synthetic_kv,
)
from topkv.service.messages import (
    KVSummary,
    LayoutModel,
    PrefillRequest,
    ReceiveReady,
    ReceiveRequest,
    Released,
    SendRequest,
    SendResult,
    WaitRequest,
)
from topkv.service.registrar import Registrar, open_registrar
from topkv.transport import registry as transports
from topkv.transport.base import (
    OutgoingTransfer,
    ReceivedKV,
    TransferDescriptor,
    TransferSink,
    TransferSource,
    TransportMode,
)
from topkv.transport.emulated import EmulatedSource, LinkModel
from topkv.transport.errors import TransferTimeout, TransportError
from topkv.transport.faults import CorruptingSource
from topkv.transport.shm import ShmSink
from topkv.transport.tcp import TcpSink

log = logging.getLogger(__name__)

SECRET_ENV = "TOPKV_SECRET"
FAULTS_ENV = "TOPKV_FAULTS"


@dataclass(frozen=True)
class WorkerFaults:
    """Faults a worker injects into its own sends (``topkv chaos``); all off by default.

    ``corrupt_rate``: fraction of outgoing transfers that get one bit flipped in one frame
    after the frame's CRC-64 was computed, so the frame leaves with its original CRC.
    ``seed``: seeds which transfers, frames and bits. ``slow_gbps``: pace every send of this
    worker to a link of that many GB/s (a slowed link). Written as
    ``corrupt_rate=0.05,seed=3,slow_gbps=1.0`` in ``$TOPKV_FAULTS``.
    """

    corrupt_rate: float = 0.0
    seed: int = 0
    slow_gbps: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.corrupt_rate <= 1.0:
            raise ConfigError(f"fault corrupt_rate must be in [0, 1], got {self.corrupt_rate}")
        if self.slow_gbps is not None and not self.slow_gbps > 0:
            raise ConfigError(f"fault slow_gbps must be > 0, got {self.slow_gbps}")

    @property
    def active(self) -> bool:
        return self.corrupt_rate > 0 or self.slow_gbps is not None

    def to_text(self) -> str:
        parts = [f"corrupt_rate={self.corrupt_rate!r}", f"seed={self.seed}"]
        if self.slow_gbps is not None:
            parts.append(f"slow_gbps={self.slow_gbps!r}")
        return ",".join(parts)

    @classmethod
    def parse(cls, text: str) -> WorkerFaults:
        """Read ``key=value,...`` (keys: corrupt_rate, seed, slow_gbps); empty means none."""
        values: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key not in ("corrupt_rate", "seed", "slow_gbps"):
                raise ConfigError(
                    f"{FAULTS_ENV}: {item!r} is not one of corrupt_rate=P, seed=N, slow_gbps=X"
                )
            values[key] = value.strip()
        try:
            return cls(
                corrupt_rate=float(values.get("corrupt_rate", "0")),
                seed=int(values.get("seed", "0")),
                slow_gbps=float(values["slow_gbps"]) if "slow_gbps" in values else None,
            )
        except ValueError as exc:
            raise ConfigError(f"{FAULTS_ENV}={text!r}: {exc}") from None

    @classmethod
    def from_env(cls) -> WorkerFaults:
        return cls.parse(os.environ.get(FAULTS_ENV, ""))


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker process needs to start."""

    role: Role
    node: str
    secret: bytes
    gpus: tuple[int, ...] = (0,)
    worker_id: str = ""
    host_id: str = ""
    orchestrator_url: str = ""
    registry_url: str = ""
    bind_host: str = "127.0.0.1"
    advertise_host: str = ""
    control_port: int = 0
    capacity: int = 8
    ttl_s: float = 10.0
    nvlink_domain: str | None = None
    capabilities: WorkerCapabilities = field(default_factory=WorkerCapabilities)
    ready_file: Path | None = None
    faults: WorkerFaults = field(default_factory=WorkerFaults.from_env)

    def resolved_worker_id(self) -> str:
        gpus = "-".join(str(g) for g in self.gpus) or "cpu"
        return self.worker_id or f"{self.role}-{self.node}-gpu{gpus}"

    def resolved_host_id(self) -> str:
        return self.host_id or socket.gethostname()

    def resolved_advertise_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        if self.bind_host in ("0.0.0.0", "::", ""):
            return socket.gethostname()
        return self.bind_host


@dataclass
class _Pending:
    """A receive the orchestrator announced; its future resolves when the bytes arrived."""

    request_id: int
    model_id: str
    descriptor: TransferDescriptor
    medium: str
    sink_kind: str
    future: Future[ReceivedKV]
    abandoned: bool = False
    claimed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


def _release_if_abandoned(pending: _Pending, future: Future[ReceivedKV]) -> None:
    with pending.lock:
        if not pending.abandoned or pending.claimed:
            return
    if future.cancelled() or future.exception() is not None:
        return
    future.result().release()


def _sink_kind(medium: str) -> str:
    """``shm`` or ``tcp``: which of this worker's sinks a medium's bytes arrive at."""
    info = transports.get(medium)
    return "shm" if info.make_sink is ShmSink else "tcp"


class WorkerService:
    """A running worker: sinks, KV store, control API and registration."""

    def __init__(self, config: WorkerConfig) -> None:
        if not config.secret:
            raise ServiceError(
                f"a worker needs the cluster's transport secret: set {SECRET_ENV} "
                "(topkv cluster up does this for its workers)"
            )
        if not config.orchestrator_url and not config.registry_url:
            raise ServiceError("give the worker --orchestrator URL or --registry etcd://HOST:PORT")
        self.config = config
        self.worker_id = config.resolved_worker_id()
        self.store = KVStore(config.capacity)
        self._sinks: dict[str, TransferSink] = {}
        self._sources: dict[str, TransferSource] = {}
        self._sources_lock = threading.Lock()
        self._inbox: dict[int, _Pending] = {}
        self._abandoned: dict[tuple[str, int], _Pending] = {}
        self._outgoing: dict[int, OutgoingTransfer] = {}
        self._runner: web.AppRunner | None = None
        self._registrar: Registrar | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self.info: WorkerInfo | None = None
        self.counters = {"prefilled": 0, "sent": 0, "received": 0, "send_failures": 0}
        self._corrupters: list[CorruptingSource] = []

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> WorkerInfo:
        cfg = self.config
        advertise = cfg.resolved_advertise_host()
        tcp_sink = TcpSink(cfg.secret, host=cfg.bind_host, port=0)
        self._sinks["tcp"] = tcp_sink
        if cfg.capabilities.shm:
            self._sinks["shm"] = ShmSink(cfg.secret)
        tcp_port = tcp_sink.address.rsplit(":", 1)[1]
        self._tcp_address = f"tcp://{format_host(advertise)}:{tcp_port}"
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, cfg.bind_host, cfg.control_port).start()
        control_url = site_url(self._runner, advertise)
        self.info = WorkerInfo(
            worker_id=self.worker_id,
            role=cfg.role,
            node=cfg.node,
            host_id=cfg.resolved_host_id(),
            gpus=cfg.gpus,
            nvlink_domain=cfg.nvlink_domain,
            capabilities=cfg.capabilities,
            capacity=cfg.capacity,
            address=f"{format_host(advertise)}:{tcp_port}",
            control_url=control_url,
        )
        self._registrar = open_registrar(cfg.orchestrator_url, cfg.registry_url)
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
                },
            )
        log.info("worker %s up: control %s, tcp %s", self.worker_id, control_url, tcp_sink.address)
        return self.info

    async def stop(self) -> None:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat_task
        if self._registrar is not None:
            with contextlib.suppress(ServiceError):
                await self._registrar.deregister()
            await self._registrar.close()
        if self._runner is not None:
            await self._runner.cleanup()
        for out in list(self._outgoing.values()):
            out.cancel()
        for pending in list(self._inbox.values()):
            self._abandon(pending)
        for sink in self._sinks.values():
            sink.close()
        with self._sources_lock:
            sources = list(self._sources.values())
        for source in sources:
            source.close()
        self.store.clear()

    async def _heartbeat_loop(self) -> None:
        assert self._registrar is not None and self.info is not None
        interval = max(self.config.ttl_s / 3.0, 0.05)
        while True:
            await asyncio.sleep(interval)
            try:
                await self._registrar.heartbeat()
            except ServiceError as exc:
                log.warning("heartbeat failed (%s); registering again", exc)
                with contextlib.suppress(ServiceError):
                    await self._registrar.register(self.info, self.config.ttl_s)

    # -- control API -------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_error_middleware])
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/v1/info", self._info)
        app.router.add_get("/v1/kv", self._list_kv)
        app.router.add_get("/v1/kv/{request_id}", self._get_kv)
        app.router.add_delete("/v1/kv/{request_id}", self._delete_kv)
        app.router.add_post("/v1/kv/{request_id}/prefill", self._prefill)
        app.router.add_post("/v1/kv/{request_id}/wait", self._wait)
        app.router.add_post("/v1/kv/{request_id}/cancel", self._cancel_send)
        app.router.add_post("/v1/receive", self._receive)
        app.router.add_post("/v1/send", self._send)
        return app

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "worker_id": self.worker_id})

    async def _info(self, request: web.Request) -> web.Response:
        assert self.info is not None
        body: dict[str, object] = {
            "worker": self.info.model_dump(mode="json"),
            "held": len(self.store),
            "receiving": len(self._inbox),
            "sending": len(self._outgoing),
            "counters": dict(self.counters),
            "sinks": {kind: sink.address for kind, sink in self._sinks.items()},
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
        return web.json_response([_summary(kv).model_dump() for kv in self.store.all()])

    async def _get_kv(self, request: web.Request) -> web.Response:
        kv = self.store.get(int_param(request, "request_id"))
        return model_response(_summary(kv))

    async def _prefill(self, request: web.Request) -> web.Response:
        request_id = int_param(request, "request_id")
        body = await read_model(request, PrefillRequest)
        self.store.reserve_check(request_id)
        layout = body.layout.to_layout()
        kv = await asyncio.to_thread(synthetic_kv, request_id, body.model_id, layout)
        self.store.put(kv)
        self.counters["prefilled"] += 1
        return model_response(_summary(kv), status=201)

    async def _delete_kv(self, request: web.Request) -> web.Response:
        request_id = int_param(request, "request_id")
        released = False
        out = self._outgoing.pop(request_id, None)
        if out is not None:
            out.cancel()
            released = True
        pending = self._inbox.pop(request_id, None)
        if pending is not None:
            self._abandon(pending)
            released = True
        held = self.store.pop(request_id)
        if held is not None:
            await asyncio.to_thread(held.free)
            released = True
        return model_response(Released(request_id=request_id, released=released))

    def _abandon(self, pending: _Pending) -> None:
        with pending.lock:
            pending.abandoned = True
        if not pending.future.done():
            self._abandoned[(pending.sink_kind, pending.request_id)] = pending
        pending.future.add_done_callback(lambda f: self._abandoned_done(pending, f))

    def _abandoned_done(self, pending: _Pending, future: Future[ReceivedKV]) -> None:
        key = (pending.sink_kind, pending.request_id)
        if self._abandoned.get(key) is pending:
            with contextlib.suppress(KeyError):
                del self._abandoned[key]
        _release_if_abandoned(pending, future)

    async def _receive(self, request: web.Request) -> web.Response:
        body = await read_model(request, ReceiveRequest)
        try:
            kind = _sink_kind(body.medium)
        except TransportError as exc:
            return error_response(400, "transport", str(exc), type(exc).__name__)
        sink = self._sinks.get(kind)
        if sink is None:
            return error_response(
                400, "transport", f"worker {self.worker_id} has no {kind} sink", "TransportError"
            )
        self.store.reserve_check(body.request_id)
        previous = self._inbox.pop(body.request_id, None)
        if previous is not None:
            self._abandon(previous)
        future = self._claim(sink, kind, body.request_id)
        descriptor = TransferDescriptor(body.request_id, body.model_id, body.layout.to_layout())
        pending = _Pending(body.request_id, body.model_id, descriptor, body.medium, kind, future)
        self._inbox[body.request_id] = pending
        address = self._tcp_address if kind == "tcp" else sink.address
        ready = ReceiveReady(request_id=body.request_id, medium=body.medium, address=address)
        return model_response(ready)

    def _claim(self, sink: TransferSink, kind: str, request_id: int) -> Future[ReceivedKV]:
        """A fresh receive future for ``request_id``, reclaiming an abandoned pending one."""
        for _ in range(3):
            future = sink.receive(request_id)
            old = self._abandoned.pop((kind, request_id), None)
            if old is not None and old.future is future:
                with old.lock:
                    old.abandoned = False
            if not future.done():
                return future
            if not future.cancelled() and future.exception() is None:
                kv = future.result()
                if kv.layers:
                    return future
            # A failed or already-released leftover of an earlier attempt: ask again.
        return sink.receive(request_id)

    async def _wait(self, request: web.Request) -> web.Response:
        request_id = int_param(request, "request_id")
        body = await read_model(request, WaitRequest)
        pending = self._inbox.get(request_id)
        if pending is None:
            held = self.store.get(request_id)  # raises UnknownKV
            if held.origin == "received":
                return model_response(_summary(held))
            raise UnknownKV(f"worker {self.worker_id} expects no KV for request {request_id}")
        wrapped = asyncio.wrap_future(pending.future)
        done, _ = await asyncio.wait({wrapped}, timeout=body.timeout_s)
        if not done:
            raise TransferTimeout(
                f"request {request_id}: nothing verified arrived within {body.timeout_s} s"
            )
        received = wrapped.result()  # raises the transport's error, if any
        with pending.lock:
            if pending.abandoned:
                raise UnknownKV(f"the receive of request {request_id} was discarded")
            pending.claimed = True
        if self._inbox.get(request_id) is pending:
            del self._inbox[request_id]
        kv = await asyncio.to_thread(
            received_kv,
            request_id,
            pending.model_id,
            pending.descriptor.layout,
            received.layers,
            pending.medium,
            received.release,
        )
        try:
            self.store.put(kv)
        except CapacityExceeded:
            kv.free()
            raise
        self.counters["received"] += 1
        return model_response(_summary(kv))

    async def _send(self, request: web.Request) -> web.Response:
        body = await read_model(request, SendRequest)
        kv = self.store.get(body.request_id)
        source = self._source(body.medium)
        descriptor = TransferDescriptor(kv.request_id, kv.model_id, kv.layout)
        started = time.perf_counter()
        out = await asyncio.to_thread(source.open, descriptor, body.destination)
        self._outgoing[body.request_id] = out
        try:
            if self.config.faults.slow_gbps is not None:
                # A paced send blocks until each layer's departure time: not on the loop.
                await asyncio.to_thread(_send_layers, out, kv)
            else:
                _send_layers(out, kv)
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
            raise
        finally:
            if self._outgoing.get(body.request_id) is out:
                del self._outgoing[body.request_id]
        self.counters["sent"] += 1
        wall = time.perf_counter() - started
        return model_response(
            SendResult(
                request_id=body.request_id,
                medium=body.medium,
                mode=result.mode.value,
                size_bytes=result.size_bytes,
                seconds=result.seconds,
                wall_seconds=result.wall_seconds if result.wall_seconds is not None else wall,
                emulated=result.emulated,
                dilation=result.dilation,
            )
        )

    async def _cancel_send(self, request: web.Request) -> web.Response:
        request_id = int_param(request, "request_id")
        out = self._outgoing.pop(request_id, None)
        if out is not None:
            out.cancel()
        return model_response(Released(request_id=request_id, released=out is not None))

    def _source(self, medium: str) -> TransferSource:
        with self._sources_lock:
            source = self._sources.get(medium)
            if source is None:
                source = transports.get(medium).make_source(self.config.secret)
                source = self._with_faults(medium, source)
                self._sources[medium] = source
            return source

    def _with_faults(self, medium: str, source: TransferSource) -> TransferSource:
        faults = self.config.faults
        if faults.slow_gbps is not None:
            link = LinkModel(TransportMode(source.mode), faults.slow_gbps, 50e-6)
            source = EmulatedSource(source, link)
        if faults.corrupt_rate > 0:
            seed = faults.seed * 1_000_003 + zlib.crc32(medium.encode())
            corrupter = CorruptingSource(source, faults.corrupt_rate, seed)
            self._corrupters.append(corrupter)
            source = corrupter
        return source


def _send_layers(out: OutgoingTransfer, kv: HeldKV) -> None:
    for layer, (tensors, crcs) in enumerate(zip(kv.layers, kv.crcs, strict=True)):
        out.send_layer(layer, tensors, crcs)


def _summary(kv: HeldKV) -> KVSummary:
    return KVSummary(
        request_id=kv.request_id,
        model_id=kv.model_id,
        layout=LayoutModel.of(kv.layout),
        size_bytes=kv.layout.total_bytes,
        digest=kv.digest,
        origin="prefill" if kv.origin == "prefill" else "received",
        medium=kv.medium,
    )


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn TopKV errors into JSON answers with a failure kind the executor understands."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except UnknownKV as exc:
        return error_response(404, "not_found", str(exc), type(exc).__name__)
    except CapacityExceeded as exc:
        return error_response(409, "capacity", str(exc), type(exc).__name__)
    except TransportError as exc:
        kind = classify_failure(exc)
        status = 504 if isinstance(exc, TransferTimeout) else 502
        return error_response(status, kind.value, str(exc), type(exc).__name__)
    except ServiceError as exc:
        return error_response(500, "internal", str(exc), type(exc).__name__)


async def serve_worker(config: WorkerConfig, stop: asyncio.Event) -> None:
    """Run a worker until ``stop`` is set, then deregister and release everything."""
    service = WorkerService(config)
    try:
        await service.start()
        await stop.wait()
    finally:
        await service.stop()
