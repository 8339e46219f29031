"""Fault injection against a real relay, and the accounting that proves nothing was lost.

:func:`run_chaos` builds a local cluster, runs N transfers through the orchestrator, and
injects faults. The workers are always :class:`~topkv.service.worker.service.WorkerService`s,
driven by one :class:`~topkv.service.orchestrator.executor.RemoteExecutor` over their control
APIs, with the orchestrator in this process; only where the workers run differs
(``ChaosConfig.mode``):

* ``processes`` (the default): real ``topkv worker`` processes
  (:class:`~topkv.service.cluster.local.LocalCluster`) that register over this process's
  registration endpoints (:class:`~topkv.service.orchestrator.registrations.RegistrationServer`);
* ``inprocess``: the same workers started in this event loop and registered straight into
  the orchestrator's registry (:mod:`topkv.harness.chaos_inprocess`), still moving their
  KV over real shared memory and TCP on loopback.

Faults (the same in both modes, injected inside the workers by
:class:`~topkv.service.worker.service.WorkerFaults`; see
:func:`~topkv.harness.chaos_config.placements`):

* **bit flips in frames**: a :class:`CorruptingSource` flips one bit of one tensor of a
  transfer with probability ``corrupt_rate`` *after* the per-tensor CRC-64 was taken, so
  the frame leaves with its original CRC and corrupted bytes (what a flipped bit on the
  wire looks like to the receiver);
* **a decode worker killed mid-run** after ``kill_decoder_after`` delivered transfers,
  while a transfer to it runs: SIGKILL of its process (``processes``), or
  :meth:`WorkerService.kill` (``inprocess``: its control API and sinks close and its copies
  are lost); in both the supervisor removes its registration at once, and the orchestrator
  abandons and reroutes the transfers in flight to it;
* **a slowed link**: every send of the last prefill worker is paced to ``slow_link_gbps``
  (:class:`~topkv.transport.emulated.EmulatedSource` over the real medium).

Accounting: each request's KV digest (over the CRC-64s of its bytes) is taken by the
prefill worker that produced it; every delivered copy is checked against the decode
worker's digest of the bytes it holds. ``stranded_after`` counts what is still held after
the run: KV held, being received or being sent by every live worker (source KV and
destination copies), active transfer records, decode slots, named ``/dev/shm`` segments of
the cluster's processes (before and after the workers stop), and registry entries of the
killed worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Literal, Protocol

from topkv.errors import TopKVError
from topkv.harness.chaos_config import REPORT_KEYS, ChaosConfig, ChaosReport, placements
from topkv.harness.chaos_inprocess import InProcessWorkers
from topkv.relay.executor import AttemptFailed, AttemptPlan, Delivery
from topkv.relay.orchestrator import Orchestrator
from topkv.relay.registry.memory import MemoryRegistry
from topkv.relay.transfers import Outcome
from topkv.relay.workers import WorkerInfo
from topkv.service.cluster.local import ClusterConfig, LocalCluster
from topkv.service.cluster.tokens import ClusterTokens
from topkv.service.errors import ClusterError
from topkv.service.messages import LayoutModel, PrefillRequest
from topkv.service.orchestrator.client import http_json
from topkv.service.orchestrator.executor import RemoteExecutor
from topkv.service.orchestrator.registrations import RegistrationServer
from topkv.transport.shm import segments_of

if TYPE_CHECKING:
    from topkv.service.cluster.local import ManagedProcess

__all__ = ["REPORT_KEYS", "ChaosConfig", "ChaosReport", "ChaosWorkers", "run_chaos"]


async def run_chaos(config: ChaosConfig) -> ChaosReport:
    """Run the chaos scenario (in ``config.mode``) and return its accounting."""
    workers: ChaosWorkers = (
        ProcessWorkers(config) if config.mode == "processes" else InProcessWorkers(config)
    )
    return await _run(config, workers)


class ChaosWorkers(Protocol):
    """Where a chaos run's workers live: processes, or this event loop."""

    #: the admin token the workers' control APIs accept (the run's executor sends it)
    admin_token: str | None

    async def start(self, registry: MemoryRegistry) -> list[str]:
        """Start the workers of :func:`placements`, which register in ``registry``;
        returns the decode workers' ids in placement order."""
        ...

    def kill(self, worker_id: str) -> None:
        """Crash ``worker_id`` now, without awaiting: it is out of the registry when this
        returns (its teardown may end later; :meth:`stop` waits for it)."""
        ...

    def pids(self) -> list[int]:
        """The worker processes besides this one (their ``/dev/shm`` segments count)."""
        ...

    async def stop(self) -> None:
        """Stop every worker (they deregister) and whatever was started for them."""
        ...


class ProcessWorkers:
    """``topkv worker`` processes under a :class:`LocalCluster`, registering over HTTP here."""

    def __init__(self, config: ChaosConfig) -> None:
        self.config = config
        self.cluster = LocalCluster(
            ClusterConfig(
                prefill=config.prefill_workers,
                decode=config.decode_workers,
                capacity=config.worker_capacity(),
                ttl_s=5.0,
            ),
            config.run_dir,
        )
        if config.admin_token is not None:
            self.cluster.tokens = ClusterTokens(admin=config.admin_token)
        self.api: RegistrationServer | None = None
        self.processes: dict[str, ManagedProcess] = {}
        self.admin_token = self.cluster.admin_token()

    async def start(self, registry: MemoryRegistry) -> list[str]:
        self.api = RegistrationServer(registry, self.cluster.server_auth())
        self.cluster.orchestrator_url = await self.api.start()
        started = [self.cluster.start_worker(p, i) for i, p in enumerate(placements(self.config))]
        for process in started:
            await asyncio.to_thread(self.cluster.supervisor.wait_ready, process)
            self.processes[str(process.ready["worker_id"])] = process
        return [wid for wid, p in self.processes.items() if p.ready.get("role") == "decode"]

    def kill(self, worker_id: str) -> None:
        assert self.api is not None
        self.cluster.supervisor.kill(self.processes[worker_id])  # SIGKILL, then reap
        self.api.forget(worker_id)  # the supervisor saw it die: it leaves at once

    def pids(self) -> list[int]:
        return [p.pid for p in self.cluster.supervisor.processes]

    async def stop(self) -> None:
        try:
            await asyncio.to_thread(self.cluster.stop)  # SIGTERM: workers deregister, exit
        finally:
            if self.api is not None:
                await self.api.close()


class _CountingRemoteExecutor(RemoteExecutor):
    """Counts concurrent attempts (in all, and per destination) on its own, and can hold back
    the copies that land at one worker (:meth:`park`) until it is killed."""

    active = 0
    peak = 0

    def __init__(self, call_timeout_s: float, token: str | None) -> None:
        super().__init__(call_timeout_s=call_timeout_s, token=token)
        self.active_to: dict[str, int] = {}
        self._parked_to: str | None = None
        self._unparked = asyncio.Event()

    def park(self, worker_id: str) -> None:
        """From now on, an attempt to ``worker_id`` that landed a verified copy waits (still
        running) before it reports the delivery, until :meth:`unpark`."""
        self._parked_to = worker_id

    def unpark(self) -> None:
        self._unparked.set()

    async def transfer(self, plan: AttemptPlan) -> Delivery:
        destination = plan.destination.worker_id
        self.active += 1
        self.active_to[destination] = self.active_to.get(destination, 0) + 1
        self.peak = max(self.peak, self.active)
        try:
            delivery = await super().transfer(plan)
            if destination == self._parked_to and not self._unparked.is_set():
                try:
                    await self._unparked.wait()
                except BaseException:  # cancelled while parked: leave nothing behind
                    await asyncio.shield(
                        self.discard_destination(plan.destination, plan.request_id)
                    )
                    raise
            return delivery
        finally:
            self.active -= 1
            self.active_to[destination] -= 1


class _Run:
    """One chaos run (either mode): the driver, the decode stand-in and the accounting."""

    def __init__(self, config: ChaosConfig, workers: ChaosWorkers) -> None:
        self.config = config
        self.workers = workers
        self.layout = config.layout()
        self.report = ChaosReport()
        self.registry = MemoryRegistry()
        self.executor = _CountingRemoteExecutor(call_timeout_s=10.0, token=workers.admin_token)
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
        self.victim_id: str | None = None
        self.all_done = asyncio.Event()

    # -- cluster ---------------------------------------------------------------------------

    async def start_workers(self) -> None:
        decoders = await self.workers.start(self.registry)
        expected = len(placements(self.config))
        deadline = time.monotonic() + 60.0
        while len(self.registry.workers()) < expected:
            if time.monotonic() > deadline:
                raise ClusterError("the chaos workers did not all register within 60 s")
            await asyncio.sleep(0.02)
        if self.config.kill_decoder_after is not None:
            self.victim_id = decoders[0]

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
        """Kill the victim once K were delivered, mid-transfer, holding no untaken KV.

        Mid-transfer: at least one attempt to it is running, so the kill always interrupts
        a transfer. No untaken KV: decode takes each verified copy as it is handed off, so
        the crash cannot destroy a copy decode already owns (no transfer system can save
        that one; the request would be recomputed). Once K were delivered, a copy landing
        at the victim is held back before its handoff (:meth:`_CountingRemoteExecutor.park`:
        its attempt is still running), so the takes under way finish and none start: the
        kill comes as soon as they are done, and the held-back attempts then fail the way
        an acknowledgement lost in a crash fails them (the orchestrator reroutes them).
        """
        kill_after, victim = self.config.kill_decoder_after, self.victim_id
        if victim is None or self.report.killed is not None or kill_after is None:
            return
        if self.report.delivered < kill_after:
            return
        self.executor.park(victim)
        if self.taking.get(victim, 0) or not self.executor.active_to.get(victim, 0):
            return
        # No await from here on: nothing can be handed to the victim in between, and it
        # is out of the registry (and the orchestrator's view) before anything else runs.
        self.workers.kill(victim)
        self.report.killed = victim
        self.executor.unpark()

    # -- accounting ------------------------------------------------------------------------

    async def stranded(self) -> dict[str, int]:
        held = injected = 0
        for info in self.registry.workers():
            url = f"{info.control_url.rstrip('/')}/v1/info"
            payload = await asyncio.to_thread(http_json, "GET", url, token=self.workers.admin_token)
            held += int(payload["held"]) + int(payload["receiving"]) + int(payload["sending"])
            faults = payload.get("faults") or {}
            injected += int(faults.get("corruptions_injected", 0))
        self.report.injected_corruptions = injected
        return {
            "worker_kv": held,
            "active_transfers": self.orch.transfers.active_count,
            "decode_slots": sum(self.orch.slots_used(w.worker_id) for w in self._infos("decode")),
            "registry_entries_of_killed": int(
                self.report.killed is not None and self.registry.get(self.report.killed) is not None
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
        pids = [os.getpid(), *self.workers.pids()]
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


async def _run(config: ChaosConfig, workers: ChaosWorkers) -> ChaosReport:
    started = time.perf_counter()
    run = _Run(config, workers)
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
        await workers.stop()
    detail["shm_segments_after_stop"] = run.shm_segments()
    report.stranded_detail = detail
    report.stranded_after = sum(detail.values())
    report.seconds = time.perf_counter() - started
    return report
