"""The orchestrator over real transports (shm, TCP), real registries, and /metrics over HTTP.

The workers are :class:`~topkv.service.worker.service.WorkerService` instances in the test's event
loop (:class:`~topkv.harness.inprocess_cluster.InProcessCluster`), driven over their control
APIs by a :class:`~topkv.service.orchestrator.executor.RemoteExecutor`.
"""

from __future__ import annotations

import asyncio
import os
import urllib.request
from collections.abc import Iterable, Sequence

from topkv.harness.inprocess_cluster import InProcessCluster, WorkerSpec
from topkv.relay.metrics import serve_metrics
from topkv.relay.orchestrator import Orchestrator
from topkv.relay.orchestrator_config import OrchestratorConfig
from topkv.relay.registry.memory import MemoryRegistry, WorkerRegistry, open_registry
from topkv.relay.transfers import Outcome, TransferState
from topkv.relay.workers import Role, WorkerInfo
from topkv.service.kvstore import synthetic_layers
from topkv.service.messages import LayoutModel, PrefillRequest
from topkv.service.orchestrator.executor import RemoteExecutor
from topkv.service.worker.service import WorkerFaults
from topkv.transport.base import Buffer, KVLayout
from topkv.transport.shm import segments_of
from topkv.wire import crc64

LAYOUT = KVLayout(num_layers=4, seq_len=256, kv_heads=2, head_dim=64)  # 512 KiB


def content_digest(layers: Iterable[Sequence[Buffer]]) -> int:
    """CRC-64 of every byte of a KV cache in layout order (an end-to-end content check)."""
    crc = 0
    for tensors in layers:
        for tensor in tensors:
            crc = crc64(tensor, crc)
    return crc


def _expected(request_id: int) -> int:
    """The content digest of the bytes the synthetic engine produces for ``request_id``."""
    return content_digest(tensors for tensors, _ in synthetic_layers(request_id, "m", LAYOUT))


def _spec(
    worker_id: str,
    role: Role,
    node: str,
    gpu: int,
    host: str = "h",
    faults: WorkerFaults | None = None,
) -> WorkerSpec:
    return WorkerSpec(
        role, node, gpu, worker_id=worker_id, host_id=host, faults=faults or WorkerFaults()
    )


async def _prefill(executor: RemoteExecutor, source: WorkerInfo, request_id: int) -> None:
    """The prefill worker's engine produces request ``request_id``'s KV (and holds it)."""
    body = PrefillRequest(model_id="m", layout=LayoutModel.of(LAYOUT))
    await executor.prefill(source, request_id, body)


def _info(worker_id: str, role: Role, node: str, gpu: int) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, node=node, gpus=(gpu,), host_id="h")


def test_real_bytes_over_shm_and_tcp_with_metrics_scraped_over_http() -> None:
    async def main() -> None:
        registry = MemoryRegistry()
        cluster = InProcessCluster(registry)
        executor = RemoteExecutor(token=cluster.admin_token)
        await cluster.start(
            [
                _spec("p0", "prefill", "n0", 0),
                _spec("d-near", "decode", "n0", 1),
                _spec("d-far", "decode", "n1", 0),
            ]
        )
        orch = Orchestrator(registry, executor)
        server = serve_metrics(orch.metrics)
        try:
            async with orch:
                expected = {}
                for rid, override in [(1, None), (2, "tcp")]:
                    expected[rid] = _expected(rid)
                    await _prefill(executor, cluster.info("p0"), rid)
                    await orch.submit(rid, "m", LAYOUT, "p0", manual_override=override)
                for rid in (1, 2):
                    record = await orch.wait(rid, 10)
                    assert record.state == TransferState.DELIVERED, record.reason
                shm_rec, tcp_rec = orch.transfer(1), orch.transfer(2)
                assert (shm_rec.transport, shm_rec.medium) == ("pcie", "shm")
                assert (tcp_rec.transport, tcp_rec.medium) == ("tcp", "tcp")
                for rid, rec in ((1, shm_rec), (2, tcp_rec)):
                    kv = cluster.take("d-near" if rec.destination == "d-near" else "d-far", rid)
                    assert kv is not None and content_digest(kv.layers) == expected[rid]
                    kv.free()
                    orch.release_decode_slot(rid)
                assert cluster.held("p0") == []
                body = urllib.request.urlopen(server.url, timeout=5).read().decode()
                assert 'topkv_transfers_total{mode="pcie",outcome="delivered"} 1.0' in body
                assert 'topkv_transfers_total{mode="tcp",outcome="delivered"} 1.0' in body
                assert (
                    f'topkv_transfer_bytes_total{{mode="pcie"}} {float(LAYOUT.total_bytes)}' in body
                )
                assert "topkv_handoff_seconds_count 2.0" in body
        finally:
            server.close()
            await executor.close()
            await cluster.stop()
        assert segments_of(os.getpid()) == []

    asyncio.run(main())


def test_killed_destination_mid_transfer_is_rerouted_and_nothing_is_stranded() -> None:
    async def main() -> None:
        registry = MemoryRegistry()
        cluster = InProcessCluster(registry)
        executor = RemoteExecutor(token=cluster.admin_token)
        # ~0.5 s per transfer: long enough to kill the destination mid-way
        slow = WorkerFaults(slow_gbps=0.004)
        await cluster.start(
            [
                _spec("p0", "prefill", "n0", 0, faults=slow),
                _spec("d0", "decode", "n0", 1),
                _spec("d1", "decode", "n0", 2),
            ]
        )
        try:
            async with Orchestrator(registry, executor) as orch:
                await _prefill(executor, cluster.info("p0"), 1)
                record = await orch.submit(1, "m", LAYOUT, "p0")
                while record.state != TransferState.RUNNING:
                    await asyncio.sleep(0.01)
                first = record.destination
                assert first is not None
                await asyncio.sleep(0.1)
                await cluster.kill(first)
                await orch.wait(1, 20)
                assert record.state == TransferState.DELIVERED, record.reason
                assert record.reroutes == 1 and record.destination != first
                alive = "d1" if first == "d0" else "d0"
                kv = cluster.take(alive, 1)
                assert kv is not None and content_digest(kv.layers) == _expected(1)
                kv.free()
                assert cluster.held("p0") == [] and cluster.held(first) == []
        finally:
            await executor.close()
            await cluster.stop()
        assert segments_of(os.getpid()) == []

    asyncio.run(main())


def _view_rebuild(registry: WorkerRegistry) -> None:
    async def main() -> None:
        executor = RemoteExecutor()
        first = registry.register(_info("p0", "prefill", "n0", 0), ttl_s=30)
        async with Orchestrator(registry, executor, config=OrchestratorConfig()) as orch:
            assert orch.view.alive("p0")
            late = registry.register(_info("d0", "decode", "n0", 1), ttl_s=30)
            for _ in range(200):  # etcd watch events arrive on another thread
                if orch.view.alive("d0"):
                    break
                await asyncio.sleep(0.01)
            assert orch.view.alive("d0")
            late.deregister()
            for _ in range(200):
                if not orch.view.alive("d0"):
                    break
                await asyncio.sleep(0.01)
            assert not orch.view.alive("d0")
        # while no orchestrator runs, the cluster changes; a new one sees it all
        again = registry.register(_info("d1", "decode", "n1", 0), ttl_s=30)
        async with Orchestrator(registry, executor) as restarted:
            assert [w.worker_id for w in restarted.view.workers()] == ["d1", "p0"]
        again.deregister()
        first.deregister()
        await executor.close()

    asyncio.run(main())


def test_view_follows_memory_registry_and_rebuilds_after_restart() -> None:
    _view_rebuild(MemoryRegistry())


def test_view_follows_etcd_and_rebuilds_after_restart(etcd_url: str) -> None:
    registry = open_registry(etcd_url + "/orchestrator-test")
    try:
        _view_rebuild(registry)
    finally:
        registry.close()


def test_completion_outcome_for_failed_transfer_names_reason() -> None:
    async def main() -> None:
        registry = MemoryRegistry()
        cluster = InProcessCluster(registry)
        executor = RemoteExecutor(token=cluster.admin_token)
        await cluster.start(
            [
                _spec("p0", "prefill", "n0", 0),
                # a decode worker on another host: shm is impossible, TCP is the only medium
                _spec("d0", "decode", "n0", 1, host="elsewhere"),
            ]
        )
        try:
            async with Orchestrator(registry, executor) as orch:
                await _prefill(executor, cluster.info("p0"), 1)
                record = await orch.submit(1, "m", LAYOUT, "p0")
                await orch.wait(1, 10)
                assert record.state == TransferState.DELIVERED
                assert record.failovers == 1 and record.medium == "tcp"  # shm refused, then TCP
                assert "different hosts" in record.attempts[0].detail
                completion = await orch.next_completion(1)
                assert completion.outcome == Outcome.DELIVERED
                await executor.discard_destination(cluster.info("d0"), 1)
        finally:
            await executor.close()
            await cluster.stop()

    asyncio.run(main())
