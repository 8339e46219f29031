"""The orchestrator's reused routing scores decide exactly as the one-call routing rule.

Two orchestrators see the same registry changes and submissions, with transfers held open
so slots and link load build up: one with the default (memoised, pure) selection policy,
which routes from cached per-worker scores; one with a plain ``CostPolicy``, which runs
``RoutingPolicy.choose_decode`` afresh for every decision. Destinations and transports
must agree at every step, including after joins, updates and leaves.
"""

from __future__ import annotations

import asyncio

from topkv.policy import CostPolicy
from topkv.policy.select import TransportSelector
from topkv.relay.executor import AttemptPlan, Delivery
from topkv.relay.orchestrator import Orchestrator
from topkv.relay.pairs import CachingSelector
from topkv.relay.registry.memory import MemoryRegistry, Registration
from topkv.relay.transfers import TransferState
from topkv.relay.workers import WorkerCapabilities, WorkerInfo
from topkv.transport.base import KVLayout

LAYOUT = KVLayout(num_layers=2, seq_len=16, kv_heads=2, head_dim=64)
DIGEST = 7
RDMA = WorkerCapabilities(rdma=True)


class HeldExecutor:
    """Holds every attempt open until released (so slots and link load accumulate)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def source_digest(self, source: WorkerInfo, request_id: int, layout: KVLayout) -> int:
        return DIGEST

    async def transfer(self, plan: AttemptPlan) -> Delivery:
        await self.release.wait()
        return Delivery(
            plan.request_id, plan.destination.worker_id, plan.path_class, "test", 1, 1e-3, DIGEST
        )

    async def probe(self, worker: WorkerInfo) -> bool:
        return True

    async def release_source(self, source: WorkerInfo, request_id: int) -> None:
        return None

    async def discard_destination(self, destination: WorkerInfo, request_id: int) -> None:
        return None


def _decode(
    wid: str,
    node: str,
    gpu: int,
    capacity: int,
    nvlink_domain: str | None = None,
    capabilities: WorkerCapabilities = WorkerCapabilities(),
) -> WorkerInfo:
    return WorkerInfo(
        worker_id=wid,
        role="decode",
        node=node,
        gpus=(gpu,),
        capacity=capacity,
        nvlink_domain=nvlink_domain,
        capabilities=capabilities,
    )


async def _scenario(selector: TransportSelector | None) -> list[tuple[str | None, str | None]]:
    registry = MemoryRegistry()
    registry.register(
        WorkerInfo(worker_id="p0", role="prefill", node="n0", gpus=(0,), capabilities=RDMA)
    )
    regs: dict[str, Registration] = {}
    for wid, node, gpu, cap in [("d0", "n0", 1, 2), ("d1", "n0", 2, 1), ("d2", "n1", 0, 3)]:
        regs[wid] = registry.register(_decode(wid, node, gpu, cap, capabilities=RDMA))
    regs["d3"] = registry.register(_decode("d3", "n2", 0, 3))  # TCP only
    executor = HeldExecutor()
    routed: list[tuple[str | None, str | None]] = []
    async with Orchestrator(registry, executor, selector=selector) as orch:

        async def submit(rid: int) -> None:
            record = await orch.submit(rid, "m", LAYOUT, "p0", source_digest=DIGEST)
            for _ in range(1000):  # event-loop steps, not time
                if record.state not in (TransferState.QUEUED, TransferState.PLANNED):
                    break
                await asyncio.sleep(0)
            assert record.state in (TransferState.RUNNING, TransferState.DELIVERED)
            routed.append((record.destination, record.transport))

        rid = 0
        for _ in range(4):
            await submit(rid := rid + 1)
        # A cheaper worker joins, one gets more capacity, one leaves (holding nothing).
        regs["d4"] = registry.register(
            _decode("d4", "n0", 3, 2, nvlink_domain="nv0", capabilities=RDMA)
        )
        regs["d2"].update(_decode("d2", "n1", 0, 5, capabilities=RDMA))
        for _ in range(4):
            await submit(rid := rid + 1)
        regs["d5"] = registry.register(_decode("d5", "n1", 1, 2, capabilities=RDMA))
        regs["d5"].deregister()
        for _ in range(3):
            await submit(rid := rid + 1)
        executor.release.set()
        delivered = 0
        while delivered < rid:
            completion = await orch.next_completion(10)
            orch.release_decode_slot(completion.request_id)
            delivered += 1
        # Everything was released: the next decision starts from empty slots again.
        await submit(rid + 1)
    return routed


def test_reused_scores_route_like_the_fresh_rule() -> None:
    cached = asyncio.run(_scenario(None))
    fresh = asyncio.run(_scenario(CostPolicy()))
    assert cached == fresh
    destinations = [d for d, _ in cached]
    assert "d4" in destinations[4:8]  # the join was seen
    assert "d5" not in destinations  # the leave was seen
    assert len(set(destinations)) >= 3  # slots filled up, so routing spread out


def test_memoised_selector_in_the_wrapper_also_reuses_scores() -> None:
    assert asyncio.run(_scenario(CachingSelector(CostPolicy()))) == asyncio.run(
        _scenario(CostPolicy())
    )
