"""Deferred source digest (``submit(..., defer_digest=True)``): a streaming transfer starts
while the source is still producing its KV, and the digest is compared at verification."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from topkv.relay.executor import AttemptFailed, AttemptPlan, Delivery
from topkv.relay.orchestrator import Orchestrator
from topkv.relay.orchestrator_config import OrchestratorConfig
from topkv.relay.registry.memory import MemoryRegistry
from topkv.relay.transfers import FailureKind, Outcome, TransferState
from topkv.relay.workers import WorkerInfo
from topkv.transport.base import KVLayout

LAYOUT = KVLayout(num_layers=4, seq_len=4, kv_heads=1, head_dim=8)
DIGEST = 0xFEED


class ProducingExecutor:
    """A source that produces its KV only when the test says so (``produced``)."""

    def __init__(self) -> None:
        self.produced = asyncio.Event()
        self.digest_lost = False
        self.events: list[str] = []
        self.corrupt_attempts: set[int] = set()
        self.source_held: set[int] = set()
        self.destination_held: dict[int, str] = {}

    async def source_digest(self, source: WorkerInfo, request_id: int, layout: KVLayout) -> int:
        self.events.append("digest asked")
        await self.produced.wait()  # the digest exists only once every layer is computed
        if self.digest_lost:
            raise AttemptFailed(FailureKind.SOURCE_LOST, "source restarted")
        self.events.append("digest given")
        return DIGEST

    async def transfer(self, plan: AttemptPlan) -> Delivery:
        self.events.append(f"attempt {plan.attempt} to {plan.destination.worker_id}")
        await self.produced.wait()  # streams layers as they come; ends after the last one
        self.destination_held[plan.request_id] = plan.destination.worker_id
        digest = DIGEST + 1 if plan.attempt in self.corrupt_attempts else DIGEST
        return Delivery(
            plan.request_id, plan.destination.worker_id, plan.path_class, "test", 64, 0.01, digest
        )

    async def probe(self, worker: WorkerInfo) -> bool:
        return True

    async def release_source(self, source: WorkerInfo, request_id: int) -> None:
        self.source_held.discard(request_id)

    async def discard_destination(self, destination: WorkerInfo, request_id: int) -> None:
        self.events.append("discard")
        self.destination_held.pop(request_id, None)


def _run(body: Callable[[Orchestrator, ProducingExecutor], Awaitable[None]]) -> None:
    async def main() -> None:
        registry = MemoryRegistry()
        registry.register(WorkerInfo(worker_id="p0", role="prefill", node="n0", gpus=(0,)))
        registry.register(WorkerInfo(worker_id="d0", role="decode", node="n0", gpus=(1,)))
        executor = ProducingExecutor()

        async def no_sleep(_: float) -> None:
            return None

        config = OrchestratorConfig(executor_call_timeout_s=2.0, attempt_timeout_s=2.0)
        async with Orchestrator(registry, executor, config=config, sleep=no_sleep) as orch:
            await body(orch, executor)

    asyncio.run(main())


async def _until(predicate: Callable[[], bool]) -> None:
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never became true")


def test_attempt_starts_before_the_source_has_its_digest() -> None:
    async def body(orch: Orchestrator, ex: ProducingExecutor) -> None:
        ex.source_held.add(1)
        record = await orch.submit(1, "m", LAYOUT, "p0", defer_digest=True)
        await _until(lambda: record.state == TransferState.RUNNING)
        # routed, transport chosen and the attempt running while the source still computes
        assert record.destination == "d0" and record.transport is not None
        assert ex.events == ["attempt 1 to d0"]
        ex.produced.set()
        await orch.wait(1, 5)
        assert record.state == TransferState.DELIVERED
        assert ex.events == ["attempt 1 to d0", "digest asked", "digest given"]
        assert record.source_digest == DIGEST and ex.source_held == set()

    _run(body)


def test_without_defer_the_digest_is_awaited_before_routing() -> None:
    async def body(orch: Orchestrator, ex: ProducingExecutor) -> None:
        ex.source_held.add(1)
        record = await orch.submit(1, "m", LAYOUT, "p0")
        await _until(lambda: ex.events == ["digest asked"])
        for _ in range(20):
            await asyncio.sleep(0)
        assert record.state == TransferState.QUEUED  # nothing routed yet
        ex.produced.set()
        await orch.wait(1, 5)
        assert ex.events == ["digest asked", "digest given", "attempt 1 to d0"]
        assert orch.transfer(1).state == TransferState.DELIVERED

    _run(body)


def test_deferred_digest_mismatch_retries_and_fetches_the_digest_once() -> None:
    async def body(orch: Orchestrator, ex: ProducingExecutor) -> None:
        ex.corrupt_attempts = {1}
        ex.produced.set()
        record = await orch.submit(1, "m", LAYOUT, "p0", defer_digest=True)
        await orch.wait(1, 5)
        assert record.state == TransferState.DELIVERED
        assert record.retries == 1
        assert record.attempts[0].error == FailureKind.CHECKSUM
        assert ex.events.count("digest asked") == 1  # a retry compares with the same value
        assert ex.events.index("discard") < ex.events.index("attempt 2 to d0")

    _run(body)


def test_deferred_digest_lost_source_discards_the_copy_for_recompute() -> None:
    async def body(orch: Orchestrator, ex: ProducingExecutor) -> None:
        ex.digest_lost = True
        ex.produced.set()
        ex.source_held.add(1)
        record = await orch.submit(1, "m", LAYOUT, "p0", defer_digest=True)
        await orch.wait(1, 5)
        assert record.outcome == Outcome.RECOMPUTE
        assert record.failure == FailureKind.SOURCE_LOST
        assert ex.destination_held == {} and ex.source_held == set()
        assert orch.slots_used("d0") == 0
        completion = await orch.next_completion(1)
        assert completion.outcome == Outcome.RECOMPUTE

    _run(body)


def test_a_given_digest_wins_over_defer() -> None:
    async def body(orch: Orchestrator, ex: ProducingExecutor) -> None:
        ex.produced.set()
        record = await orch.submit(1, "m", LAYOUT, "p0", source_digest=DIGEST, defer_digest=True)
        await orch.wait(1, 5)
        assert record.state == TransferState.DELIVERED
        assert "digest asked" not in ex.events

    _run(body)
