"""``topkv orchestrator`` with the live ADP on (``OrchestratorServiceConfig.adp``): real
workers register over its HTTP API, a burst of submitted requests converts a decode worker
(re-registered through ``HttpRegistrar.update``), every request is delivered and checked
by the decode stand-in, and the worker converts back; ``GET /v1/adp`` (admin only) and
``/metrics`` show it. The service ticks on real time, so every wait is a deadline on an
outcome; the policy is set so that the queue growing alone starts a rush (its 2-of-3 rule
is tested in tests/policy)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest

from topkv.policy.adp.pool import ADPConfig
from topkv.service.cluster.tokens import ClusterTokens
from topkv.service.http.auth import Credentials, ServerAuth
from topkv.service.orchestrator.api import OrchestratorServiceConfig, serve_orchestrator
from topkv.service.orchestrator.client import ApiError, OrchestratorClient
from topkv.service.worker.service import WorkerConfig, WorkerFaults, WorkerService

LAYOUT = {"num_layers": 4, "seq_len": 256, "kv_heads": 2, "head_dim": 64}  # 512 KiB
ADP = ADPConfig(
    min_signals=1,
    velocity_window_s=0.5,
    baseline_window_s=30.0,
    queue_window_s=0.5,
    queue_growth_per_s=0.5,
    ttft_target_s=600.0,
    hold_s=0.5,
    convert_interval_s=0.0,
)


@asynccontextmanager
async def _orchestrator(auth: ServerAuth) -> AsyncIterator[str]:
    stop = asyncio.Event()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    config = OrchestratorServiceConfig(auth=auth, adp=ADP, adp_tick_s=0.1)
    task = asyncio.create_task(serve_orchestrator(config, "127.0.0.1", 0, stop, ready))
    try:
        yield await asyncio.wait_for(ready, 20)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def _until(what: str, check: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        found = await asyncio.to_thread(check)
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_orchestrator_with_adp_converts_on_a_burst_and_back() -> None:
    tokens = ClusterTokens()
    names = ["p0", "d0", "d1"]

    async def main() -> None:
        async with AsyncExitStack() as stack:
            url = await stack.enter_async_context(_orchestrator(tokens.orchestrator_auth(names)))
            for name in names:
                config = WorkerConfig(
                    role="prefill" if name.startswith("p") else "decode",
                    node="n0",
                    secret=b"adp-service-secret-0123456789abcdef",
                    worker_id=name,
                    media=("tcp", "shm"),
                    orchestrator_url=url,
                    capacity=32,
                    # ~0.5 s per send: the burst queues up
                    faults=WorkerFaults(slow_gbps=0.001) if name == "p0" else WorkerFaults(),
                    auth=ServerAuth(
                        Credentials.of(admin=[tokens.admin]),
                        client_token=tokens.worker_token(name),
                    ),
                )
                worker = WorkerService(config)  # registers through HttpRegistrar
                await asyncio.wait_for(worker.start(), 20)
                stack.push_async_callback(worker.stop)
            client = OrchestratorClient(url, token=tokens.admin)
            await asyncio.to_thread(client.wait_workers, 1, 2, 10)
            with pytest.raises(ApiError) as refused:
                await asyncio.to_thread(OrchestratorClient(url).get, "/v1/adp")
            assert refused.value.status == 401
            for rid in range(1, 9):
                await asyncio.to_thread(
                    client.submit, request_id=rid, model="m", layout=LAYOUT, prefill=True
                )

            def converted() -> list[dict[str, Any]]:
                state = client.get("/v1/adp")
                return [c for c in state["conversions"] if c["duration_ms"] is not None]

            done = await _until("a conversion", converted)
            first = done[0]
            assert (first["from"], first["to"]) == ("decode", "prefill")
            for rid in range(1, 9):
                record = await asyncio.to_thread(client.wait_done, rid, 60)
                assert record["state"] == "delivered", record
                assert record["decode_check"]["matches_source"], record
            back = await _until(
                "the conversion back", lambda: len(converted()) >= 2 and converted()
            )
            assert [(c["from"], c["to"]) for c in back[:2]] == [
                ("decode", "prefill"),
                ("prefill", "decode"),
            ]
            assert all(c["worker"] == first["worker"] for c in back[:2])
            assert all(0 < c["duration_ms"] < 10_000 for c in back)
            workers = await asyncio.to_thread(client.workers)  # the loop serves the API
            roles = {w["worker"]["worker_id"]: w["worker"]["role"] for w in workers}
            assert roles == {"p0": "prefill", "d0": "decode", "d1": "decode"}
            state = await asyncio.to_thread(client.get, "/v1/adp")
            assert state["enabled"] and state["rush_periods"]
            metrics = await asyncio.to_thread(client.metrics)
            assert 'topkv_conversions_total{from="decode",to="prefill"}' in metrics
            assert 'topkv_conversion_seconds_count{to="decode"}' in metrics

    asyncio.run(main())
