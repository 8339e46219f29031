"""The expert registry: three indices, freshness, leave, hostile reports, etcd restart."""

from __future__ import annotations

import asyncio
import math
import uuid

import pytest
from pydantic import ValidationError

from topkv.policy.clock import ManualClock
from topkv.relay.liveview import LiveWorkerView
from topkv.relay.moe.experts import ExpertRegistry
from topkv.relay.registry.memory import MemoryRegistry, open_registry
from topkv.relay.workers import ExpertReport, ExpertStat, WorkerInfo
from topkv.service.messages import RegisterRequest


def _report(seq: int, experts: range, compute_s: float = 1e-3) -> ExpertReport:
    return ExpertReport(
        sequence=seq,
        experts_per_token=2,
        moe_layers=2,
        hidden_size=64,
        stats=tuple(
            ExpertStat(layer=layer, expert=e, rate=10.0 + e, compute_s=compute_s, queue_depth=e)
            for layer in (0, 1)
            for e in experts
        ),
    )


def _info(wid: str, domain: str, report: ExpertReport | None) -> WorkerInfo:
    return WorkerInfo(
        worker_id=wid,
        role="decode",
        node=domain.split("/")[0],
        gpus=(0,),
        nvlink_domain=domain,
        experts=report,
    )


async def _view(registry: object) -> LiveWorkerView:
    view = LiveWorkerView(registry)  # type: ignore[arg-type]
    await view.start()
    return view


def test_indexed_by_expert_worker_and_domain_and_dropped_when_stale() -> None:
    async def body() -> None:
        clock = ManualClock(100.0)
        registry = MemoryRegistry(clock)
        a = registry.register(_info("a", "nA/nvl", _report(1, range(0, 4))), ttl_s=1000)
        registry.register(_info("b", "nB/nvl", _report(1, range(4, 8), compute_s=9e-3)), 1000)
        view = await _view(registry)
        experts = ExpertRegistry.of(view, clock)
        assert ExpertRegistry.of(view, clock) is experts  # one per view
        assert experts.is_moe and experts.model_shape() == (2, 2, 64)
        assert len(experts.replicas()) == 16
        assert {r.worker_id for r in experts.replicas(expert=5)} == {"b"}
        assert [r.layer for r in experts.replicas(expert=5)] == [0, 1]
        assert {r.expert for r in experts.replicas(domain="nA/nvl")} == {0, 1, 2, 3}
        assert len(experts.replicas(worker="b")) == 8
        doc = experts.describe(worker="b")
        assert doc["stragglers"] == ["b"] and doc["workers"] == ["b"]
        rows = doc["experts"]
        assert isinstance(rows, list) and all(row["straggler"] for row in rows)

        # Worker b stops reporting (its record stays: say its lease is long): stale after 30 s.
        clock.advance(20)
        a.update(_info("a", "nA/nvl", _report(2, range(0, 4))))  # a new report: fresh again
        clock.advance(15)
        assert {r.worker_id for r in experts.replicas()} == {"a"}
        snapshot = experts.snapshot()
        assert snapshot.stragglers == frozenset()
        # The same report again (a record replaced for another reason) is not fresher.
        a.update(_info("a", "nA/nvl", _report(2, range(0, 4))))
        clock.advance(20)
        assert experts.replicas() == [] and not experts.is_moe
        # A leave drops the replicas at once.
        a.update(_info("a", "nA/nvl", _report(3, range(0, 4))))
        assert experts.replicas(worker="a")
        a.deregister()
        assert experts.replicas(worker="a") == []
        view.stop()

    asyncio.run(body())


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("rate", -1.0, "rate"),
        ("compute_s", math.nan, "compute_s"),
        ("network_s", math.inf, "network_s"),
        ("queue_depth", 10**12, "queue_depth"),
        ("layer", -3, "layer"),
    ],
)
def test_hostile_statistics_are_refused_naming_the_field(
    field: str, value: float, named: str
) -> None:
    stat = {"layer": 0, "expert": 1, "rate": 1.0, "compute_s": 0.001, field: value}
    body = {
        "worker": {
            "worker_id": "w",
            "role": "decode",
            "node": "n",
            "experts": {
                "sequence": 1,
                "experts_per_token": 2,
                "moe_layers": 1,
                "hidden_size": 8,
                "stats": [stat],
            },
        }
    }
    with pytest.raises(ValidationError) as err:
        RegisterRequest.model_validate(body)
    locs = [".".join(str(p) for p in e["loc"]) for e in err.value.errors()]
    assert any(loc.endswith(f"stats.0.{named}") for loc in locs), locs


@pytest.mark.etcd
def test_the_registry_survives_an_orchestrator_restart_with_etcd(etcd_url: str) -> None:
    url = f"{etcd_url}/topkv-experts-{uuid.uuid4().hex[:8]}"

    async def body() -> None:
        worker_side = open_registry(url)
        worker_side.register(_info("w0", "n0/nvl", _report(7, range(0, 3))), ttl_s=30)
        clock = ManualClock(0.0)
        first = open_registry(url)
        view = await _view(first)
        before = ExpertRegistry.of(view, clock).describe()
        view.stop()
        first.close()  # the orchestrator goes away
        second = open_registry(url)  # and a new one starts from etcd alone
        view2 = await _view(second)
        after = ExpertRegistry.of(view2, clock).describe()
        assert after["experts"] == before["experts"] and len(after["experts"]) == 6  # type: ignore[arg-type]
        view2.stop()
        second.close()
        worker_side.close()

    asyncio.run(body())
