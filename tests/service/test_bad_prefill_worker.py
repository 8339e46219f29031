"""A prefill worker that fails or answers nonsense never turns into a 5xx for a client.

Fake prefill workers are registered with a worker token beside real ones; their control APIs
answer the prefill start with a 500, a 200 that is not JSON, JSON of the wrong shape, a
summary of another request, bytes that are not HTTP, or a closed connection. Every request
is then served by a real prefill worker, each fake is benched (``/metrics``), and with no
real prefill worker left a request gets a specific 502 or 503 JSON error, never a 500.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import pytest

from topkv.relay.workers import WorkerCapabilities
from topkv.service.cluster.tokens import ClusterTokens
from topkv.service.compute.engines import EngineSpec
from topkv.service.http.auth import Credentials, ServerAuth, auth_headers
from topkv.service.orchestrator.api import OrchestratorServiceConfig, serve_orchestrator
from topkv.service.worker.service import WorkerConfig, WorkerFaults, WorkerService

TOKENS = ClusterTokens()
FAKE_WORKER = "fake-prefill"
LAYOUT = {"num_layers": 2, "seq_len": 4, "kv_heads": 1, "head_dim": 8, "dtype": "fp32"}
#: How each fake answers ``POST /v1/kv/{id}/prefill``.
MODES = ("error", "not_json", "wrong_shape", "other_request", "not_http", "close")


def _answer(mode: str, model: str) -> bytes:
    """The bytes a fake worker in ``mode`` writes back (empty: it hangs up)."""
    if mode == "close":
        return b""
    if mode == "not_http":
        return b"SSH-2.0-OpenSSH_9.6\r\n\r\n"
    status, body = "200 OK", b""
    if mode == "error":
        status, body = "500 Internal Server Error", b"boom"
    elif mode == "not_json":
        body = b"<html>surely a KV summary</html>"
    elif mode == "wrong_shape":
        body = json.dumps({"ok": True, "layout": [1, 2, 3]}).encode()
    elif mode == "other_request":
        summary = {"request_id": 987654, "model_id": model, "layout": LAYOUT, "size_bytes": 1,
                   "digest": 0, "origin": "prefill", "complete": False}  # fmt: skip
        body = json.dumps(summary).encode()
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


@asynccontextmanager
async def _fake_worker(mode: str, model: str) -> AsyncIterator[str]:
    """A listener that reads one request and answers it as ``mode`` says; its URL."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length:\s*(\d+)", head)
            if length:
                await reader.readexactly(int(length.group(1)))
            writer.write(_answer(mode, model))
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


def _worker(role: str, gpu: int, url: str, engine: EngineSpec) -> WorkerService:
    return WorkerService(
        WorkerConfig(
            role=role,  # type: ignore[arg-type]
            node="n0",
            secret=b"bad-prefill-test-secret",
            gpus=(gpu,),
            host_id="h0",
            orchestrator_url=url,
            ttl_s=5.0,
            capabilities=WorkerCapabilities(),
            faults=WorkerFaults(),
            engine=engine,
            media=("tcp", "shm"),
            capacity=16,  # all ten requests at once
            auth=ServerAuth(
                Credentials.of(admin=[TOKENS.admin]), client_token=TOKENS.worker_token(role)
            ),
        )
    )


async def _register_fake(
    http: aiohttp.ClientSession, url: str, worker_id: str, control: str
) -> None:
    body = {"worker": {"worker_id": worker_id, "role": "prefill", "node": "n0",
                       "host_id": "h0", "gpus": [7], "control_url": control}}  # fmt: skip
    headers = auth_headers(TOKENS.worker_token(FAKE_WORKER))
    async with http.post(f"{url}/v1/workers", json=body, headers=headers) as answer:
        assert answer.status == 201, await answer.text()


def _benched(metrics: str) -> float:
    found = re.search(r"^topkv_prefill_workers_benched (\S+)$", metrics, re.M)
    assert found, "the benched-workers gauge is exported"
    return float(found.group(1))


Answers = list[tuple[int, Any]]


async def _run(
    engine: EngineSpec, *, real_prefill: bool, fakes: tuple[str, ...], body: dict[str, Any]
) -> tuple[Answers, list[Any], str]:
    """Submit 10 requests to an orchestrator with the ``fakes`` (and a real prefill worker
    when ``real_prefill``) registered; each answer, each final record, and ``/metrics``."""
    stop = asyncio.Event()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    auth = TOKENS.orchestrator_auth(["prefill", "decode", FAKE_WORKER])
    orchestrator = asyncio.create_task(
        serve_orchestrator(OrchestratorServiceConfig(auth=auth), "127.0.0.1", 0, stop, ready)
    )
    url = await ready
    roles = ("prefill", "decode") if real_prefill else ("decode",)
    workers = [_worker(role, gpu, url, engine) for gpu, role in enumerate(roles)]
    model = body["model"]
    try:
        for worker in workers:
            await worker.start()
        if real_prefill and engine.kind == "hf":
            model = workers[0].engine.model_id  # type: ignore[union-attr]
        async with (
            _fake_workers(fakes, model) as urls,
            aiohttp.ClientSession(headers=auth_headers(TOKENS.admin)) as http,
        ):
            for index, fake_url in enumerate(urls):
                await _register_fake(http, url, f"fake-{index}", fake_url)
            answers: Answers = []
            for rid in range(1, 11):
                submit = {**body, "model": model, "request_id": rid}
                async with http.post(f"{url}/v1/requests", json=submit) as answer:
                    answers.append((answer.status, await answer.json()))
            records = []
            for rid, (status, _) in enumerate(answers, start=1):
                if status != 202:
                    continue
                for _ in range(500):
                    async with http.get(f"{url}/v1/requests/{rid}") as answer:
                        record = await answer.json()
                    if record["state"] in ("failed", "cancelled") or record["decode_check"]:
                        break
                    await asyncio.sleep(0.02)
                records.append(record)
            async with http.get(f"{url}/metrics") as answer:
                metrics = await answer.text()
        return answers, records, metrics
    finally:
        for worker in reversed(workers):
            await worker.stop()
        stop.set()
        await orchestrator


@asynccontextmanager
async def _fake_workers(modes: tuple[str, ...], model: str) -> AsyncIterator[list[str]]:
    """One fake worker per mode, all listening while the block runs; their URLs."""
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(_fake_worker(m, model)) for m in modes]


def _assert_served_despite_fakes(answers: Answers, records: list[Any], metrics: str) -> None:
    assert [status for status, _ in answers] == [202] * 10, [a for a in answers if a[0] != 202]
    assert len(records) == 10
    for record in records:
        assert record["state"] == "delivered", record
        assert not record["source"].startswith("fake"), record
        assert record["decode_check"]["matches_source"], record
    assert _benched(metrics) == len(MODES), metrics
    failures = re.findall(r"^topkv_prefill_start_failures_total\{[^}]*\} (\S+)$", metrics, re.M)
    assert sum(float(n) for n in failures) >= len(MODES), metrics


def test_fake_prefill_workers_never_turn_into_5xx_layout_requests() -> None:
    """Synthetic engine: layout requests with ``prefill: true`` start a prefill too."""
    answers, records, metrics = asyncio.run(
        _run(
            EngineSpec(),
            real_prefill=True,
            fakes=MODES,
            body={"model": "m", "layout": LAYOUT, "prefill": True},
        )
    )
    _assert_served_despite_fakes(answers, records, metrics)


@pytest.mark.model
def test_fake_prefill_workers_never_turn_into_5xx_prompt_requests() -> None:
    """The issue's reproduction: prompt requests, a model on the real prefill worker."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from topkv.engine import DemoModelConfig

    small = DemoModelConfig(layers=2, hidden_size=32, heads=2, kv_heads=1, head_dim=16,
                            intermediate_size=64, vocab_size=128)  # fmt: skip
    answers, records, metrics = asyncio.run(
        _run(
            EngineSpec(kind="hf", demo_seed=3, demo_config=small),
            real_prefill=True,
            fakes=MODES,
            body={"model": "m", "prompt_seed": 4, "prompt_tokens": 5},
        )
    )
    _assert_served_despite_fakes(answers, records, metrics)


@pytest.mark.parametrize("mode", ["error", "wrong_shape"])
def test_only_a_bad_prefill_worker_gives_a_specific_502_then_503(mode: str) -> None:
    answers, _, metrics = asyncio.run(
        _run(
            EngineSpec(),
            real_prefill=False,
            fakes=(mode,),
            body={"model": "m", "layout": LAYOUT, "prefill": True},
        )
    )
    statuses = [status for status, _ in answers]
    # the first request finds the worker bad; the others find it benched
    assert statuses == [502] + [503] * 9, answers
    assert answers[0][1]["error"]["kind"] == "bad_prefill_worker"
    assert "fake-0" in answers[0][1]["error"]["detail"]
    assert answers[1][1]["error"]["kind"] == "no_healthy_prefill_worker"
    assert "fake-0" in answers[1][1]["error"]["detail"]
    assert _benched(metrics) == 1
