"""Control-plane benchmark of the relay orchestrator (in process, tiny payloads).

The executor here completes every attempt at once and moves no bytes, so what is measured
is the orchestrator's own work per transfer: submit, queue, route (RoutingPolicy over the
live decode workers, CostPolicy over each pair's paths), the state machine, digest check,
completion queue, release calls and metrics. Two figures:

* throughput: N transfers submitted back to back with the default limit (100 in flight),
  each completion consumed and its decode slot released; transfers per second;
  also per second of this process's CPU time, which stays meaningful when other work
  shares the cores (the wall-clock rate is printed with the load average beside it);
* overhead: one transfer at a time, ``submit`` to its completion taken off the queue;
  p50 and p99 in microseconds.

Each figure is the median of ``--runs`` runs. A third figure, ``under_link_load``, repeats
the throughput run with an executor that yields to the event loop once per attempt, so up
to 100 transfers overlap and every routing decision sees link load (the costs cannot be
reused from the previous decision and are recomputed for every decode worker).

Targets (issue #5): >= 10,000 transfers/s and p50 <= 100 us.

``auth`` (issue #13): what bearer-token checks cost, measured in the same run with them off.
``check_us``: one :meth:`Credentials.authenticate` (SHA-256 of the token, constant-time
compares against one admin and 64 worker digests); ``http``: requests per second through
the same :func:`~topkv.service.http.auth.secured_app` stack the orchestrator serves (a trivial
admin endpoint, keep-alive loopback HTTP, 32 concurrent), auth on vs off, and the ratio.
The relay's transfers/s above does not pass through HTTP, so auth cannot change it; at
10,000 transfers/s the checks cost ``10,000 * check_us`` microseconds of CPU per second.

Run: ``.venv/bin/python benchmarks/orchestrator.py [--transfers N] [--decode M] [--runs R]``
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import time

from topkv.relay.executor import AttemptPlan, Delivery
from topkv.relay.orchestrator import Orchestrator
from topkv.relay.orchestrator_config import OrchestratorConfig
from topkv.relay.registry.memory import MemoryRegistry
from topkv.relay.workers import WorkerInfo
from topkv.service.http.auth import Access, Credentials, Route, ServerAuth, new_token, secured_app
from topkv.transport.base import KVLayout

LAYOUT = KVLayout(num_layers=1, seq_len=1, kv_heads=1, head_dim=8)  # 32 bytes
DIGEST = 0


class ImmediateExecutor:
    """Completes every attempt at once without moving bytes (control-plane cost only)."""

    async def source_digest(self, source: WorkerInfo, request_id: int, layout: KVLayout) -> int:
        return DIGEST

    async def transfer(self, plan: AttemptPlan) -> Delivery:
        return Delivery(
            plan.request_id, plan.destination.worker_id, plan.path_class, "none", 32, 1e-6, DIGEST
        )

    async def probe(self, worker: WorkerInfo) -> bool:
        return True

    async def release_source(self, source: WorkerInfo, request_id: int) -> None:
        return None

    async def discard_destination(self, destination: WorkerInfo, request_id: int) -> None:
        return None


def _registry(decode: int) -> MemoryRegistry:
    registry = MemoryRegistry()
    registry.register(WorkerInfo(worker_id="p0", role="prefill", node="n0", gpus=(0,)))
    for i in range(decode):
        registry.register(
            WorkerInfo(
                worker_id=f"d{i}",
                role="decode",
                node=f"n{i % 2}",
                gpus=(1 + i,),
                capacity=10_000,
            )
        )
    return registry


class YieldingExecutor(ImmediateExecutor):
    """Like :class:`ImmediateExecutor`, but each attempt yields to the event loop once."""

    async def transfer(self, plan: AttemptPlan) -> Delivery:
        await asyncio.sleep(0)
        return await super().transfer(plan)


async def throughput(
    transfers: int, decode: int, executor: ImmediateExecutor | None = None
) -> tuple[float, float]:
    orch = Orchestrator(
        _registry(decode), executor or ImmediateExecutor(), config=OrchestratorConfig()
    )
    async with orch:
        done = 0

        async def consume() -> None:
            nonlocal done
            while done < transfers:
                completion = await orch.next_completion(30)
                orch.release_decode_slot(completion.request_id)
                done += 1

        consumer = asyncio.create_task(consume())
        start = time.perf_counter()
        cpu = time.process_time()
        for rid in range(transfers):
            await orch.submit(rid, "m", LAYOUT, "p0", source_digest=DIGEST)
        await consumer
        wall = time.perf_counter() - start
        return transfers / wall, transfers / (time.process_time() - cpu)


async def overhead(samples: int, decode: int) -> list[float]:
    orch = Orchestrator(_registry(decode), ImmediateExecutor())
    latencies: list[float] = []
    async with orch:
        for rid in range(samples + 200):
            start = time.perf_counter()
            await orch.submit(rid, "m", LAYOUT, "p0", source_digest=DIGEST)
            completion = await orch.next_completion(5)
            latencies.append(time.perf_counter() - start)
            orch.release_decode_slot(completion.request_id)
    return latencies[200:]  # drop warm-up


def check_cost_us(checks: int = 20_000) -> float:
    """Microseconds per token check (1 admin + 64 worker digests, the admin token shown)."""
    admin = new_token()
    credentials = Credentials.of(admin=[admin], worker=[new_token() for _ in range(64)])
    start = time.perf_counter()
    for _ in range(checks):
        credentials.authenticate(admin)
    return (time.perf_counter() - start) / checks * 1e6


async def http_rate(auth_on: bool, requests: int, concurrency: int = 32) -> float:
    """Requests/s through the orchestrator's HTTP stack (auth middleware included)."""
    import aiohttp
    from aiohttp import web

    token = new_token()

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    auth = ServerAuth(Credentials.of(admin=[token])) if auth_on else None
    app = secured_app([Route("GET", "/v1/transfers", ok, Access.ADMIN)], auth)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}/v1/transfers"
    headers = {"Authorization": f"Bearer {token}"}
    per_worker = requests // concurrency
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as http:

            async def worker() -> None:
                for _ in range(per_worker):
                    async with http.get(url, headers=headers) as answer:
                        assert answer.status == 200
                        await answer.read()

            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return per_worker * concurrency / (time.perf_counter() - start)
    finally:
        await runner.cleanup()


def _median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transfers", type=int, default=20_000)
    parser.add_argument("--samples", type=int, default=3_000)
    parser.add_argument("--decode", type=int, default=4, help="decode workers to route among")
    parser.add_argument("--runs", type=int, default=5, help="runs per figure (median)")
    parser.add_argument("--http-requests", type=int, default=4_000, help="per auth run")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    rates: list[float] = []
    cpu_rates: list[float] = []
    p50s: list[float] = []
    p99s: list[float] = []
    loaded_rates: list[float] = []
    loaded_cpu_rates: list[float] = []
    for _ in range(args.runs):
        gc.collect()
        rate, cpu_rate = asyncio.run(throughput(args.transfers, args.decode))
        rates.append(rate)
        cpu_rates.append(cpu_rate)
        lat = sorted(asyncio.run(overhead(args.samples, args.decode)))
        p50s.append(statistics.median(lat) * 1e6)
        p99s.append(lat[int(len(lat) * 0.99) - 1] * 1e6)
        gc.collect()
        rate, cpu_rate = asyncio.run(throughput(args.transfers, args.decode, YieldingExecutor()))
        loaded_rates.append(rate)
        loaded_cpu_rates.append(cpu_rate)
    http_on: list[float] = []
    http_off: list[float] = []
    checks: list[float] = []
    asyncio.run(http_rate(False, 500))  # warm-up: imports, first connections
    for _ in range(args.runs):  # interleaved, so load changes hit both alike
        http_off.append(asyncio.run(http_rate(False, args.http_requests)))
        http_on.append(asyncio.run(http_rate(True, args.http_requests)))
        checks.append(check_cost_us())
    rate, cpu_rate, p50 = _median(rates), _median(cpu_rates), _median(p50s)
    check_us = _median(checks)
    result = {
        "transfers_per_s": round(rate),
        "transfers_per_cpu_s": round(cpu_rate),
        "overhead_p50_us": round(p50, 1),
        "overhead_p99_us": round(_median(p99s), 1),
        "under_link_load": {
            "transfers_per_s": round(_median(loaded_rates)),
            "transfers_per_cpu_s": round(_median(loaded_cpu_rates)),
        },
        "auth": {
            "check_us": round(check_us, 2),
            "http_requests_per_s": {
                "auth_off": round(_median(http_off)),
                "auth_on": round(_median(http_on)),
                "ratio_on_off": round(_median(http_on) / _median(http_off), 3),
            },
            "cpu_share_at_10k_transfers_per_s": round(10_000 * check_us / 1e6, 4),
            "note": "the relay's transfers/s does not pass through HTTP: auth cannot lower it",
        },
        "runs": args.runs,
        "transfers_per_run": args.transfers,
        "all_transfers_per_s": [round(r) for r in rates],
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "cpu_cores": os.cpu_count(),
        "decode_workers": args.decode,
        "executor": "immediate (no bytes moved; control plane only)",
        "targets": {"transfers_per_s": 10_000, "overhead_p50_us": 100},
        "meets_targets": rate >= 10_000 and p50 <= 100,
        "meets_targets_per_cpu_s": cpu_rate >= 10_000 and p50 <= 100,
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>24}: {value}")


if __name__ == "__main__":
    main()
