"""Fault injection against a real relay, and the accounting that proves nothing was lost.

:func:`run_chaos` builds a local cluster, runs N transfers through the orchestrator, and
injects faults. Two modes (``ChaosConfig.mode``):

* ``processes`` (the default): prefill and decode workers are real ``topkv worker``
  processes (:class:`~topkv.service.cluster.LocalCluster`) with their own transfer
  endpoints, KV stores and control APIs; the orchestrator runs in this process with a
  :class:`~topkv.service.remote_executor.RemoteExecutor` and serves the workers'
  registration endpoints. Faults are injected inside the workers
  (:class:`~topkv.service.worker.WorkerFaults`), a decode worker *process* is SIGKILLed,
  and every delivered KV is checked by digest: the decode worker's digest of the bytes it
  holds against the prefill worker's digest of what it generated.
* ``inprocess``: the workers are objects in this process, still talking over real shared
  memory and TCP on loopback (:mod:`topkv.harness.chaos_inprocess`).

Faults:

* **bit flips in frames**: a :class:`CorruptingSource` flips one bit of one tensor of a
  transfer with probability ``corrupt_rate`` *after* the per-tensor CRC-64 was taken, so
  the frame leaves with its original CRC and corrupted bytes (what a flipped bit on the
  wire looks like to the receiver);
* **a decode worker killed mid-run** after ``kill_decoder_after`` delivered transfers:
  SIGKILL of its process (``processes``; the supervisor reaps it and removes its
  registration at once), or it leaves the registry and its sinks close under the
  transfers in flight to it (``inprocess``);
* **a slowed link**: transfers from one prefill worker to one decode worker are paced to
  ``slow_link_gbps`` (:class:`~topkv.transport.emulated.EmulatedSource` over the real
  medium; in ``processes`` every send of the last prefill worker is paced).

Accounting: every request's content digest (CRC-64 over all its bytes) is taken when its
KV is created; every delivered copy is checked against it at the decode worker.
``stranded_after`` counts what is still held after the run: KV held, being received or
being sent by every live worker (source KV and destination copies), active transfer
records, decode slots, named ``/dev/shm`` segments of the cluster's processes, and
registry entries of the killed worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Literal

from topkv.errors import TopKVError
from topkv.harness.chaos_config import REPORT_KEYS, ChaosConfig, ChaosReport
from topkv.harness.chaos_inprocess import run_inprocess
from topkv.relay.executor import AttemptFailed, AttemptPlan, Delivery
from topkv.relay.orchestrator import Orchestrator
from topkv.relay.registry import MemoryRegistry
from topkv.relay.transfers import Outcome
from topkv.relay.workers import WorkerInfo
from topkv.service.client import http_json
from topkv.service.cluster import ClusterConfig, LocalCluster, WorkerPlacement
from topkv.service.errors import ClusterError
from topkv.service.messages import LayoutModel, PrefillRequest
from topkv.service.registrations import RegistrationServer
from topkv.service.remote_executor import RemoteExecutor
from topkv.service.worker import WorkerFaults
from topkv.transport.shm import segments_of

if TYPE_CHECKING:
    from topkv.service.cluster import ManagedProcess

__all__ = ["REPORT_KEYS", "ChaosConfig", "ChaosReport", "run_chaos"]


async def run_chaos(config: ChaosConfig) -> ChaosReport:
    """Run the chaos scenario (in ``config.mode``) and return its accounting."""
    if config.mode == "processes":
        return await _run_processes(config)
    return await run_inprocess(config)


# -- processes mode --------------------------------------------------------------------------


class _CountingRemoteExecutor(RemoteExecutor):
    """Counts concurrent attempts (in all, and per destination) on its own."""

    active = 0
    peak = 0

    def __init__(self, call_timeout_s: float) -> None:
        super().__init__(call_timeout_s=call_timeout_s)
        self.active_to: dict[str, int] = {}

    async def transfer(self, plan: AttemptPlan) -> Delivery:
        destination = plan.destination.worker_id
        self.active += 1
        self.active_to[destination] = self.active_to.get(destination, 0) + 1
        self.peak = max(self.peak, self.active)
        try:
            return await super().transfer(plan)
        finally:
            self.active -= 1
            self.active_to[destination] -= 1


def _placements(config: ChaosConfig) -> list[WorkerPlacement]:
    """Two nodes on one host: same-node pairs use shm, cross-node pairs TCP."""
    placements = []
    for i in range(config.prefill_workers):
        slowed = config.slow_link_gbps is not None and i == config.prefill_workers - 1
        faults = WorkerFaults(
            corrupt_rate=config.corrupt_rate,
            seed=config.seed * 1000 + i,
            slow_gbps=config.slow_link_gbps if slowed else None,
        )
        placements.append(
            WorkerPlacement("prefill", f"chaos{i % 2}", i // 2, host_id="chaos", faults=faults)
        )
    for i in range(config.decode_workers):
        placements.append(WorkerPlacement("decode", f"chaos{i % 2}", 4 + i // 2, host_id="chaos"))
    return placements


class _ProcessRun:
    """One processes-mode run: the driver, the decode stand-in and the accounting."""

    def __init__(self, config: ChaosConfig, cluster: LocalCluster) -> None:
        self.config = config
        self.cluster = cluster
        self.layout = config.layout()
        self.report = ChaosReport()
        self.registry = MemoryRegistry()
        self.api = RegistrationServer(self.registry)
        self.executor = _CountingRemoteExecutor(call_timeout_s=10.0)
        self.orch = Orchestrator(
            self.registry,
            self.executor,
            config=config.orchestrator_config(),
        )
        # Twice the limit outstanding: the orchestrator's queue, not the driver, bounds
        # how many transfers run at once.
        self.window = asyncio.Semaphore(2 * config.limit)
        self.prefill_digest: dict[int, int] = {}
        self.ended: set[int] = set()
        self.taking: dict[str, int] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.victim: ManagedProcess | None = None
        self.victim_id = ""
        self.all_done = asyncio.Event()

    # -- cluster ---------------------------------------------------------------------------

    async def start_workers(self) -> None:
        self.cluster.orchestrator_url = await self.api.start()
        placements = _placements(self.config)
        processes = [self.cluster.start_worker(p, i) for i, p in enumerate(placements)]
        for process in processes:
            await asyncio.to_thread(self.cluster.supervisor.wait_ready, process)
        deadline = time.monotonic() + 60.0
        while len(self.registry.workers()) < len(placements):
            if time.monotonic() > deadline:
                raise ClusterError("the chaos workers did not all register within 60 s")
            await asyncio.sleep(0.02)
        if self.config.kill_decoder_after is not None:
            decoders = [p for p in processes if p.ready.get("role") == "decode"]
            self.victim = decoders[0]
            self.victim_id = str(decoders[0].ready["worker_id"])

    def _infos(self, role: Literal["prefill", "decode"]) -> list[WorkerInfo]:
        return sorted(self.registry.workers(role), key=lambda w: w.worker_id)

    # -- driver ----------------------------------------------------------------------------

    async def submit_all(self) -> None:
        sources = self._infos("prefill")
        for request_id in range(self.config.transfers):
            await self.window.acquire()
            source = sources[request_id % len(sources)]
            self._spawn(self._submit_one(request_id, source))

    async def _submit_one(self, request_id: int, source: WorkerInfo) -> None:
        self.report.submitted += 1
        body = PrefillRequest(model_id="chaos", layout=LayoutModel.of(self.layout))
        try:
            held = await self.executor.prefill(source, request_id, body)
        except AttemptFailed:
            self._end(request_id)
            self.report.failed_clean += 1  # never prefilled: nothing to transfer or free
            self.window.release()
            return
        self.prefill_digest[request_id] = held.digest
        await self.orch.submit(
            request_id, "chaos", self.layout, source.worker_id, source_digest=held.digest
        )

    def _spawn(self, coro: Coroutine[None, None, None]) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _end(self, request_id: int) -> bool:
        if request_id in self.ended:
            self.report.lost += 1  # a second completion for one request would be a bug
            return False
        self.ended.add(request_id)
        if len(self.ended) == self.config.transfers:
            self.all_done.set()
        return True

    # -- decode stand-in -------------------------------------------------------------------

    async def consume(self) -> None:
        """Take completions as they come; arm the kill after ``kill_decoder_after``."""
        # Polled (not awaited) so a completion is never in transit between the queue and
        # this loop: the kill below sees every delivery to the victim.
        while not self.all_done.is_set():
            drained = self._drain()
            self._maybe_kill()
            if not drained:
                await asyncio.sleep(0.002)

    def _drain(self) -> int:
        count = 0
        while (completion := self.orch.completion_nowait()) is not None:
            count += 1
            if not self._end(completion.request_id):
                continue
            if completion.outcome == Outcome.DELIVERED and completion.destination:
                destination = completion.destination
                self.taking[destination] = self.taking.get(destination, 0) + 1
                self._spawn(self._take(completion.request_id, destination))
            else:
                self.report.failed_clean += 1
                self.window.release()
        return count

    async def _take(self, request_id: int, destination: str) -> None:
        """Decode takes the KV: the worker's digest of its bytes vs the prefill's digest."""
        worker = self.orch.view.get(destination)
        try:
            if worker is None:
                self.report.lost += 1
                return
            try:
                digest = await self.executor.held_digest(worker, request_id)
            except AttemptFailed:
                self.report.lost += 1
                return
            if digest != self.prefill_digest.get(request_id):
                self.report.corrupt_delivered += 1
            self.report.delivered += 1
            self.report.bytes_delivered += self.layout.total_bytes
            await self.executor.discard_destination(worker, request_id)
        finally:
            with contextlib.suppress(TopKVError):
                self.orch.release_decode_slot(request_id)
            self.taking[destination] -= 1
            self.window.release()

    def _maybe_kill(self) -> None:
        """SIGKILL the victim once K were delivered, mid-transfer, holding no untaken KV.

        Mid-transfer: at least one attempt to it is running, so the kill always interrupts
        a transfer. No untaken KV: decode takes each verified copy as it is handed off, so
        the crash cannot destroy a copy decode already owns (no transfer system can save
        that one; the request would be recomputed).
        """
        kill_after = self.config.kill_decoder_after
        if self.victim is None or self.report.killed is not None or kill_after is None:
            return
        if self.report.delivered < kill_after or self.taking.get(self.victim_id, 0):
            return
        if not self.executor.active_to.get(self.victim_id, 0):
            return
        # No await from here on: nothing can be handed to the victim in between.
        self.cluster.supervisor.kill(self.victim)  # SIGKILL, then reap
        self.api.forget(self.victim_id)  # the supervisor saw it die: it leaves at once
        self.report.killed = self.victim_id

    # -- accounting ------------------------------------------------------------------------

    async def stranded(self) -> dict[str, int]:
        held = injected = 0
        for info in self.registry.workers():
            url = f"{info.control_url.rstrip('/')}/v1/info"
            payload = await asyncio.to_thread(http_json, "GET", url)
            held += int(payload["held"]) + int(payload["receiving"]) + int(payload["sending"])
            faults = payload.get("faults") or {}
            injected += int(faults.get("corruptions_injected", 0))
        self.report.injected_corruptions = injected
        return {
            "worker_kv": held,
            "active_transfers": self.orch.transfers.active_count,
            "decode_slots": sum(self.orch.slots_used(w.worker_id) for w in self._infos("decode")),
            "registry_entries_of_killed": int(
                self.report.killed is not None and self.registry.get(self.victim_id) is not None
            ),
            "shm_segments": self.shm_segments(),
        }

    async def settled_stranded(self, settle_s: float = 10.0) -> dict[str, int]:
        """What is still held once asynchronous releases had ``settle_s`` to finish.

        Right after the last request ends, a cancelled attempt may still be unwinding on a
        worker (its send or receive is torn down asynchronously). Such a resource is not
        stranded; one still held after the settle window is, and is reported.
        """
        deadline = time.perf_counter() + settle_s
        detail = await self.stranded()
        while sum(detail.values()) and time.perf_counter() < deadline:
            await asyncio.sleep(0.2)
            detail = await self.stranded()
        return detail

    def shm_segments(self) -> int:
        pids = [os.getpid(), *(p.pid for p in self.cluster.supervisor.processes)]
        return sum(len(segments_of(pid)) for pid in pids)

    def tally(self) -> None:
        report, m = self.report, self.orch.metrics
        report.max_in_flight = max(self.orch.max_in_flight_seen, self.executor.peak)
        report.corrupt_detected = int(m.value("topkv_checksum_failures_total"))
        report.retries = int(m.value("topkv_transfer_retries_total"))
        report.failovers = int(m.value("topkv_transfer_failovers_total"))
        for request_id in range(self.config.transfers):
            record = self.orch.transfers.get(request_id)
            if record is None:
                continue
            report.rerouted += int(record.reroutes > 0)
            if record.outcome == Outcome.DELIVERED:
                report.by_medium[record.medium] = report.by_medium.get(record.medium, 0) + 1


async def _run_processes(config: ChaosConfig) -> ChaosReport:
    started = time.perf_counter()
    cluster = LocalCluster(
        ClusterConfig(
            prefill=config.prefill_workers,
            decode=config.decode_workers,
            capacity=max(2 * config.limit, config.decode_capacity),
            ttl_s=5.0,
        ),
        config.run_dir,
    )
    run = _ProcessRun(config, cluster)
    report = run.report
    try:
        await run.start_workers()
        async with run.orch:
            consumer = asyncio.create_task(run.consume())
            await run.submit_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run.all_done.wait(), config.run_timeout_s)
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer
            if run.tasks:
                await asyncio.wait(set(run.tasks), timeout=60.0)
            report.lost += config.transfers - len(run.ended)
            run.tally()
            detail = await run.settled_stranded()
        await run.executor.close()
    finally:
        await asyncio.to_thread(cluster.stop)  # SIGTERM: workers deregister here, then exit
        await run.api.close()
    detail["shm_segments_after_stop"] = run.shm_segments()
    report.stranded_detail = detail
    report.stranded_after = sum(detail.values())
    report.seconds = time.perf_counter() - started
    return report
