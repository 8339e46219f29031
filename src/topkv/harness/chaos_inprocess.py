"""The ``inprocess`` chaos mode: the workers run in this event loop.

They are the same :class:`~topkv.service.worker.service.WorkerService` as ``topkv worker``
(:class:`~topkv.harness.inprocess_cluster.InProcessCluster`), placed as in the processes
mode (:func:`~topkv.harness.chaos_config.placements`), injecting the same
:class:`~topkv.service.worker.service.WorkerFaults`, and moving their KV over real shared memory and
TCP on loopback; the run itself is :func:`topkv.harness.chaos.run_chaos`'s, unchanged. The
killed decode worker leaves the registry at once, so the orchestrator abandons the transfers
in flight to it, and dies like a crashed worker: its control API and sinks close and its
copies are lost (:meth:`InProcessCluster.kill`).
"""

from __future__ import annotations

from topkv.harness.chaos_config import ChaosConfig, placements
from topkv.harness.inprocess_cluster import InProcessCluster, WorkerSpec
from topkv.relay.registry.memory import MemoryRegistry
from topkv.relay.workers import Role
from topkv.service.http.auth import new_token
from topkv.service.worker.service import WorkerFaults

#: Nothing here dies unseen (a killed worker is deregistered at once), so the lease only
#: has to outlast the event loop's longest stall.
LEASE_S = 60.0


class InProcessWorkers:
    """The chaos cluster as :class:`WorkerService` instances in this event loop (a
    :class:`~topkv.harness.chaos.ChaosWorkers`); ``prefill-N`` and ``decode-N`` by role."""

    def __init__(self, config: ChaosConfig) -> None:
        self.config = config
        self.cluster: InProcessCluster | None = None
        self.admin_token: str | None = config.admin_token or new_token()

    async def start(self, registry: MemoryRegistry) -> list[str]:
        self.cluster = InProcessCluster(registry, ttl_s=LEASE_S, admin_token=self.admin_token)
        counts = {"prefill": 0, "decode": 0}
        decoders = []
        for placement in placements(self.config):
            role: Role = "decode" if placement.role == "decode" else "prefill"
            worker_id = f"{role}-{counts[role]}"
            counts[role] += 1
            await self.cluster.start_worker(
                WorkerSpec(
                    role=role,
                    node=placement.node,
                    gpu=placement.gpu,
                    worker_id=worker_id,
                    host_id=placement.host_id or "chaos",
                    capacity=self._capacity(role),
                    faults=placement.faults or WorkerFaults(),
                )
            )
            if role == "decode":
                decoders.append(worker_id)
        return decoders

    def _capacity(self, role: str) -> int:
        """A decode worker offers ``decode_capacity`` slots (so near workers fill up and some
        transfers cross nodes over TCP); a prefill worker holds every request the driver
        may have outstanding."""
        return self.config.decode_capacity if role == "decode" else self.config.worker_capacity()

    def kill(self, worker_id: str) -> None:
        assert self.cluster is not None
        self.cluster.kill(worker_id)  # out of the registry now; it dies in the background

    def pids(self) -> list[int]:
        return []  # every worker is this process

    async def stop(self) -> None:
        if self.cluster is not None:
            await self.cluster.stop()
