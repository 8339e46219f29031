"""The OpenAI-compatible front door over vLLM instances that run TopKVConnector.

Served by ``topkv router`` (its own process rather than the orchestrator: it proxies
long-lived streams to vLLM and holds the vLLM instances' registrations, which the
orchestrator's transfer API neither needs nor should carry). Endpoints:

* ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` true or false): the
  picker (:mod:`.picker`) chooses a prefill and a decode instance; the prefill instance
  runs the prompt with ``max_tokens`` 1 and ``kv_transfer_params`` naming the destination
  (it streams every layer to it while it computes); the decode instance then runs the
  request with ``kv_transfer_params`` naming the transfer, and its answer (or stream) goes
  back to the client as it comes. A decode instance that cannot be reached is dropped from
  the registry and the request is tried once more on another; none left: 503.
  Every decode answer carries ``X-TopKV-Transfer-Id``, ``-Medium``, ``-KV-Bytes-Sent``
  (what the prefill reported), ``-Prefill`` and ``-Decode`` (the instances): a streamed
  answer has no ``kv_transfer_params``.
* ``GET /v1/models``: a decode instance's list. ``GET /metrics``: Prometheus text.
* ``/v1/workers`` (register, heartbeat, deregister): the vLLM instances' registrations,
  with worker tokens, exactly as on ``topkv orchestrator``.

Every endpoint but ``/metrics`` (open unless protected) needs ``Authorization: Bearer``
with an admin token (the OpenAI client's ``api_key``) or, for ``/v1/workers``, a worker token.
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

from topkv.integrations.vllm.picker import NoInstance, Picker, Route
from topkv.relay.registry import MemoryRegistry
from topkv.service.auth import Access, ServerAuth, secured_app
from topkv.service.auth import Route as ApiRoute
from topkv.service.httputil import site_url
from topkv.service.registrations import Registrations

log = logging.getLogger(__name__)

#: Bound on every call to an instance: connect, and each read of an answer or stream.
_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=3.0, sock_connect=3.0, sock_read=60.0)
#: The KV size the picker assumes before the prompt is tokenized (bytes).
_NOMINAL_KV_BYTES = 1 << 20


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


class UpstreamError(Exception):
    """An instance could not be reached or broke off (the request may be retried)."""


class Router:
    def __init__(self, registry: MemoryRegistry, auth: ServerAuth | None, shm_dir: str) -> None:
        self.registry = registry
        self.auth = auth
        self.registrations = Registrations(registry)
        self.picker = Picker(registry, shm_dir)
        self.metrics = _Metrics()
        self._ids = itertools.count(int(time.time() * 1000) % (1 << 40))
        self._session: aiohttp.ClientSession | None = None

    def routes(self) -> list[ApiRoute]:
        return [
            ApiRoute("POST", "/v1/completions", self.completions, Access.ADMIN),
            ApiRoute("POST", "/v1/chat/completions", self.chat, Access.ADMIN),
            ApiRoute("GET", "/v1/models", self.models, Access.ADMIN),
            ApiRoute("GET", "/metrics", self.prometheus, Access.METRICS),
            ApiRoute("GET", "/healthz", self.healthz, Access.PUBLIC),
            *self.registrations.routes(),
        ]

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

    async def models(self, request: web.Request) -> web.Response:
        decodes = self.registry.workers("decode")
        if not decodes:
            return error_response(503, "unavailable", "no decode instance is registered")
        try:
            async with self._client().get(decodes[0].control_url + "/v1/models") as answer:
                return web.Response(
                    body=await answer.read(), status=answer.status, content_type="application/json"
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            return error_response(502, "upstream", f"{decodes[0].worker_id}: {exc}")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "/v1/completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "/v1/chat/completions")

    # -- the flow -------------------------------------------------------------------------

    async def _serve(self, request: web.Request, path: str) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except ValueError as exc:
            return error_response(400, "bad_request", f"the body is not JSON: {exc}")
        if not isinstance(body, dict):
            return error_response(400, "bad_request", "the body must be a JSON object")
        excluded: set[str] = set()
        for _attempt in range(2):
            try:
                route = self.picker.pick(_NOMINAL_KV_BYTES, excluded)
            except NoInstance as exc:
                self.metrics.requests.labels(path, "unavailable").inc()
                return error_response(503, "unavailable", str(exc))
            try:
                return await self._run(request, path, body, route)
            except UpstreamError as exc:
                failed = str(exc.args[1]) if len(exc.args) > 1 else route.decode.worker_id
                log.warning("router: %s; dropping %s and trying again", exc.args[0], failed)
                self.registrations.forget(failed)
                excluded.add(failed)
        self.metrics.requests.labels(path, "upstream_failed").inc()
        return error_response(502, "upstream", "the chosen instances failed twice")

    async def _post(self, worker_id: str, url: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
        try:
            return await self._client().post(url, json=body)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamError(f"{worker_id} ({url}): {exc}", worker_id) from exc

    async def _run(
        self, request: web.Request, path: str, body: dict[str, Any], route: Route
    ) -> web.StreamResponse:
        started = time.perf_counter()
        transfer_id = next(self._ids)
        prefill_body = {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {
                "do_remote_decode": True,
                "topkv": {"transfer_id": transfer_id, "destination": route.destination},
            },
        }
        prefill_body.pop("max_completion_tokens", None)
        prefill_body.pop("stream_options", None)
        ids = (route.prefill.worker_id, route.decode.worker_id)
        self.picker.in_flight.update(ids)
        try:
            prefill = await self._post(ids[0], route.prefill.control_url + path, prefill_body)
            async with prefill:
                answer = await prefill.read()
                if prefill.status != 200:
                    self.metrics.requests.labels(path, f"prefill_{prefill.status}").inc()
                    return web.Response(
                        body=answer, status=prefill.status, content_type="application/json"
                    )
                sent = self._count_sent(answer)
            self.metrics.prefill.observe(time.perf_counter() - started)
            # what the prefill reported, for a streamed answer (which carries no
            # kv_transfer_params): the transfer, its medium and the bytes sent
            headers = {
                "X-TopKV-Transfer-Id": str(transfer_id),
                "X-TopKV-Medium": route.medium,
                "X-TopKV-KV-Bytes-Sent": str(sent if sent is not None else ""),
                "X-TopKV-Prefill": ids[0],
                "X-TopKV-Decode": ids[1],
            }
            self.metrics.transfers.labels(route.medium).inc()
            decode_body = {
                **body,
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "topkv": {"transfer_id": transfer_id, "medium": route.medium},
                },
            }
            decode = await self._post(ids[1], route.decode.control_url + path, decode_body)
            async with decode:
                self.metrics.ttft.observe(time.perf_counter() - started)
                if not body.get("stream") or decode.status != 200:
                    answer = await decode.read()
                    if decode.status == 200:
                        self._count_loaded(answer)
                    self.metrics.requests.labels(path, str(decode.status)).inc()
                    return web.Response(
                        body=answer, status=decode.status, content_type="application/json",
                        headers=headers,
                    )  # fmt: skip
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
                await out.prepare(request)
                try:
                    async for chunk in decode.content.iter_any():
                        await out.write(chunk)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    log.warning("router: the stream from %s broke off: %s", ids[1], exc)
                    self.metrics.requests.labels(path, "stream_broken").inc()
                    return out  # headers are sent: the client sees the stream end early
                await out.write_eof()
                self.metrics.requests.labels(path, "200").inc()
                return out
        finally:
            self.picker.in_flight.subtract(ids)

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


def error_response(status: int, kind: str, detail: str) -> web.Response:
    """TopKV's error shape (``kind``, ``type``, ``detail``) plus OpenAI's ``message`` and
    ``code``, so the openai client shows the reason."""
    error = {"kind": kind, "type": kind, "detail": detail, "message": detail, "code": status}
    return web.json_response({"error": error}, status=status)


def _topkv_params(answer: bytes) -> dict[str, Any] | None:
    try:
        params = json.loads(answer).get("kv_transfer_params") or {}
    except (ValueError, AttributeError):
        return None
    part = params.get("topkv") if isinstance(params, dict) else None
    return part if isinstance(part, dict) else None


class RouterServer:
    """The front door on ``host:port``, with its embedded registry (leases swept here)."""

    def __init__(self, auth: ServerAuth | None, shm_dir: str = "/tmp") -> None:
        self.registry = MemoryRegistry()
        self.router = Router(self.registry, auth, shm_dir)
        self.auth = auth
        self._runner: web.AppRunner | None = None
        self._expire: asyncio.Task[None] | None = None

    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Start serving; the URL clients and instances use."""
        app = secured_app(self.router.routes(), self.auth)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        self._expire = asyncio.create_task(self._expire_loop())
        return site_url(self._runner, host)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            self.registry.expire()

    async def close(self) -> None:
        if self._expire is not None:
            self._expire.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expire
        await self.router.close()
        if self._runner is not None:
            await self._runner.cleanup()
