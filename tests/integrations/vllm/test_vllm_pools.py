"""The front door's ADP (:mod:`topkv.integrations.vllm.frontdoor.adp`) on an injected clock: a rush
moves a kv_both instance to prefill, its end moves it back, a busy instance is fenced until it
drains, the share cap holds; every move shows in the registry and the metrics."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, generate_latest

from topkv.integrations.vllm.frontdoor.adp import (
    EmbeddedRoleWriter,
    FrontDoorADP,
    Ticket,
    prompt_tokens,
)
from topkv.integrations.vllm.frontdoor.picker import Picker
from topkv.policy.adp.pool import ADPConfig, plan_conversions
from topkv.policy.clock import ManualClock
from topkv.relay.registry.memory import MemoryRegistry
from topkv.relay.workers import WorkerInfo
from topkv.service.orchestrator.registrations import Registrations

CONFIG = ADPConfig(
    velocity_window_s=1.0, baseline_window_s=30.0, queue_window_s=2.0, queue_growth_per_s=1.0,
    ttft_target_s=0.5, ttft_window_s=3.0, hold_s=2.0, convert_interval_s=0.5,
)  # fmt: skip
BOTH = ("both0", "both1")


def _setup() -> tuple[FrontDoorADP, MemoryRegistry, ManualClock, CollectorRegistry]:
    registry = MemoryRegistry()
    registrations = Registrations(registry)
    for wid, role in (("prefill0", "prefill"), ("both0", "decode"), ("both1", "decode")):
        info = WorkerInfo(
            worker_id=wid, role=role, node="n", host_id="h", address=f"127.0.0.1:{len(wid)}",
            control_url=f"http://{wid}",
        )  # fmt: skip
        registrations.by_worker[wid] = registry.register(info, 60.0)
    clock = ManualClock(0.0)
    metrics = CollectorRegistry()
    adp = FrontDoorADP(
        registry, EmbeddedRoleWriter(registrations), BOTH, metrics, config=CONFIG, clock=clock
    )
    return adp, registry, clock, metrics


def _served(adp: FrontDoorADP, prefill: str, decode: str) -> Ticket:
    """A request prefilled on ``prefill`` whose decode on ``decode`` is still running."""
    ticket = adp.admit({"prompt": list(range(100))})
    ticket.routed(prefill, decode)
    ticket.prefilled()
    ticket.answered(0.05)
    return ticket


async def _tick(adp: FrontDoorADP, clock: ManualClock, dt: float = 0.25) -> None:
    clock.advance(dt)
    await adp.tick()
    await adp.settle(5)


async def _warm(adp: FrontDoorADP, clock: ManualClock) -> None:
    """Ten seconds of one quick request a second: no rush."""
    for _ in range(10):
        _served(adp, "prefill0", "both1").close()
        for _ in range(4):
            await _tick(adp, clock)
    assert not adp.in_rush


async def _burst(adp: FrontDoorADP, clock: ManualClock, ticks: int) -> list[Ticket]:
    """Three requests queue every 0.25 s (none prefilled): the queue grows, velocity spikes."""
    queued = []
    for _ in range(ticks):
        queued += [adp.admit({"prompt": list(range(100))}) for _ in range(3)]
        await _tick(adp, clock)
    return queued


def _role(registry: MemoryRegistry, wid: str) -> str:
    info = registry.get(wid)
    assert info is not None
    return info.role


def _metric(metrics: CollectorRegistry, line: str) -> float:
    for text in generate_latest(metrics).decode().splitlines():
        if text.startswith(line + " "):
            return float(text.split()[-1])
    raise AssertionError(f"{line} not in the metrics")


def test_a_rush_moves_one_kv_both_instance_to_prefill_and_its_end_moves_it_back() -> None:
    async def main() -> None:
        adp, registry, clock, metrics = _setup()
        picker = Picker(registry, "/tmp", affinity=False, pools=adp.workers)
        await _warm(adp, clock)
        queued = await _burst(adp, clock, 4)
        assert adp.in_rush
        assert adp.stage == {"both0": "converted"}  # the idle one, first by id
        assert _role(registry, "both0") == "prefill"  # recorded in the registry
        assert {w.worker_id for w in adp.workers("prefill")} == {"prefill0", "both0"}
        assert [w.worker_id for w in adp.workers("decode")] == ["both1"]
        assert picker.pick(1 << 20).decode.worker_id == "both1"
        # the cap: 50% of the 2 movable instances, never the last: more pressure moves no more
        queued += await _burst(adp, clock, 20)
        assert adp.stage == {"both0": "converted"}
        assert _role(registry, "both1") == "decode"
        assert _metric(metrics, "topkv_adp_rush") == 1
        assert _metric(metrics, 'topkv_adp_pool_workers{pool="prefill"}') == 2
        assert _metric(metrics, 'topkv_adp_pool_workers{pool="decode"}') == 1
        # a converted instance still prefilling when the rush ends is drained first
        busy = adp.admit({"prompt": [1, 2]})
        busy.routed("both0", "both1")
        for ticket in queued:
            ticket.prefilled()
            ticket.close()
        for _ in range(60):
            await _tick(adp, clock)
        assert not adp.in_rush
        assert adp.stage == {"both0": "draining"}
        assert [w.worker_id for w in adp.workers("prefill")] == ["prefill0"]
        busy.prefilled()
        busy.answered(0.1)
        busy.close()
        await _tick(adp, clock)
        assert adp.stage == {}
        assert _role(registry, "both0") == "decode"
        assert {w.worker_id for w in adp.workers("decode")} == set(BOTH)
        moves = [(c.worker, c.from_role, c.to_role, c.ok) for c in adp.conversions]
        assert moves == [("both0", "decode", "prefill", True), ("both0", "prefill", "decode", True)]
        assert all(c.duration_ms is not None and c.duration_ms >= 0 for c in adp.conversions)
        assert _metric(metrics, 'topkv_conversions_total{from="decode",to="prefill"}') == 1
        assert _metric(metrics, 'topkv_conversions_total{from="prefill",to="decode"}') == 1
        assert _metric(metrics, 'topkv_conversion_seconds_count{to="prefill"}') == 1
        assert _metric(metrics, "topkv_adp_rush") == 0
        assert adp.queued == 0 and not +adp.unacked and not +adp.prefilling
        assert adp.state().conversions[0].duration_ms is not None

    asyncio.run(main())


def test_a_busy_instance_is_fenced_until_its_decode_and_kv_drain() -> None:
    async def main() -> None:
        adp, registry, clock, _ = _setup()
        await _warm(adp, clock)
        # three streams on each (more than the 30% reserve of 8 slots), KV on its way to both0
        streams = {wid: [_served(adp, "prefill0", wid) for _ in range(3)] for wid in BOTH}
        landing = adp.admit({"prompt": [1, 2, 3]})
        landing.routed("prefill0", "both0")
        landing.prefilled()
        queued = await _burst(adp, clock, 4)
        assert adp.in_rush
        assert adp.stage == {"both1": "fenced"}  # the less loaded; busy: not moved yet
        assert _role(registry, "both1") == "decode"
        assert [w.worker_id for w in adp.workers("decode")] == ["both0"]  # no new decode
        assert not adp.conversions
        for ticket in streams["both1"][:2]:  # down to the reserve: it moves, keeping one
            ticket.close()
        await _tick(adp, clock)
        assert adp.stage == {"both1": "converted"}
        assert _role(registry, "both1") == "prefill"
        assert adp.decoding["both1"] == 1  # the stream it kept is still counted as its own
        assert adp.conversions[0].fenced_ms >= 0
        for ticket in [*queued, *streams["both0"], streams["both1"][2], landing]:
            ticket.close()

    asyncio.run(main())


def test_without_adp_a_ticket_does_nothing_and_prompts_count_tokens() -> None:
    ticket = Ticket(None)
    ticket.routed("a", "b")
    ticket.prefilled()
    ticket.answered(1.0)
    ticket.close()
    assert prompt_tokens({"prompt": [1, 2, 3]}) == 3
    assert prompt_tokens({"prompt": "x" * 40}) == 10
    assert prompt_tokens({"messages": [{"role": "user", "content": "y" * 8}]}) == 2


def test_a_plain_decode_instance_is_counted_but_never_moved() -> None:
    adp, registry, _, _ = _setup()
    consumer = WorkerInfo(
        worker_id="consumer0", role="decode", node="n", host_id="h", address="127.0.0.1:9",
        control_url="http://consumer0",
    )  # fmt: skip
    registry.register(consumer, 60.0)
    ticket = _served(adp, "prefill0", "consumer0")
    views = {v.worker_id: v for v in adp.views()}
    plain = views["consumer0"]
    assert (plain.native, plain.role, plain.convertible) == ("decode", "decode", False)
    assert plain.active_decode == 1 and plain.decode_slots == consumer.capacity
    assert views["both0"].convertible and views["both1"].convertible
    # in a rush the movable ones are chosen, never the idle plain instance
    plan = plan_conversions(adp.views(), in_rush=True, pressure=True, config=CONFIG)
    assert plan.to_prefill and "consumer0" not in plan.to_prefill + plan.fence
    ticket.close()
