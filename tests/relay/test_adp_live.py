"""The Adaptive Decoder Pool live: real in-process workers, real KV, the orchestrator.

The policy runs on a manual clock (so the rush, its hold and the conversions happen at
the same policy times on a loaded box); everything else is real: the workers are
:class:`~topkv.service.worker.service.WorkerService` instances whose KV crosses shm/TCP, each
conversion is ``POST /v1/role`` on the worker and a re-registration in the registry, and
every request's delivered bytes are checked against what the prefill engine produced.
Waits on real events are bounded by deadlines, never by fixed sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Sequence

import pytest

from topkv.harness.inprocess_cluster import InProcessCluster, WorkerSpec
from topkv.policy.adp.pool import ADPConfig
from topkv.policy.clock import ManualClock
from topkv.relay.adp import LiveAdaptivePool
from topkv.relay.orchestrator import Orchestrator
from topkv.relay.registry.memory import MemoryRegistry, WorkerRegistry, open_registry
from topkv.relay.transfers import Outcome, TransferRecord
from topkv.relay.workers import Role, WorkerInfo
from topkv.service.kvstore import synthetic_layers
from topkv.service.messages import LayoutModel, PrefillRequest
from topkv.service.orchestrator.executor import RemoteExecutor
from topkv.service.worker.service import WorkerFaults
from topkv.transport.base import Buffer, KVLayout
from topkv.wire import crc64

LAYOUT = KVLayout(num_layers=4, seq_len=256, kv_heads=2, head_dim=64)  # 512 KiB
#: the policy tuned to a test's time scale: 1 s windows, a 2 s hold, no rate limit; the
#: TTFT signal out of the way (real TTFTs on a loaded box vary; queue and velocity decide)
CONFIG = ADPConfig(
    ttft_target_s=600.0,
    ttft_window_s=5.0,
    velocity_window_s=1.0,
    baseline_window_s=30.0,
    queue_window_s=1.0,
    queue_growth_per_s=0.5,
    hold_s=2.0,
    convert_interval_s=0.0,
)
#: ~0.5 s per 512 KiB send: long enough to have KV in flight when the rush starts
SLOW = WorkerFaults(slow_gbps=0.001)
DEADLINE_S = 60.0


def _digest(request_id: int) -> int:
    """What the synthetic prefill engine produced for ``request_id``."""
    return _content(tensors for tensors, _ in synthetic_layers(request_id, "m", LAYOUT))


async def _until(what: str, check: Callable[[], bool], step: Callable[[], Awaitable[None]]) -> None:
    """Run ``step`` until ``check`` holds (bounded by a real deadline)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not check():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await step()


class Rig:
    """One orchestrator over an in-process cluster, the live ADP, and a decode consumer
    that checks every delivered KV's bytes and frees it."""

    def __init__(self, registry: WorkerRegistry, cluster: InProcessCluster) -> None:
        self.registry = registry
        self.cluster = cluster
        self.executor = RemoteExecutor(token=cluster.admin_token)
        self.orch = Orchestrator(registry, self.executor)
        self.clock = ManualClock()
        self.adp = LiveAdaptivePool(self.orch, self.executor, config=CONFIG, clock=self.clock)
        self.verified: dict[int, str] = {}
        self.submitted: list[int] = []
        self._next = 1
        self._consumer: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Rig:
        await self.orch.start()
        self._consumer = asyncio.ensure_future(self._consume())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.adp.close()
        if self._consumer is not None:
            self._consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._consumer
        await self.orch.close()
        await self.executor.close()

    async def _consume(self) -> None:
        while True:
            completion = await self.orch.next_completion(3600)
            rid = completion.request_id
            record = self.orch.transfer(rid)
            if completion.outcome != Outcome.DELIVERED:
                continue
            dest = completion.destination or ""
            service = self.cluster.workers.get(dest)
            kv = service.store.pop(rid) if service is not None else None
            if kv is not None:
                if _content(kv.layers) == _digest(rid):
                    self.verified[rid] = dest
                kv.free()
            self.orch.release_decode_slot(rid)
            self.adp.delivered(record)

    async def submit(self, source: str | None = None) -> int:
        """Prefill one request on ``source`` (default: round robin over the prefill pool
        the ADP offers), then hand it to the orchestrator; an arrival for the ADP."""
        rid = self._next
        self._next += 1
        pool = self.adp.prefill_workers()
        info = self.orch.view.get(source) if source else pool[rid % len(pool)]
        assert info is not None
        body = PrefillRequest(model_id="m", layout=LayoutModel.of(LAYOUT))
        await self.executor.prefill(info, rid, body)
        self.adp.observe_arrival(LAYOUT.seq_len)
        await self.orch.submit(rid, "m", LAYOUT, info.worker_id)
        self.submitted.append(rid)
        return rid

    async def tick(self, advance_s: float) -> None:
        """Advance the policy clock, tick the ADP, and give real time to the workers.
        Waits on real events tick with 0: the policy sees no time pass meanwhile, so a
        slow box cannot end a rush before its conversions are done."""
        self.clock.advance(advance_s)
        await self.adp.tick()
        await asyncio.sleep(0.02)  # real time for the transfers and conversions

    def role(self, worker_id: str) -> Role | None:
        info = self.registry.get(worker_id)
        return info.role if info is not None else None

    def all_verified(self) -> bool:
        return all(rid in self.verified for rid in self.submitted)

    def done(self, to: Role) -> list[str]:
        return [c.worker for c in self.adp.conversions if c.ok and c.to_role == to]

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.orch.metrics.value(name, labels)


def _content(layers: Iterable[Sequence[Buffer]]) -> int:
    """CRC-64 of every byte of a KV cache in layout order (an end-to-end content check)."""
    crc = 0
    for tensors in layers:
        for tensor in tensors:
            crc = crc64(tensor, crc)
    return crc


async def _steady(rig: Rig, seconds: int) -> None:
    """One request per policy second, each delivered before the next: the baseline."""
    for _ in range(seconds):
        await rig.submit()
        await _until("the steady request", rig.all_verified, lambda: rig.tick(0.0))
        await rig.tick(1.0)


async def _burst(rig: Rig, n: int) -> None:
    """``n`` requests within 0.1 policy seconds: a velocity spike and a growing queue."""
    for _ in range(n):
        await rig.submit()
    await rig.tick(0.1)


def record_routed(record: TransferRecord) -> Callable[[], bool]:
    return lambda: record.destination is not None


def _specs(prefill: int, decode: int, faults: WorkerFaults = SLOW) -> list[WorkerSpec]:
    return [
        WorkerSpec("prefill", "n0", i, worker_id=f"p{i}", faults=faults, capacity=32)
        for i in range(prefill)
    ] + [WorkerSpec("decode", "n0", prefill + i, worker_id=f"d{i}") for i in range(decode)]


def _run(
    specs: list[WorkerSpec],
    body: Callable[[Rig], Awaitable[None]],
    registry: WorkerRegistry | None = None,
) -> None:
    async def main() -> None:
        reg = registry if registry is not None else MemoryRegistry()
        async with InProcessCluster(reg) as cluster:
            await cluster.start(specs)
            async with Rig(reg, cluster) as rig:
                await body(rig)

    asyncio.run(main())


async def _burst_converts_and_converts_back(rig: Rig) -> None:
    await _steady(rig, 5)
    assert not rig.adp.in_rush and rig.adp.conversions == []
    await _burst(rig, 8)
    assert rig.adp.in_rush
    await _until(
        "a conversion to prefill", lambda: bool(rig.done("prefill")), lambda: rig.tick(0.0)
    )
    (worker,) = rig.done("prefill")
    assert rig.role(worker) == "prefill"  # re-registered in the other pool
    assert rig.value("topkv_adp_rush") == 1.0
    assert rig.value("topkv_adp_pool_workers", {"pool": "prefill"}) == 3.0
    assert rig.value("topkv_adp_pool_workers", {"pool": "decode"}) == 1.0
    # the converted worker serves prefill: its KV goes to the remaining decode worker
    rid = await rig.submit(worker)
    await _until(
        "the burst and the converted worker's request", rig.all_verified, lambda: rig.tick(0.0)
    )
    assert rig.verified[rid] != worker
    # calm: no arrivals, the queue empty; after the hold the worker converts back
    await _until("a conversion back", lambda: bool(rig.done("decode")), lambda: rig.tick(0.5))
    assert rig.done("decode") == [worker] and rig.role(worker) == "decode"
    assert not rig.adp.in_rush
    report = rig.adp.report()
    conversions = report["conversions"]
    assert isinstance(conversions, list) and [c["to"] for c in conversions] == ["prefill", "decode"]
    for c in conversions:
        assert set(c) == {"worker", "from", "to", "at_ms", "duration_ms"}
        assert c["worker"] == worker and 0 < c["duration_ms"] < 10_000  # the paper's target
    (period,) = report["rush_periods"]  # type: ignore[misc]
    assert period[0] <= conversions[0]["at_ms"] <= conversions[1]["at_ms"] and period[1] > period[0]
    assert period[1] <= conversions[1]["at_ms"]
    body = rig.orch.metrics.exposition().decode()
    assert 'topkv_conversions_total{from="decode",to="prefill"} 1.0' in body
    assert 'topkv_conversions_total{from="prefill",to="decode"} 1.0' in body
    assert 'topkv_conversion_seconds_count{to="prefill"} 1.0' in body
    assert "topkv_adp_rush 0.0" in body
    assert 'topkv_adp_pool_workers{pool="decode"} 2.0' in body
    assert rig.all_verified()


def test_a_burst_converts_a_decode_worker_and_it_converts_back() -> None:
    _run(_specs(2, 2), _burst_converts_and_converts_back)


@pytest.mark.etcd
def test_the_same_conversions_through_etcd(etcd_url: str) -> None:
    _run(_specs(2, 2), _burst_converts_and_converts_back, open_registry(etcd_url + "/adp-live"))


def test_a_worker_with_kv_in_flight_is_fenced_not_converted() -> None:
    async def body(rig: Rig) -> None:
        await _steady(rig, 5)
        await _burst(rig, 8)  # ~0.5 s sends: both decode workers have KV in flight
        busy = {r.destination for r in rig.orch.transfers.active() if r.destination}
        assert rig.adp.in_rush and busy == {"d0", "d1"}
        fenced = [w for w, s in rig.adp.stage.items() if s == "fenced"]
        assert len(fenced) == 1 and rig.role(fenced[0]) == "decode"
        # while its KV is not acknowledged it stays a decode worker, and gets no new KV
        while any(r.destination == fenced[0] for r in rig.orch.transfers.active()):
            assert rig.role(fenced[0]) == "decode" and rig.adp.conversions == []
            record = rig.orch.transfer(await rig.submit())
            await _until("routing", record_routed(record), lambda: rig.tick(0.0))
            assert record.destination != fenced[0]
            await rig.tick(0.0)
        await _until("the conversion", lambda: bool(rig.done("prefill")), lambda: rig.tick(0.0))
        assert rig.done("prefill") == fenced
        await _until("every request", rig.all_verified, lambda: rig.tick(0.0))

    _run(_specs(2, 2), body)


def test_a_worker_killed_while_fenced_loses_no_request() -> None:
    async def body(rig: Rig) -> None:
        await _steady(rig, 5)
        await _burst(rig, 9)
        fenced = [w for w, s in rig.adp.stage.items() if s == "fenced"]
        assert len(fenced) == 1
        victim = fenced[0]
        in_flight = [r.request_id for r in rig.orch.transfers.active() if r.destination == victim]
        assert in_flight, "the fenced worker has KV in flight"
        await rig.cluster.kill(victim)
        await _until("every request", rig.all_verified, lambda: rig.tick(0.0))
        assert all(rig.verified[rid] != victim for rid in in_flight)  # retried elsewhere
        assert rig.orch.transfer(in_flight[0]).reroutes >= 1
        assert victim not in rig.adp.stage and victim not in rig.done("prefill")
        # the pool goes on: the next burst converts another decode worker
        await rig.tick(1.0)
        await _burst(rig, 6)
        await _until("another conversion", lambda: bool(rig.done("prefill")), lambda: rig.tick(0.0))
        await _until("every request", rig.all_verified, lambda: rig.tick(0.0))
        assert rig.role(rig.done("prefill")[0]) == "prefill"

    _run(_specs(1, 3), body)


class KillingSwitcher:
    """The real role switch, with the first worker asked to convert crashed at that moment:
    a worker that dies mid-conversion (the crash is the test's, the failure is real). It
    waits until decode took the KV delivered to the worker (a crash loses decode sequences
    with or without a conversion; what must not be lost is what is in flight)."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.victim: str | None = None

    async def set_role(
        self, worker: WorkerInfo, role: Role, *, chunk_tokens: int, reserved_slots: int
    ) -> float:
        if self.victim is None:
            self.victim = worker.worker_id
            await _until(
                "decode to take the victim's KV",
                lambda: self.rig.orch.delivered_to(worker.worker_id) == 0,
                lambda: asyncio.sleep(0.01),
            )
            self.rig.cluster.kill(worker.worker_id)
        return await self.rig.executor.set_role(
            worker, role, chunk_tokens=chunk_tokens, reserved_slots=reserved_slots
        )


def test_a_worker_killed_mid_conversion_loses_no_request() -> None:
    async def body(rig: Rig) -> None:
        switcher = KillingSwitcher(rig)
        rig.adp.switcher = switcher
        await _steady(rig, 5)
        await _burst(rig, 6)
        more = [await rig.submit() for _ in range(3)]  # requests keep coming meanwhile
        await _until(
            "the failed conversion",
            lambda: any(not c.ok for c in rig.adp.conversions),
            lambda: rig.tick(0.0),
        )
        victim = switcher.victim
        assert victim is not None and rig.role(victim) is None
        failed = [c for c in rig.adp.conversions if not c.ok]
        assert [c.worker for c in failed] == [victim] and failed[0].duration_ms is None
        labels = {"from": "decode", "to": "prefill"}
        assert rig.value("topkv_conversion_failures_total", labels) == 1
        await _until("every request", rig.all_verified, lambda: rig.tick(0.0))
        assert all(rig.verified[rid] != victim for rid in more)
        await rig.tick(1.0)
        await _burst(rig, 6)
        await _until("another conversion", lambda: bool(rig.done("prefill")), lambda: rig.tick(0.0))
        assert victim not in rig.done("prefill")
        await _until("every request", rig.all_verified, lambda: rig.tick(0.0))

    _run(_specs(1, 3), body)
