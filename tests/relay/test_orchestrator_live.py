"""The orchestrator over real transports (shm, TCP), real registries, and /metrics over HTTP."""

from __future__ import annotations

import asyncio
import os
import urllib.request

from topkv.relay.inprocess import (
    DecodeWorker,
    InProcessExecutor,
    PrefillWorker,
    content_digest,
    new_secret,
)
from topkv.relay.metrics import serve_metrics
from topkv.relay.orchestrator import Orchestrator
from topkv.relay.orchestrator_config import OrchestratorConfig
from topkv.relay.registry import MemoryRegistry, WorkerRegistry, open_registry
from topkv.relay.transfers import Outcome, TransferState
from topkv.relay.workers import WorkerInfo
from topkv.transport.base import KVLayout, TransferSource, TransportMode
from topkv.transport.emulated import EmulatedSource, LinkModel
from topkv.transport.shm import segments_of

LAYOUT = KVLayout(num_layers=4, seq_len=256, kv_heads=2, head_dim=64)  # 512 KiB


def _kv(seed: int) -> list[tuple[bytes, bytes]]:
    rnd = os.urandom(LAYOUT.tensor_bytes * 2 * LAYOUT.num_layers)
    size = LAYOUT.tensor_bytes
    return [
        (rnd[(2 * i) * size : (2 * i + 1) * size], rnd[(2 * i + 1) * size : (2 * i + 2) * size])
        for i in range(LAYOUT.num_layers)
    ]


def _info(worker_id: str, role: str, node: str, gpu: int, host: str = "h") -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, node=node, gpus=(gpu,), host_id=host)  # type: ignore[arg-type]


def test_real_bytes_over_shm_and_tcp_with_metrics_scraped_over_http() -> None:
    async def main() -> None:
        registry = MemoryRegistry()
        secret = new_secret()
        prefill = PrefillWorker(_info("p0", "prefill", "n0", 0), secret)
        near = DecodeWorker(_info("d-near", "decode", "n0", 1), secret)
        far = DecodeWorker(_info("d-far", "decode", "n1", 0), secret)
        executor = InProcessExecutor([prefill, near, far])
        for worker in (prefill, near, far):
            worker.register(registry)
        orch = Orchestrator(registry, executor)
        server = serve_metrics(orch.metrics)
        try:
            async with orch:
                expected = {}
                for rid, override in [(1, None), (2, "tcp")]:
                    layers = _kv(rid)
                    expected[rid] = content_digest(layers)
                    prefill.hold(rid, "m", LAYOUT, layers)
                    await orch.submit(rid, "m", LAYOUT, "p0", manual_override=override)
                for rid in (1, 2):
                    record = await orch.wait(rid, 10)
                    assert record.state == TransferState.DELIVERED, record.reason
                shm_rec, tcp_rec = orch.transfer(1), orch.transfer(2)
                assert (shm_rec.transport, shm_rec.medium) == ("pcie", "shm")
                assert (tcp_rec.transport, tcp_rec.medium) == ("tcp", "tcp")
                for rid, rec in ((1, shm_rec), (2, tcp_rec)):
                    kv = (near if rec.destination == "d-near" else far).take(rid)
                    assert kv is not None and content_digest(kv.layers) == expected[rid]
                    kv.release()
                    orch.release_decode_slot(rid)
                assert prefill.held() == []
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
        assert segments_of(os.getpid()) == []

    asyncio.run(main())


def test_killed_destination_mid_transfer_is_rerouted_and_nothing_is_stranded() -> None:
    async def main() -> None:
        registry = MemoryRegistry()
        secret = new_secret()

        def slow(medium: str, source: TransferSource) -> TransferSource:
            # ~0.5 s per transfer: long enough to kill the destination mid-way
            return EmulatedSource(source, LinkModel(TransportMode(source.mode), 0.004, 0.0))

        prefill = PrefillWorker(_info("p0", "prefill", "n0", 0), secret, slow)
        victim = DecodeWorker(_info("d0", "decode", "n0", 1), secret)
        spare = DecodeWorker(_info("d1", "decode", "n0", 2), secret)
        executor = InProcessExecutor([prefill, victim, spare])
        for worker in (prefill, victim, spare):
            worker.register(registry)
        async with Orchestrator(registry, executor) as orch:
            layers = _kv(1)
            prefill.hold(1, "m", LAYOUT, layers)
            record = await orch.submit(1, "m", LAYOUT, "p0")
            while record.state != TransferState.RUNNING:
                await asyncio.sleep(0.01)
            first = record.destination
            dead = victim if first == "d0" else spare
            await asyncio.sleep(0.1)
            dead.kill()
            await orch.wait(1, 20)
            assert record.state == TransferState.DELIVERED, record.reason
            assert record.reroutes == 1 and record.destination != first
            alive = spare if dead is victim else victim
            kv = alive.take(1)
            assert kv is not None and content_digest(kv.layers) == content_digest(layers)
            kv.release()
            assert prefill.held() == [] and dead.held() == []
        await executor.close()
        assert segments_of(os.getpid()) == []

    asyncio.run(main())


def _view_rebuild(registry: WorkerRegistry) -> None:
    async def main() -> None:
        executor = InProcessExecutor()
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
        secret = new_secret()
        prefill = PrefillWorker(_info("p0", "prefill", "n0", 0), secret)
        # a decode worker on another host: shm is impossible, TCP is the only medium
        other = DecodeWorker(_info("d0", "decode", "n0", 1, host="elsewhere"), secret)
        executor = InProcessExecutor([prefill, other])
        for worker in (prefill, other):
            worker.register(registry)
        async with Orchestrator(registry, executor) as orch:
            prefill.hold(1, "m", LAYOUT, _kv(1))
            record = await orch.submit(1, "m", LAYOUT, "p0")
            await orch.wait(1, 10)
            assert record.state == TransferState.DELIVERED
            assert record.failovers == 1 and record.medium == "tcp"  # shm refused, then TCP
            assert "different hosts" in record.attempts[0].detail
            completion = await orch.next_completion(1)
            assert completion.outcome == Outcome.DELIVERED
            other.discard(1)
        await executor.close()

    asyncio.run(main())
