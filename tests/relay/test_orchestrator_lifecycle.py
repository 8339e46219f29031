"""Orchestrator decisions (retry, failover, reroute, exhaustion, abort, limits) with a
scripted executor, so each failure happens exactly where the test says."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from topkv.relay.executor import AttemptFailed, AttemptPlan, Delivery
from topkv.relay.orchestrator import Orchestrator, QueueFull, UnknownWorker
from topkv.relay.orchestrator_config import OrchestratorConfig, RetryPolicy
from topkv.relay.registry.memory import MemoryRegistry
from topkv.relay.transfers import (
    DuplicateRequest,
    FailureKind,
    InvalidTransition,
    Outcome,
    TransferRecord,
    TransferState,
    check_transition,
)
from topkv.relay.workers import WorkerInfo
from topkv.transport.base import KVLayout
from topkv.transport.errors import ChecksumMismatch, PeerDied

LAYOUT = KVLayout(num_layers=2, seq_len=4, kv_heads=1, head_dim=8)
DIGEST = 1234

Step = str | BaseException


class ScriptedExecutor:
    """Plays a script per (destination, transport); ``ok`` unless told otherwise."""

    def __init__(self) -> None:
        self.script: dict[tuple[str, str], list[Step]] = defaultdict(list)
        self.calls: list[tuple[str, str]] = []
        self.source_held: set[int] = set()
        self.destination_held: dict[int, str] = {}
        self.dead: set[str] = set()
        self.active = 0
        self.peak = 0
        self.gate: asyncio.Event | None = None

    async def source_digest(self, source: WorkerInfo, request_id: int, layout: KVLayout) -> int:
        if request_id not in self.source_held:
            raise AttemptFailed(FailureKind.SOURCE_LOST, "gone")
        return DIGEST

    async def transfer(self, plan: AttemptPlan) -> Delivery:
        key = (plan.destination.worker_id, plan.path_class)
        self.calls.append(key)
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            if self.gate is not None:
                await self.gate.wait()
            step: Step = self.script[key].pop(0) if self.script[key] else "ok"
            if step == "hang":
                await asyncio.Event().wait()
            if isinstance(step, BaseException):
                raise step
            digest = DIGEST + 1 if step == "corrupt" else DIGEST
            self.destination_held[plan.request_id] = plan.destination.worker_id
            return Delivery(
                plan.request_id,
                plan.destination.worker_id,
                plan.path_class,
                "test",
                64,
                0.001,
                digest,
            )
        finally:
            self.active -= 1

    async def probe(self, worker: WorkerInfo) -> bool:
        return worker.worker_id not in self.dead

    async def release_source(self, source: WorkerInfo, request_id: int) -> None:
        self.source_held.discard(request_id)

    async def discard_destination(self, destination: WorkerInfo, request_id: int) -> None:
        self.destination_held.pop(request_id, None)


def _workers(registry: MemoryRegistry, decode_capacity: int = 8) -> None:
    registry.register(WorkerInfo(worker_id="p0", role="prefill", node="n0", gpus=(0,)))
    registry.register(
        WorkerInfo(worker_id="d0", role="decode", node="n0", gpus=(1,), capacity=decode_capacity)
    )
    registry.register(
        WorkerInfo(worker_id="d1", role="decode", node="n1", gpus=(0,), capacity=decode_capacity)
    )


def _run(
    body: Callable[[Orchestrator, ScriptedExecutor, list[float]], Awaitable[None]],
    **config: Any,
) -> None:
    async def main() -> None:
        registry = MemoryRegistry()
        _workers(registry, config.pop("decode_capacity", 8))
        executor = ScriptedExecutor()
        sleeps: list[float] = []

        async def sleep(seconds: float) -> None:
            sleeps.append(seconds)

        cfg = OrchestratorConfig(**config)
        async with Orchestrator(registry, executor, config=cfg, sleep=sleep) as orch:
            await body(orch, executor, sleeps)

    asyncio.run(main())


async def _submit(orch: Orchestrator, ex: ScriptedExecutor, rid: int, **kw: Any) -> TransferRecord:
    ex.source_held.add(rid)
    return await orch.submit(rid, "m", LAYOUT, "p0", **kw)


def test_delivers_to_cheapest_decode_worker_and_releases_source() -> None:
    async def body(orch: Orchestrator, ex: ScriptedExecutor, sleeps: list[float]) -> None:
        record = await _submit(orch, ex, 1)
        assert record.handed_off_at is not None  # prefill free once queued
        await orch.wait(1, 5)
        assert record.state == TransferState.DELIVERED
        assert (record.destination, record.transport) == ("d0", "pcie")  # same node: PCIe
        assert ex.source_held == set() and ex.destination_held == {1: "d0"}
        completion = await orch.next_completion(1)
        assert completion.outcome == Outcome.DELIVERED and completion.destination == "d0"
        assert orch.slots_used("d0") == 1
        orch.release_decode_slot(1)
        assert orch.slots_used("d0") == 0

    _run(body)


def test_checksum_failure_retries_with_exponential_backoff() -> None:
    async def body(orch: Orchestrator, ex: ScriptedExecutor, sleeps: list[float]) -> None:
        ex.script["d0", "pcie"] = [ChecksumMismatch("flip"), "corrupt"]
        record = await _submit(orch, ex, 1)
        await orch.wait(1, 5)
        assert record.state == TransferState.DELIVERED
        assert record.retries == 2 and sleeps == [0.1, 0.2]
        assert [a.error for a in record.attempts] == [
            FailureKind.CHECKSUM,
            FailureKind.CHECKSUM,
            None,
        ]
        assert orch.metrics.value("topkv_checksum_failures_total") == 2
        assert orch.metrics.value("topkv_transfer_retries_total") == 2
        assert 1 not in ex.source_held

    _run(body)


def test_retries_exhausted_fail_over_to_next_transport() -> None:
    async def body(orch: Orchestrator, ex: ScriptedExecutor, sleeps: list[float]) -> None:
        ex.script["d0", "pcie"] = [ChecksumMismatch("x")] * 3
        record = await _submit(orch, ex, 1)
        await orch.wait(1, 5)
        assert record.state == TransferState.DELIVERED
        assert record.transport == "tcp" and record.destination == "d0"
        assert record.failovers == 1 and record.retries == 2

    _run(body)


def test_transport_failure_fails_over_while_destination_lives() -> None:
    async def body(orch: Orchestrator, ex: ScriptedExecutor, sleeps: list[float]) -> None:
        ex.script["d0", "pcie"] = [PeerDied("reset")]
        record = await _submit(orch, ex, 1)
        await orch.wait(1, 5)
        assert ex.calls == [("d0", "pcie"), ("d0", "tcp")]
        assert record.failovers == 1 and record.reroutes == 0 and sleeps == []

    _run(body)


def test_dead_destination_is_rerouted() -> None:
    async def body(orch: Orchestrator, ex: ScriptedExecutor, sleeps: list[float]) -> None:
        ex.dead.add("d0")
        ex.script["d0", "pcie"] = [PeerDied("gone")]
        record = await _submit(orch, ex, 1)
        await orch.wait(1, 5)
        assert record.state == TransferState.DELIVERED
        assert record.destination == "d1" and record.reroutes == 1
        assert orch.metrics.value("topkv_transfer_reroutes_total") == 1
        assert orch.slots_used("d0") == 0 and orch.slots_used("d1") == 1

    _run(body)


def test_registry_leave_cancels_the_attempt_and_reroutes() -> None:
    async def body(orch: Orchestrator, ex: ScriptedExecutor, sleeps: list[float]) -> None:
        ex.script["d0", "pcie"] = ["hang"]
        record = await _submit(orch, ex, 1)
        while record.state != TransferState.RUNNING:
            await asyncio.sleep(0)
        registry = orch.view._registry
        assert isinstance(registry, MemoryRegistry)
        registry._remove("d0")  # the worker's lease ended: a leave event
        await orch.wait(1, 5)
        assert record.destination == "d1" and record.reroutes == 1
        assert record.attempts[0].error == FailureKind.DESTINATION_DIED

    _run(body)


@pytest.mark.parametrize(
    ("policy", "outcome"), [("fail", Outcome.FAILED), ("recompute", Outcome.RECOMPUTE)]
)
def test_everything_exhausted_fails_cleanly(policy: str, outcome: Outcome) -> None:
    async def body(orch: Orchestrator, ex: ScriptedExecutor, sleeps: list[float]) -> None:
        for key in [("d0", "pcie"), ("d0", "tcp"), ("d1", "tcp")]:
            ex.script[key] = [PeerDied("broken link")] * 5
        record = await _submit(orch, ex, 1)
        await orch.wait(1, 5)
        assert record.state == TransferState.FAILED and record.outcome == outcome
        assert record.failure == FailureKind.TRANSPORT and "gave up" in record.reason
        assert ex.source_held == set() and ex.destination_held == {}
        assert orch.slots_used("d0") == orch.slots_used("d1") == 0
        completion = await orch.next_completion(1)
        assert completion.outcome == outcome and completion.reason == record.reason

    _run(body, on_exhausted=policy, retry=RetryPolicy(max_reroutes=1))


def test_exhaustion_reason_and_counts_after_retries_failovers_and_reroutes() -> None:
    async def body(orch: Orchestrator, ex: ScriptedExecutor, sleeps: list[float]) -> None:
        for key in [("d0", "pcie"), ("d0", "tcp"), ("d1", "tcp")]:
            ex.script[key] = [ChecksumMismatch("flip")] * 9
        record = await _submit(orch, ex, 1)
        await orch.wait(1, 5)
        # Each path: the attempt and its one retry; d0 fails over once; one reroute to d1.
        assert ex.calls == [("d0", "pcie")] * 2 + [("d0", "tcp")] * 2 + [("d1", "tcp")] * 2
        assert (record.retries, record.failovers, record.reroutes) == (3, 1, 1)
        assert sleeps == [0.1, 0.1, 0.1]
        assert record.failure == FailureKind.TRANSPORT and record.outcome == Outcome.FAILED
        assert record.reason == "every transport to d1 failed (flip); gave up after 1 reroute(s)"
        failures = {"kind": FailureKind.CHECKSUM.value}
        assert orch.metrics.value("topkv_transfer_attempt_failures_total", failures) == 6
        assert orch.metrics.value("topkv_checksum_failures_total") == 6
        assert orch.metrics.value("topkv_transfer_retries_total") == 3
        assert orch.metrics.value("topkv_transfer_failovers_total") == 1
        assert orch.metrics.value("topkv_transfer_reroutes_total") == 1

    _run(body, retry=RetryPolicy(max_retries=1, max_reroutes=1))


@pytest.mark.parametrize(
    ("error", "kind", "outcome"),
    [
        (
            AttemptFailed(FailureKind.SOURCE_LOST, "source restarted"),
            FailureKind.SOURCE_LOST,
            Outcome.RECOMPUTE,
        ),
        (RuntimeError("executor bug"), FailureKind.INTERNAL, Outcome.FAILED),
    ],
)
def test_failure_no_other_destination_mends_ends_without_reroute(
    error: BaseException, kind: FailureKind, outcome: Outcome
) -> None:
    async def body(orch: Orchestrator, ex: ScriptedExecutor, sleeps: list[float]) -> None:
        ex.script["d0", "pcie"] = [error]
        record = await _submit(orch, ex, 1)
        await orch.wait(1, 5)
        assert ex.calls == [("d0", "pcie")] and sleeps == []
        assert (record.retries, record.failovers, record.reroutes) == (0, 0, 0)
        assert record.failure == kind and record.outcome == outcome
        assert record.reason == str(error)
        assert orch.slots_used("d0") == orch.slots_used("d1") == 0

    _run(body)


def test_source_without_kv_is_handed_back_for_recompute() -> None:
    async def body(orch: Orchestrator, ex: ScriptedExecutor, sleeps: list[float]) -> None:
        record = await orch.submit(7, "m", LAYOUT, "p0")  # p0 holds nothing for 7
        await orch.wait(7, 5)
        assert record.outcome == Outcome.RECOMPUTE and record.failure == FailureKind.SOURCE_LOST
        assert ex.calls == []

    _run(body)


def test_attempt_timeout_counts_as_timeout_and_retries() -> None:
    async def body(orch: Orchestrator, ex: ScriptedExecutor, sleeps: list[float]) -> None:
        ex.script["d0", "pcie"] = ["hang"]
        record = await _submit(orch, ex, 1)
        await orch.wait(1, 5)
        assert record.attempts[0].error == FailureKind.TIMEOUT
        assert record.state == TransferState.DELIVERED and record.retries == 1

    _run(body, attempt_timeout_s=0.05)


def test_abort_releases_both_sides() -> None:
    async def body(orch: Orchestrator, ex: ScriptedExecutor, sleeps: list[float]) -> None:
        ex.script["d0", "pcie"] = ["hang"]
        record = await _submit(orch, ex, 1)
        while record.state != TransferState.RUNNING:
            await asyncio.sleep(0)
        await orch.abort(1)
        assert record.state == TransferState.CANCELLED
        assert ex.source_held == set() and ex.destination_held == {}
        assert orch.slots_used("d0") == 0 and orch.in_flight == 0
        # the orchestrator keeps working after an abort
        second = await _submit(orch, ex, 2)
        await orch.wait(2, 5)
        assert second.state == TransferState.DELIVERED

    _run(body)


def test_concurrency_limit_queue_and_backpressure() -> None:
    async def body(orch: Orchestrator, ex: ScriptedExecutor, sleeps: list[float]) -> None:
        ex.gate = asyncio.Event()
        for rid in range(4):
            await _submit(orch, ex, rid, block=False)
            await asyncio.sleep(0.01)  # let a dispatcher take it if one is free
        assert orch.in_flight == 2 and orch.status()["queued"] == 2
        with pytest.raises(QueueFull):
            await _submit(orch, ex, 99, block=False)
        with pytest.raises(QueueFull):
            await _submit(orch, ex, 98, timeout_s=0.01)
        with pytest.raises(DuplicateRequest):
            await _submit(orch, ex, 0, block=False)
        ex.gate.set()
        for rid in range(4):
            await orch.wait(rid, 5)
        assert ex.peak == 2 and orch.max_in_flight_seen == 2

    _run(body, max_in_flight=2, queue_size=2)


def test_no_capacity_fails_with_reason_after_bounded_wait() -> None:
    async def body(orch: Orchestrator, ex: ScriptedExecutor, sleeps: list[float]) -> None:
        first = await _submit(orch, ex, 1)
        await orch.wait(1, 5)
        second = await _submit(orch, ex, 2)
        await orch.wait(2, 5)
        assert {first.destination, second.destination} == {"d0", "d1"}  # least loaded next
        third = await _submit(orch, ex, 3)
        await orch.wait(3, 5)
        assert third.failure == FailureKind.NO_DESTINATION and 3 not in ex.source_held

    _run(body, decode_capacity=1, route_wait_s=0.05)


def test_submit_rejects_unknown_source() -> None:
    async def body(orch: Orchestrator, ex: ScriptedExecutor, sleeps: list[float]) -> None:
        with pytest.raises(UnknownWorker):
            await orch.submit(1, "m", LAYOUT, "d0")

    _run(body)


def test_state_machine_rejects_skipped_and_terminal_steps() -> None:
    record = TransferRecord(1, "m", LAYOUT, "p0", 0.0)
    with pytest.raises(InvalidTransition):
        check_transition(record, TransferState.RUNNING)
    record.state = TransferState.DELIVERED
    with pytest.raises(InvalidTransition):
        check_transition(record, TransferState.FAILED)
