"""The ``inprocess`` chaos mode: workers are objects in this process.

They still talk over real shared memory and TCP on loopback; a :class:`CorruptingSource`
wraps every source, the last prefill worker's sends are paced, and a decode worker leaves
the registry with its sinks closing under the transfers in flight to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time

from topkv.harness.chaos_config import ChaosConfig, ChaosReport
from topkv.relay.executor import AttemptPlan, Delivery
from topkv.relay.inprocess import (
    DecodeWorker,
    InProcessExecutor,
    PrefillWorker,
    SourceWrapper,
    content_digest,
    new_secret,
)
from topkv.relay.orchestrator import Orchestrator
from topkv.relay.registry import MemoryRegistry
from topkv.relay.transfers import Outcome
from topkv.relay.workers import WorkerInfo
from topkv.transport.base import KVLayout, TransferSource, TransportMode
from topkv.transport.emulated import EmulatedSource, LinkModel
from topkv.transport.faults import CorruptingSource
from topkv.transport.shm import segments_of


class _CountingExecutor(InProcessExecutor):
    """Counts concurrent attempts independently of the orchestrator's own bookkeeping."""

    active = 0
    peak = 0

    async def transfer(self, plan: AttemptPlan) -> Delivery:
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            return await super().transfer(plan)
        finally:
            self.active -= 1


class _Cluster:
    def __init__(self, config: ChaosConfig) -> None:
        self.config = config
        self.registry = MemoryRegistry()
        secret = new_secret()
        self.corrupters: list[CorruptingSource] = []
        self.prefill: list[PrefillWorker] = []
        self.decode: list[DecodeWorker] = []
        nodes = 2
        for i in range(config.decode_workers):
            info = WorkerInfo(
                worker_id=f"decode-{i}",
                role="decode",
                node=f"node{i % nodes}",
                host_id="chaos-host",
                gpus=(4 + i // nodes,),
                capacity=config.decode_capacity,
            )
            self.decode.append(DecodeWorker(info, secret))
        for i in range(config.prefill_workers):
            info = WorkerInfo(
                worker_id=f"prefill-{i}",
                role="prefill",
                node=f"node{i % nodes}",
                host_id="chaos-host",
                gpus=(i // nodes,),
            )
            self.prefill.append(PrefillWorker(info, secret, self._wrapper(i)))
        self.executor = _CountingExecutor([*self.prefill, *self.decode])
        for worker in [*self.prefill, *self.decode]:
            worker.register(self.registry, ttl_s=3600)

    def _wrapper(self, index: int) -> SourceWrapper:
        config = self.config
        slowed = index == config.prefill_workers - 1

        def wrap(medium: str, source: TransferSource) -> TransferSource:
            if config.slow_link_gbps is not None and slowed:
                link = LinkModel(TransportMode(source.mode), config.slow_link_gbps, 50e-6)
                source = EmulatedSource(source, link)
            corrupter = CorruptingSource(source, config.corrupt_rate, config.seed * 1000 + index)
            self.corrupters.append(corrupter)
            return corrupter

        return wrap


def _stamped(base: bytes, request_id: int, layout: KVLayout) -> list[tuple[bytearray, ...]]:
    stamp = request_id.to_bytes(8, "little")
    layers = []
    for layer in range(layout.num_layers):
        tensors = []
        for t in range(layout.tensors_per_layer):
            buf = bytearray(base)
            buf[:8] = stamp
            buf[8:16] = (layer * 2 + t).to_bytes(8, "little")
            tensors.append(buf)
        layers.append(tuple(tensors))
    return layers


async def run_inprocess(config: ChaosConfig) -> ChaosReport:
    cluster = _Cluster(config)
    layout = config.layout()
    base = random.Random(config.seed).randbytes(layout.tensor_bytes)
    report = ChaosReport()
    expected: dict[int, int] = {}
    orch = Orchestrator(cluster.registry, cluster.executor, config=config.orchestrator_config())
    by_id = {w.info.worker_id: w for w in cluster.decode}
    victim = cluster.decode[0] if config.kill_decoder_after is not None else None
    started = time.perf_counter()
    ended: set[int] = set()
    delivered_ok = 0

    def account(completion_outcome: Outcome, request_id: int, destination: str | None) -> None:
        nonlocal delivered_ok
        if request_id in ended:
            report.lost += 1  # a second completion for one request would be a bug
            return
        ended.add(request_id)
        if completion_outcome == Outcome.DELIVERED:
            worker = by_id.get(destination or "")
            kv = worker.take(request_id) if worker is not None else None
            orch.release_decode_slot(request_id)
            if kv is None:
                report.lost += 1
                return
            if content_digest(kv.layers) != expected[request_id]:
                report.corrupt_delivered += 1
            kv.release()
            report.delivered += 1
            delivered_ok += 1
        else:
            report.failed_clean += 1

    async def consume() -> None:
        killed = False
        while len(ended) < config.transfers:
            completion = await orch.next_completion(config.run_timeout_s)
            account(completion.outcome, completion.request_id, completion.destination)
            if (
                victim is not None
                and not killed
                and delivered_ok >= (config.kill_decoder_after or 0)
            ):
                # Decode takes each verified copy at once: drain what is waiting, then die.
                while (waiting := orch.completion_nowait()) is not None:
                    account(waiting.outcome, waiting.request_id, waiting.destination)
                victim.kill()
                report.killed = victim.info.worker_id
                killed = True

    async with orch:
        consumer = asyncio.create_task(consume())
        for request_id in range(config.transfers):
            worker = cluster.prefill[request_id % len(cluster.prefill)]
            layers = _stamped(base, request_id, layout)
            expected[request_id] = content_digest(layers)
            digest = worker.hold(request_id, "chaos", layout, layers)
            await orch.submit(
                request_id, "chaos", layout, worker.info.worker_id, source_digest=digest
            )
            report.submitted += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(consumer, config.run_timeout_s)
        report.lost += config.transfers - len(ended)
        report.max_in_flight = max(orch.max_in_flight_seen, cluster.executor.peak)
        m = orch.metrics
        report.corrupt_detected = int(m.value("topkv_checksum_failures_total"))
        report.retries = int(m.value("topkv_transfer_retries_total"))
        report.failovers = int(m.value("topkv_transfer_failovers_total"))
        records = [orch.transfers.get(i) for i in range(config.transfers)]
        report.rerouted = sum(1 for r in records if r is not None and r.reroutes > 0)
        for r in records:
            if r is not None and r.outcome == Outcome.DELIVERED:
                report.by_medium[r.medium] = report.by_medium.get(r.medium, 0) + 1
                report.bytes_delivered += r.size_bytes
        report.injected_corruptions = sum(c.injected for c in cluster.corrupters)
        detail = {
            "source_kv": sum(len(w.held()) for w in cluster.prefill),
            "destination_kv": sum(len(w.held()) for w in cluster.decode),
            "active_transfers": orch.transfers.active_count,
            "decode_slots": sum(orch.slots_used(w.info.worker_id) for w in cluster.decode),
            "registry_entries_of_killed": int(
                victim is not None
                and report.killed is not None
                and cluster.registry.get(victim.info.worker_id) is not None
            ),
        }
    await cluster.executor.close()
    detail["shm_segments"] = len(segments_of(os.getpid()))
    report.stranded_detail = detail
    report.stranded_after = sum(detail.values())
    report.seconds = time.perf_counter() - started
    return report
