"""The demo's cluster: ``topkv worker --engine hf`` processes placed on the emulated GPUs.

Each :class:`~topkv.demo.topology.Placement` becomes one real worker process (the same
``topkv worker`` a deployment runs) serving the demo model, offering tcp and shm, and
advertising its emulated GPU (node, NVLink domain, RDMA) in the registration it sends to
the demo's embedded registry
(:class:`~topkv.service.orchestrator.registrations.RegistrationServer`).
The processes run under one :class:`~topkv.service.cluster.local.Supervisor`: they die with the
demo (parent-death signal) and :meth:`DemoWorkers.stop` stops every one, also on errors and
Ctrl-C.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from topkv.demo.errors import DemoError, WorkerFailed
from topkv.demo.topology import Placement, worker_info
from topkv.relay.registry.memory import MemoryRegistry
from topkv.relay.workers import WorkerInfo
from topkv.service.cluster.local import ClusterConfig, LocalCluster, ManagedProcess, WorkerPlacement
from topkv.service.compute.engines import EngineSpec
from topkv.service.errors import ClusterError
from topkv.service.orchestrator.registrations import RegistrationServer
from topkv.service.tiers.config import TierConfig
from topkv.topology.model import Cluster

#: A worker's lease in the demo's registry: long, since the demo watches its processes.
LEASE_S = 60.0
#: Loading torch and the model in four processes on two cores takes a while.
STARTUP_TIMEOUT_S = 180.0
#: The real media every demo worker offers (emulated paths ride on them).
MEDIA = ("tcp", "shm")


def check_shared_clock() -> None:
    """Refuse to run where ``perf_counter`` is not one system-wide monotonic clock."""
    info = time.get_clock_info("perf_counter")
    if "CLOCK_MONOTONIC" not in info.implementation:
        raise DemoError(
            f"time.perf_counter is {info.implementation}, not CLOCK_MONOTONIC: timestamps "
            "of different processes would not be comparable (the demo needs Linux)"
        )


class DemoWorkers:
    """The worker processes of one demo run and the registry they register in."""

    def __init__(
        self,
        placements: Sequence[Placement],
        topology: Cluster,
        engine: EngineSpec,
        *,
        decode_capacity: int,
        prefill_capacity: int,
        run_dir: Path | None = None,
        tiers: TierConfig | None = None,
    ) -> None:
        check_shared_clock()
        self.placements = list(placements)
        self.registry = MemoryRegistry()
        self.cluster = LocalCluster(
            ClusterConfig(
                prefill=0,
                decode=0,
                ttl_s=LEASE_S,
                media=MEDIA,
                engine=engine,
                placements=[
                    _placement(p, topology, decode_capacity, prefill_capacity, tiers)
                    for p in self.placements
                ],
            ),
            run_dir,
        )
        self.cluster.supervisor.ready_timeout_s = STARTUP_TIMEOUT_S
        self._api: RegistrationServer | None = None
        self.processes: dict[str, ManagedProcess] = {}
        self.ready: dict[str, dict[str, Any]] = {}

    async def start(self) -> dict[str, WorkerInfo]:
        """Start every worker; their registrations, by worker id, once all registered."""
        self._api = RegistrationServer(self.registry, self.cluster.server_auth())
        self.cluster.orchestrator_url = await self._api.start()
        placements = self.cluster.config.worker_placements()
        started = [self.cluster.start_worker(p, i) for i, p in enumerate(placements)]
        try:
            for placement, process in zip(placements, started, strict=True):
                ready = await asyncio.to_thread(self.cluster.supervisor.wait_ready, process)
                self.processes[placement.worker_id] = process
                self.ready[placement.worker_id] = ready
        except ClusterError as exc:
            raise WorkerFailed(f"a demo worker did not start: {exc}") from None
        infos = {w.worker_id: w for w in self.registry.workers()}
        missing = sorted(set(self.processes) - set(infos))
        if missing:
            raise WorkerFailed(f"workers {', '.join(missing)} did not register")
        return infos

    def check_alive(self) -> None:
        """Raise :class:`WorkerFailed` (with its log) if a worker process died."""
        for worker_id, process in self.processes.items():
            if not process.alive():
                raise WorkerFailed(
                    f"worker {worker_id} exited with status {process.popen.returncode}; its "
                    f"log ends:\n{process.log_tail()}"
                )

    def pids(self) -> dict[str, int]:
        return {worker_id: p.pid for worker_id, p in self.processes.items()}

    async def stop(self) -> None:
        try:
            await asyncio.to_thread(self.cluster.stop)  # SIGTERM, then SIGKILL: no orphans
        finally:
            if self._api is not None:
                await self._api.close()


def _placement(
    placement: Placement,
    topology: Cluster,
    decode_capacity: int,
    prefill_capacity: int,
    tiers: TierConfig | None,
) -> WorkerPlacement:
    """What ``topkv worker`` is told about its emulated GPU (the registry record the demo's
    topology gives it, :func:`~topkv.demo.topology.worker_info`); ``tiers``: the decode
    workers' KV tiers."""
    capacity = decode_capacity if placement.role == "decode" else prefill_capacity
    info = worker_info(placement, topology, capacity=capacity)
    return WorkerPlacement(
        role=placement.role,
        node=placement.node,
        gpu=placement.gpu,
        worker_id=placement.worker_id,
        capacity=capacity,
        nvlink_domain=info.nvlink_domain,
        nvlink=info.capabilities.nvlink,
        rdma=info.capabilities.rdma,
        tiers=_own_tiers(tiers, placement.worker_id) if placement.role == "decode" else None,
    )


def _own_tiers(tiers: TierConfig | None, worker_id: str) -> TierConfig | None:
    """``tiers`` with a disk directory of the worker's own (created here)."""
    if tiers is None or tiers.disk_dir is None:
        return tiers
    own = tiers.disk_dir / worker_id
    own.mkdir(parents=True, exist_ok=True)
    return replace(tiers, disk_dir=own)
