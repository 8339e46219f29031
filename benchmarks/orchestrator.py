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

Targets (issue #5): >= 10,000 transfers/s and p50 <= 100 us.

Run: ``.venv/bin/python benchmarks/orchestrator.py [--transfers N] [--decode M]``
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
from topkv.relay.orchestrator import Orchestrator, OrchestratorConfig
from topkv.relay.registry import MemoryRegistry
from topkv.relay.workers import WorkerInfo
from topkv.transport.base import KVLayout

LAYOUT = KVLayout(num_layers=1, seq_len=1, kv_heads=1, head_dim=8)  # 32 bytes
DIGEST = 0


class ImmediateExecutor:
    """Completes every attempt at once without moving bytes (control-plane cost only)."""

    async def source_digest(self, source: WorkerInfo, request_id: int, layout: KVLayout) -> int:
        return DIGEST

    async def transfer(self, plan: AttemptPlan) -> Delivery:
        return Delivery(
            plan.request_id, plan.destination.worker_id, plan.transport, "none", 32, 1e-6, DIGEST
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


async def throughput(transfers: int, decode: int) -> tuple[float, float]:
    orch = Orchestrator(_registry(decode), ImmediateExecutor(), config=OrchestratorConfig())
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transfers", type=int, default=50_000)
    parser.add_argument("--samples", type=int, default=5_000)
    parser.add_argument("--decode", type=int, default=4, help="decode workers to route among")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    gc.collect()
    rate, cpu_rate = asyncio.run(throughput(args.transfers, args.decode))
    lat = sorted(asyncio.run(overhead(args.samples, args.decode)))
    p50 = statistics.median(lat) * 1e6
    p99 = lat[int(len(lat) * 0.99) - 1] * 1e6
    result = {
        "transfers_per_s": round(rate),
        "transfers_per_cpu_s": round(cpu_rate),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "overhead_p50_us": round(p50, 1),
        "overhead_p99_us": round(p99, 1),
        "decode_workers": args.decode,
        "executor": "immediate (no bytes moved; control plane only)",
        "targets": {"transfers_per_s": 10_000, "overhead_p50_us": 100},
        "meets_targets": rate >= 10_000 and p50 <= 100,
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>18}: {value}")


if __name__ == "__main__":
    main()
