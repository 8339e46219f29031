"""MoE routing live: real workers running a seeded MoE model report their experts in their
heartbeats; the orchestrator's MoE router moves decode off a worker whose experts are made
slow (where plain routing stays), and takes it back once it recovers."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_models import TINY
from topkv.harness.inprocess_cluster import InProcessCluster, WorkerSpec
from topkv.policy.route import DecodeWorkerView, RoutingPolicy
from topkv.policy.view import TransferRequest
from topkv.relay.moe.experts import ExpertRegistry
from topkv.relay.orchestrator import Orchestrator
from topkv.relay.pairs import PairViewCache, endpoint_of
from topkv.relay.registry.memory import MemoryRegistry
from topkv.relay.transfers import TransferState
from topkv.relay.workers import Role
from topkv.service.compute.engines import EngineSpec, HfEngine
from topkv.service.messages import GenerateRequest, LayoutModel, PrefillRequest
from topkv.service.orchestrator.executor import RemoteExecutor
from topkv.transport.base import KVLayout

pytestmark = pytest.mark.model

MOE = EngineSpec(kind="hf", demo_seed=0, demo_config=TINY, demo_experts=8, torch_threads=1)
LAYOUT = KVLayout(num_layers=2, seq_len=64, kv_heads=2, head_dim=16)
TTL_S = 1.5  # heartbeats every 0.5 s
DECODERS = ("d-near", "d-far")


def _spec(
    wid: str, role: Role, node: str, gpu: int, engine: EngineSpec = EngineSpec()
) -> WorkerSpec:
    return WorkerSpec(
        role,
        node,
        gpu,
        worker_id=wid,
        host_id="h",
        engine=engine,
        nvlink_domain=f"{node}/nvl",
    )


def test_moe_router_avoids_a_straggler_and_takes_it_back() -> None:
    async def main() -> None:
        registry = MemoryRegistry()
        cluster = InProcessCluster(registry, ttl_s=TTL_S)
        executor = RemoteExecutor(token=cluster.admin_token)
        await cluster.start(
            [
                _spec("p0", "prefill", "n0", 0),
                _spec("d-near", "decode", "n0", 1, MOE),
                _spec("d-far", "decode", "n1", 0, MOE),
            ]
        )
        near = cluster.workers["d-near"].engine
        assert isinstance(near, HfEngine) and near.experts is not None
        orch = Orchestrator(registry, executor)
        pairs = PairViewCache()
        rid = iter(range(1, 1000))

        async def traffic(worker: str, rounds: int = 2) -> None:
            for _ in range(rounds):
                body = GenerateRequest(prompt_seed=1, prompt_tokens=24, max_new_tokens=4)
                await executor.generate(cluster.info(worker), body)

        async def routed() -> str:
            r = next(rid)
            await executor.prefill(
                cluster.info("p0"), r, PrefillRequest(model_id="m", layout=LayoutModel.of(LAYOUT))
            )
            await orch.submit(r, "m", LAYOUT, "p0")
            record = await orch.wait(r, 20)
            assert record.state == TransferState.DELIVERED, record.reason
            kv = cluster.take(record.destination or "", r)
            assert kv is not None
            kv.free()
            orch.release_decode_slot(r)
            return record.destination or ""

        async def reported_since_now() -> None:
            """Wait until both decode workers sent a report taken after this moment."""
            seen = {w: _sequence(orch, w) for w in DECODERS}
            await wait_for(lambda: all(_sequence(orch, w) > seen[w] + 1 for w in DECODERS))

        async def wait_for(check, timeout_s: float = 20.0) -> float:  # type: ignore[no-untyped-def]
            start = time.monotonic()
            while not check():
                assert time.monotonic() - start < timeout_s, "condition not reached in time"
                await asyncio.sleep(0.05)
            return time.monotonic() - start

        try:
            async with orch:
                experts = ExpertRegistry.of(orch.view, orch.clock)
                # Same traffic on both, interleaved (the box's load hits both alike), until a
                # quiet report shows them equal: expert timings on a shared CPU are noisy, and
                # without traffic a worker's figures stay as they are.
                for _ in range(10):
                    for w in DECODERS * 2:
                        await traffic(w, 1)
                    await reported_since_now()
                    if not experts.snapshot().straggler_workers:
                        break
                # The registry fills from heartbeats: both workers, 2 layers x 8 experts each.
                await wait_for(lambda: len(experts.replicas()) == 2 * 16)
                assert {r.worker_id for r in experts.replicas(expert=3)} == {"d-near", "d-far"}
                assert {r.worker_id for r in experts.replicas(domain="n1/nvl")} == {"d-far"}
                assert experts.snapshot().straggler_workers == frozenset()
                assert await routed() == "d-near"  # healthy: the cheaper KV transfer wins

                near.experts.delay_s = 0.05  # inject the straggler: d-near's experts slow
                detect = time.monotonic()
                await traffic("d-near", 3)
                await wait_for(lambda: "d-near" in experts.snapshot().straggler_workers)
                detected_s = time.monotonic() - detect
                decision = await routed()
                assert decision == "d-far"
                # Plain routing (the dense rule) on the same workers still picks d-near.
                src = cluster.info("p0")
                decoders = {endpoint_of(cluster.info(w)): cluster.info(w) for w in DECODERS}
                dense = RoutingPolicy().choose_decode(
                    endpoint_of(src),
                    [DecodeWorkerView(i.worker_id, e, 4, 0.0) for e, i in decoders.items()],
                    lambda _s, dst: pairs(src, decoders[dst]),
                    TransferRequest(LAYOUT.total_bytes, LAYOUT.num_layers),
                    orch.selector,
                )
                assert dense is not None and dense.worker_id == "d-near"
                body = orch.metrics.exposition().decode()
                assert 'topkv_moe_routed_total{strategy="cost"}' in body
                assert 'topkv_expert_straggler{expert="0",layer="0",worker="d-near"} 1.0' in body

                near.experts.delay_s = 0.0  # recovered
                recover = time.monotonic()
                for _ in range(40):
                    await traffic("d-near", 2)
                    if "d-near" not in experts.snapshot().straggler_workers:
                        break
                await wait_for(lambda: "d-near" not in experts.snapshot().straggler_workers)
                recovered_s = time.monotonic() - recover
                assert await routed() == "d-near"
                print(
                    f"straggler detected in {detected_s:.2f} s, taken back in {recovered_s:.2f} s"
                )
                assert detected_s < 10 * TTL_S
        finally:
            await executor.close()
            await cluster.stop()

    asyncio.run(main())


def _sequence(orch: Orchestrator, worker: str) -> int:
    info = orch.view.get(worker)
    return info.experts.sequence if info is not None and info.experts is not None else -1
