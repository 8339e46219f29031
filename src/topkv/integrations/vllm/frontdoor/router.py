"""The OpenAI-compatible front door over vLLM instances that run TopKVConnector.

Served by ``topkv router`` (:class:`RouterServer`): ``POST /v1/completions`` and
``/v1/chat/completions`` run each request's prefill on one instance and its decode on
another, with the KV streamed between them (:class:`Router`, picking through :mod:`.picker`,
streaming through :mod:`.stream`); ``GET /v1/models``, ``GET /metrics`` and the instances'
``/v1/workers`` registrations (or, with ``registry_url``, :mod:`.remote_registry`). Endpoints,
headers and auth: docs/vllm.md ("The front door").
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from topkv.integrations.vllm.connector.params import MEDIA
from topkv.integrations.vllm.frontdoor.adp import AdpOptions, FrontDoorADP, Ticket, front_door_adp
from topkv.integrations.vllm.frontdoor.picker import (
    NoInstance,
    Picker,
    Route,
    held_tokens,
    prompt_hashes,
)
from topkv.integrations.vllm.frontdoor.remote_registry import OrchestratorRegistry, polled_registry
from topkv.integrations.vllm.frontdoor.stream import StreamRelay, can_fail_over
from topkv.integrations.vllm.frontdoor.validate import (
    MAX_INFERENCE_BODY_BYTES,
    MAX_MODELS_ANSWER_BYTES,
    Refused,
    ServedContext,
    asks_for_tokens,
    check_context,
    error_response,
    json_errors,
    read_body,
)
from topkv.relay.registry.memory import MemoryRegistry
from topkv.relay.workers import WorkerInfo
from topkv.service.http.auth import Access, ServerAuth, secured_app
from topkv.service.http.auth import Route as ApiRoute
from topkv.service.http.util import site_url
from topkv.service.orchestrator.adp import AdpState
from topkv.service.orchestrator.registrations import Registrations

log = logging.getLogger(__name__)

#: Bound on every call to an instance: connect, and each read of an answer or stream.
_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=3.0, sock_connect=3.0, sock_read=60.0)
#: The KV size the picker assumes before the prompt is tokenized (bytes).
_NOMINAL_KV_BYTES = 1 << 20
#: Bound on the look at an instance's ``/v1/models`` for the model's context.
_MODELS_TIMEOUT = aiohttp.ClientTimeout(total=2.0)


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "topkv_router_requests", "requests by endpoint and outcome",
            ["endpoint", "outcome"], registry=self.registry,
        )  # fmt: skip
        self.kv_bytes = Counter(
            "topkv_router_kv_bytes", "KV bytes: sent by prefill, verified at decode",
            ["kind"], registry=self.registry,
        )  # fmt: skip
        self.recomputed = Counter(
            "topkv_router_kv_recomputed", "loads that failed and were recomputed by decode",
            registry=self.registry,
        )  # fmt: skip
        self.transfers = Counter(
            "topkv_router_transfers", "transfers by medium", ["medium"], registry=self.registry
        )
        self.ttft = Histogram(
            "topkv_router_ttft_seconds", "request start to the decode's first bytes",
            registry=self.registry,
        )  # fmt: skip
        self.prefill = Histogram(
            "topkv_router_prefill_seconds", "the prefill call", registry=self.registry
        )
        self.failovers = Counter(
            "topkv_router_stream_failovers", "broken decode streams continued elsewhere",
            registry=self.registry,
        )  # fmt: skip
        self.affinity = Counter(
            "topkv_router_affinity_hits", "picks of an instance believed to hold the prefix",
            ["role"], registry=self.registry,
        )  # fmt: skip


class UpstreamError(Exception):
    """An instance could not be reached or broke off (the request may be retried)."""


class Router:
    def __init__(
        self,
        registry: MemoryRegistry | OrchestratorRegistry,
        auth: ServerAuth | None,
        shm_dir: str,
        *,
        affinity: bool = True,
        adp: AdpOptions | None = None,
    ) -> None:
        self.registry = registry
        self.auth = auth
        self.remote = registry if isinstance(registry, OrchestratorRegistry) else None
        embedded = registry if isinstance(registry, MemoryRegistry) else MemoryRegistry()
        self.registrations = Registrations(embedded)
        self.metrics = _Metrics()
        #: ``kv_both`` instances move between the pools (:mod:`.pools`); None: off.
        self.adp: FrontDoorADP | None = (
            front_door_adp(adp, registry, self.registrations, self.metrics.registry)
            if adp is not None
            else None
        )
        pools = self.adp.workers if self.adp is not None else None
        self.picker = Picker(registry, shm_dir, affinity=affinity, pools=pools)
        self._ids = itertools.count(int(time.time() * 1000) % (1 << 40))
        #: The served model's context, for the ``max_tokens`` check (:mod:`.validate`).
        self.context = ServedContext()
        self._session: aiohttp.ClientSession | None = None

    def routes(self) -> list[ApiRoute]:
        return [
            ApiRoute("POST", "/v1/completions", self.completions, Access.INFERENCE),
            ApiRoute("POST", "/v1/chat/completions", self.chat, Access.INFERENCE),
            ApiRoute("GET", "/v1/models", self.models, Access.INFERENCE),
            ApiRoute("GET", "/metrics", self.prometheus, Access.METRICS),
            ApiRoute("GET", "/healthz", self.healthz, Access.PUBLIC),
            ApiRoute("GET", "/v1/adp", self.adp_state, Access.ADMIN),
            *(self.registrations.routes() if self.remote is None else self._elsewhere()),
        ]

    def _elsewhere(self) -> list[ApiRoute]:
        """With a remote registry: /v1/workers answers 409 naming where to register."""
        assert self.remote is not None
        url = self.remote.url

        async def refuse(request: web.Request) -> web.Response:
            return error_response(
                409, "registry", f"this front door reads its instances from {url}: register there"
            )

        return [
            ApiRoute("POST", "/v1/workers", refuse, Access.WORKER),
            ApiRoute("PUT", "/v1/workers/{worker_id}/heartbeat", refuse, Access.WORKER),
            ApiRoute("DELETE", "/v1/workers/{worker_id}", refuse, Access.WORKER),
        ]

    def _unavailable(self, why: str) -> str:
        """``why``, and the remote registry's trouble when it has one."""
        problem = self.remote.problem if self.remote is not None else None
        return f"{why} ({problem})" if problem else why

    async def forget(self, worker_id: str) -> None:
        """``worker_id`` failed: out of the registry (and of the affinity table)."""
        self.picker.forget(worker_id)
        if self.remote is not None:
            await self.remote.forget(worker_id)
        else:
            self.registrations.forget(worker_id)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=_TIMEOUT)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    # -- endpoints ------------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def prometheus(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def adp_state(self, request: web.Request) -> web.Response:
        """The ADP's rush, stages and moves (the orchestrator's ``GET /v1/adp`` shape)."""
        state = self.adp.state() if self.adp is not None else AdpState(enabled=False)
        body = state.model_dump_json(by_alias=True)
        return web.Response(body=body, content_type="application/json")

    async def models(self, request: web.Request) -> web.Response:
        decodes = self.registry.workers("decode")
        if not decodes:
            why = self._unavailable("no decode instance is registered")
            return error_response(503, "unavailable", why)
        try:
            async with self._client().get(decodes[0].control_url + "/v1/models") as answer:
                listed = await answer.read()
                if answer.status == 200:
                    self.context.learn(listed)
                return web.Response(
                    body=listed, status=answer.status, content_type="application/json"
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            return error_response(502, "upstream", f"{decodes[0].worker_id}: {exc}")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "/v1/completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "/v1/chat/completions")

    # -- the flow -------------------------------------------------------------------------

    async def _serve(self, request: web.Request, path: str) -> web.StreamResponse:
        try:  # checked before any work (:mod:`.validate`): a refusal names the field
            body = await read_body(request, chat=path.endswith("/chat/completions"))
            if asks_for_tokens(body):
                check_context(body, await self.context.current(self._models_answer))
        except Refused as refused:
            return refused.response()
        excluded: set[str] = set()
        hashes = prompt_hashes(body)
        asked = request.headers.get("X-TopKV-Medium", "")
        media = [m.strip() for m in asked.split(",") if m.strip()] or None
        unknown = [m for m in media or () if m not in MEDIA]
        if unknown:
            return error_response(
                400, "bad_request",
                f"X-TopKV-Medium: unknown medium {', '.join(unknown)}; choose from "
                f"{', '.join(MEDIA)}",
            )  # fmt: skip
        ticket = self.adp.admit(body) if self.adp is not None else Ticket(None)
        try:
            for _attempt in range(2):
                try:
                    route = self.picker.pick(_NOMINAL_KV_BYTES, excluded, hashes, media)
                except NoInstance as exc:
                    self.metrics.requests.labels(path, "unavailable").inc()
                    return error_response(503, "unavailable", self._unavailable(str(exc)))
                try:
                    return await self._run(request, path, body, route, hashes, ticket)
                except UpstreamError as exc:
                    failed = str(exc.args[1]) if len(exc.args) > 1 else route.decode.worker_id
                    log.warning("router: %s; dropping %s and trying again", exc.args[0], failed)
                    await self.forget(failed)
                    excluded.add(failed)
        finally:
            ticket.close()
        self.metrics.requests.labels(path, "upstream_failed").inc()
        return error_response(502, "upstream", "the chosen instances failed twice")

    async def _models_answer(self) -> bytes | None:
        """A decode instance's ``GET /v1/models`` answer (None: none answered it)."""
        decodes = self.registry.workers("decode")
        if not decodes:
            return None
        url = decodes[0].control_url + "/v1/models"
        try:
            async with self._client().get(url, timeout=_MODELS_TIMEOUT) as answer:
                if answer.status != 200:
                    return None
                listed = b""
                while len(listed) <= MAX_MODELS_ANSWER_BYTES:
                    piece = await answer.content.read(MAX_MODELS_ANSWER_BYTES + 1 - len(listed))
                    if not piece:
                        return listed
                    listed += piece
                return None  # too long to be a list of models
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.info("router: %s: %s", url, exc)
            return None

    async def _post(self, worker_id: str, url: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
        try:
            return await self._client().post(url, json=body)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamError(f"{worker_id} ({url}): {exc}", worker_id) from exc

    async def _run(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        route: Route,
        hashes: tuple[bytes, ...] = (),
        ticket: Ticket | None = None,
    ) -> web.StreamResponse:
        ticket = ticket or Ticket(None)
        started = time.perf_counter()
        transfer_id = next(self._ids)
        send: dict[str, Any] = {"transfer_id": transfer_id, "destination": route.destination}
        skip = held_tokens(body, route.affinity[1])
        if skip:  # the decode instance holds them: only the rest travels
            send["skip_tokens"] = skip
        prefill_body = {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "topkv": send},
        }
        prefill_body.pop("max_completion_tokens", None)
        prefill_body.pop("stream_options", None)
        ids = (route.prefill.worker_id, route.decode.worker_id)
        self.picker.in_flight.update(ids)
        ticket.routed(*ids)
        try:
            prefill = await self._post(ids[0], route.prefill.control_url + path, prefill_body)
            async with prefill:
                answer = await prefill.read()
                ticket.prefilled()
                if prefill.status != 200:
                    self.metrics.requests.labels(path, f"prefill_{prefill.status}").inc()
                    return web.Response(
                        body=answer, status=prefill.status, content_type="application/json"
                    )
                sent = self._count_sent(answer)
            self.metrics.prefill.observe(time.perf_counter() - started)
            self.picker.served(ids[0], hashes)
            for role, matched in zip(("prefill", "decode"), route.affinity, strict=True):
                if matched:
                    self.metrics.affinity.labels(role).inc()
            # what the prefill reported, for a streamed answer (which carries no
            # kv_transfer_params): the transfer, its medium and the bytes sent
            headers = {
                "X-TopKV-Transfer-Id": str(transfer_id),
                "X-TopKV-Medium": route.medium,
                "X-TopKV-KV-Bytes-Sent": str(sent if sent is not None else ""),
                "X-TopKV-Prefill": ids[0],
                "X-TopKV-Decode": ids[1],
                "X-TopKV-Prefix-Blocks": f"{route.affinity[0]},{route.affinity[1]}",
            }
            self.metrics.transfers.labels(route.medium).inc()
            decode_body = {
                **body,
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "topkv": {"transfer_id": transfer_id, "medium": route.medium},
                },
            }
            streamed = bool(body.get("stream"))
            if streamed and can_fail_over(body):
                decode_body["return_token_ids"] = True  # to continue it elsewhere if it breaks
            decode = await self._post(ids[1], route.decode.control_url + path, decode_body)
            self.picker.served(ids[1], hashes)
            if not streamed or decode.status != 200:
                async with decode:
                    self.metrics.ttft.observe(time.perf_counter() - started)
                    ticket.answered(time.perf_counter() - started)
                    try:
                        answer = await decode.read()
                    except (aiohttp.ClientError, TimeoutError) as exc:
                        raise UpstreamError(
                            f"{ids[1]}: the answer broke off: {exc}", ids[1]
                        ) from exc
                    if decode.status == 200:
                        self._count_loaded(answer)
                    self.metrics.requests.labels(path, str(decode.status)).inc()
                    return web.Response(
                        body=answer, status=decode.status, content_type="application/json",
                        headers=headers,
                    )  # fmt: skip
            self.metrics.ttft.observe(time.perf_counter() - started)
            ticket.answered(time.perf_counter() - started)
            return await self._relay(request, path, body, route, transfer_id, decode, headers)
        finally:
            self.picker.in_flight.subtract(ids)

    async def _relay(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        route: Route,
        transfer_id: int,
        decode: aiohttp.ClientResponse,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        """Stream the decode's answer to the client (:class:`.stream.StreamRelay`)."""
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
        await out.prepare(request)
        model = body.get("model")

        async def report() -> dict[str, Any] | None:
            return await self._report(route.decode, model, transfer_id)

        async def open_stream(
            worker: WorkerInfo, url_path: str, continuation: dict[str, Any]
        ) -> aiohttp.ClientResponse:
            self.picker.in_flight[worker.worker_id] += 1
            opened.append(worker.worker_id)
            return await self._client().post(worker.control_url + url_path, json=continuation)

        opened: list[str] = []
        relay = StreamRelay(
            out, body, path.endswith("/chat/completions"), report, open_stream,
            self.picker.fallback_decode, self.forget,
        )  # fmt: skip
        try:
            await relay.run(route.decode, decode)
        except (ConnectionError, RuntimeError) as exc:  # the client went away
            log.info("router: the client of %s left: %s", transfer_id, exc)
            relay.outcome = "client_gone"
        finally:
            await relay.close()
            self.picker.in_flight.subtract(opened)
        self.metrics.failovers.inc(len(relay.failovers))
        params = relay.final_params
        if params is not None:
            self._count_loaded(json.dumps({"kv_transfer_params": params}).encode())
        self.metrics.requests.labels(path, relay.outcome).inc()
        if relay.outcome in ("200", "stream_error"):
            with contextlib.suppress(ConnectionError, RuntimeError):
                await out.write_eof()
        return out

    async def _report(
        self, decode: WorkerInfo, model: Any, transfer_id: int
    ) -> dict[str, Any] | None:
        """The decode instance's load report of ``transfer_id`` (see :mod:`.scheduler_side`)."""
        body = {
            "model": model, "prompt": [0], "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"topkv": {"report_of": transfer_id}},
        }  # fmt: skip
        async with self._client().post(decode.control_url + "/v1/completions", json=body) as r:
            answer = await r.read()
            if r.status != 200:
                raise UpstreamError(f"{decode.worker_id}: the report: HTTP {r.status}")
        part = _topkv_params(answer) or {}
        report = part.get("report")
        return report if isinstance(report, dict) else None

    def _count_sent(self, answer: bytes) -> int | None:
        """Count the bytes the prefill reports it sent; returns them (None: not reported)."""
        part = _topkv_params(answer)
        if part is not None and isinstance(part.get("kv_bytes"), int):
            self.metrics.kv_bytes.labels("sent").inc(part["kv_bytes"])
            return int(part["kv_bytes"])
        return None

    def _count_loaded(self, answer: bytes) -> None:
        part = _topkv_params(answer)
        if part is None:
            return
        if part.get("verified") and isinstance(part.get("kv_bytes"), int):
            self.metrics.kv_bytes.labels("verified").inc(part["kv_bytes"])
        if part.get("recomputed"):
            self.metrics.recomputed.inc()


def _topkv_params(answer: bytes) -> dict[str, Any] | None:
    try:
        params = json.loads(answer).get("kv_transfer_params") or {}
    except (ValueError, AttributeError):
        return None
    part = params.get("topkv") if isinstance(params, dict) else None
    return part if isinstance(part, dict) else None


class RouterServer:
    """The front door on ``host:port``: with its embedded registry (leases swept here), or
    reading the instances from the orchestrator at ``registry_url`` (with ``registry_token``,
    one of its admin tokens) or from the etcd registry at an ``etcd://`` one."""

    def __init__(
        self,
        auth: ServerAuth | None,
        shm_dir: str = "/tmp",
        *,
        registry_url: str = "",
        registry_token: str | None = None,
        affinity: bool = True,
        adp: AdpOptions | None = None,
    ) -> None:
        self.registry: MemoryRegistry | OrchestratorRegistry = (
            polled_registry(registry_url, registry_token) if registry_url else MemoryRegistry()
        )
        self.router = Router(self.registry, auth, shm_dir, affinity=affinity, adp=adp)
        self._adp_tick_s = adp.tick_s if adp is not None else 0.0
        self.auth = auth
        self._runner: web.AppRunner | None = None
        self._expire: asyncio.Task[None] | None = None

    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Start serving; the URL clients (and, with the embedded registry, instances) use."""
        if isinstance(self.registry, OrchestratorRegistry):
            await self.registry.start()
        app = secured_app(
            self.router.routes(),
            self.auth,
            middlewares=[json_errors],
            client_max_size=MAX_INFERENCE_BODY_BYTES,
        )
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        if isinstance(self.registry, MemoryRegistry):
            self._expire = asyncio.create_task(self._expire_loop(self.registry))
        if self.router.adp is not None:
            self.router.adp.start(self._adp_tick_s)
        return site_url(self._runner, host)

    async def _expire_loop(self, registry: MemoryRegistry) -> None:
        while True:
            await asyncio.sleep(0.25)
            registry.expire()

    async def close(self) -> None:
        if self.router.adp is not None:
            await self.router.adp.close()
        if self._expire is not None:
            self._expire.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expire
        if isinstance(self.registry, OrchestratorRegistry):
            await self.registry.aclose()
        await self.router.close()
        if self._runner is not None:
            await self._runner.cleanup()
