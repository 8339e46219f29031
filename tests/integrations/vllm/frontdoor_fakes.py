"""The front door over fake vLLM instances, for its tests without vLLM.

:class:`FakeVllm` answers ``/v1/completions``, ``/v1/chat/completions`` (whole or streamed)
and ``/v1/models`` as an instance running TopKVConnector would, and records every body it
is sent. :class:`FrontDoor` is a :class:`RouterThread` with one fake registered as its
prefill instance and one as its decode instance (both served by one fake, on the front
door's event loop). The raw HTTP client and the hostile-input strategies are the service
tests' (``tests/service/hostile_http.py``).
"""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.parse
from pathlib import Path
from typing import Any

from aiohttp import web
from router_thread import RouterThread

from topkv.relay.registry.memory import MemoryRegistry
from topkv.relay.workers import WorkerCapabilities, WorkerInfo
from topkv.service.http.util import site_url

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "service"))
from hostile_http import JUNK, Answer, fuzz_settings, json_value, nearly_valid, send

__all__ = [
    "JUNK",
    "Answer",
    "FakeVllm",
    "FrontDoor",
    "fuzz_settings",
    "json_value",
    "nearly_valid",
    "send",
]

ADMIN, WORKER = "tkv_admin_for_frontdoor_tests", "tkv_worker_for_frontdoor_tests"


class FakeVllm:
    """One fake instance (both roles); ``context``: the ``max_model_len`` its
    ``/v1/models`` lists (None: none listed)."""

    def __init__(self, context: int | None) -> None:
        self.context = context
        self.received: list[tuple[str, dict[str, Any]]] = []
        self.models_asked = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application(client_max_size=1 << 24)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        return site_url(self._runner, "127.0.0.1")

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        self.models_asked += 1
        card: dict[str, Any] = {"id": "m", "object": "model", "owned_by": "vllm"}
        if self.context is not None:
            card["max_model_len"] = self.context
        return web.json_response({"object": "list", "data": [card]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append((request.path, body))
        chat = request.path.endswith("/chat/completions")
        topkv = (body.get("kv_transfer_params") or {}).get("topkv") or {}
        if "report_of" in topkv:
            report = {"transfer_id": topkv["report_of"], "kv_bytes": 64, "verified": True}
            return web.json_response({"choices": [], "kv_transfer_params": {"topkv": report}})
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "token_ids": [7]}
        if not body.get("stream"):
            choice.update(
                {"message": {"role": "assistant", "content": "ok"}} if chat else {"text": "ok"}
            )
            answer = {
                "id": "cmpl-1", "object": "chat.completion" if chat else "text_completion",
                "model": "m", "choices": [choice],
                "kv_transfer_params": {"topkv": {"kv_bytes": 64, "verified": True}},
            }  # fmt: skip
            return web.json_response(answer)
        choice.update({"delta": {"content": "ok"}} if chat else {"text": "ok"})
        chunk = {"id": "cmpl-1", "created": 1, "model": "m", "choices": [choice]}
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


class FrontDoor:
    """A front door (admin token :data:`ADMIN`) with a fake prefill and decode instance."""

    def __init__(self, shm_dir: str, context: int | None = 4096) -> None:
        self.router = RouterThread(ADMIN, WORKER, shm_dir)
        self.url = self.router.url
        port = urllib.parse.urlsplit(self.url).port
        assert port is not None
        self.port = port
        self.fake = FakeVllm(context)
        fake_url = self._on_loop(self.fake.start())
        registry = self.router.server.registry
        assert isinstance(registry, MemoryRegistry)
        for worker_id, role in (("fake-prefill", "prefill"), ("fake-decode", "decode")):
            info = WorkerInfo(
                worker_id=worker_id, role=role, node="n", host_id="h",  # type: ignore[arg-type]
                capabilities=WorkerCapabilities(media=("shm", "tcp")),
                address="tcp://127.0.0.1:1", control_url=fake_url, capacity=64,
            )  # fmt: skip
            registry.register(info, ttl_s=3600)

    def _on_loop(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.router.loop).result(30)

    def post(
        self,
        path: str,
        body: bytes,
        headers: list[tuple[str, bytes]] | None = None,
        **how: Any,
    ) -> Answer:
        """POST ``body`` exactly as given, with the admin token and a JSON content type
        unless ``headers`` are given."""
        if headers is None:
            headers = [
                ("Authorization", f"Bearer {ADMIN}".encode()),
                ("Content-Type", b"application/json"),
            ]
        return send(self.port, "POST", path, headers, body, **how)

    def close(self) -> None:
        self._on_loop(self.fake.close())
        self.router.close()
