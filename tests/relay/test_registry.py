"""Worker registry: embedded backend with a manual clock, etcd backend against real etcd."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from topkv.errors import ConfigError
from topkv.policy.clock import ManualClock
from topkv.relay.registry.etcd import EtcdRegistry
from topkv.relay.registry.memory import MemoryRegistry, RegistryError, open_registry
from topkv.relay.workers import RegistryEvent, WorkerInfo


def _info(worker_id: str, role: str = "decode", capacity: int = 4) -> WorkerInfo:
    return WorkerInfo.model_validate(
        {"worker_id": worker_id, "role": role, "node": "node0", "gpus": [0], "capacity": capacity}
    )


def test_memory_registry_lifecycle_and_ttl() -> None:
    clock = ManualClock()
    registry = MemoryRegistry(clock)
    events: list[RegistryEvent] = []
    registry.watch(events.append)
    reg_a = registry.register(_info("a"), ttl_s=5)
    registry.register(_info("b", role="prefill"), ttl_s=5)
    assert [w.worker_id for w in registry.workers()] == ["a", "b"]
    assert [w.worker_id for w in registry.workers("prefill")] == ["b"]
    clock.advance(4)
    reg_a.heartbeat()
    clock.advance(2)  # b expired, a renewed
    assert [w.worker_id for w in registry.workers()] == ["a"]
    reg_a.update(_info("a", capacity=9))
    got = registry.get("a")
    assert got is not None and got.capacity == 9
    reg_a.deregister()
    assert registry.get("a") is None
    kinds = [(e.kind, e.worker_id) for e in events]
    assert kinds == [
        ("join", "a"),
        ("join", "b"),
        ("leave", "b"),
        ("update", "a"),
        ("leave", "a"),
    ]
    with pytest.raises(RegistryError, match="no longer registered"):
        reg_a.heartbeat()


def test_memory_registry_rejects_bad_ttl_and_id_change() -> None:
    registry = MemoryRegistry(ManualClock())
    with pytest.raises(ConfigError):
        registry.register(_info("a"), ttl_s=0)
    reg = registry.register(_info("a"))
    with pytest.raises(RegistryError):
        reg.update(_info("other"))


def test_open_registry_urls() -> None:
    assert isinstance(open_registry("memory"), MemoryRegistry)
    with pytest.raises(ConfigError, match="unknown registry"):
        open_registry("zookeeper://x")
    with pytest.raises(ConfigError, match="bad etcd registry URL"):
        open_registry("etcd://nohostport")


def test_etcd_unreachable_is_a_clear_error() -> None:
    with pytest.raises(RegistryError, match="cannot reach etcd"):
        EtcdRegistry("127.0.0.1", 1)


@pytest.mark.etcd
def test_etcd_registry_join_watch_expire_and_rebuild(etcd_url: str) -> None:
    prefix = f"/t{uuid.uuid4().hex[:8]}"
    registry = EtcdRegistry.from_url(etcd_url + prefix)
    events: list[RegistryEvent] = []
    seen = threading.Condition()

    def on_event(event: RegistryEvent) -> None:
        with seen:
            events.append(event)
            seen.notify_all()

    def wait_for(pred: object, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        with seen:
            while not pred():  # type: ignore[operator]
                left = deadline - time.monotonic()
                assert left > 0, f"timed out; events so far: {events}"
                seen.wait(left)

    registry.watch(on_event)
    time.sleep(0.2)  # let the watch stream open
    short = registry.register(_info("short"), ttl_s=2)
    long = registry.register(_info("long", role="prefill"), ttl_s=30)
    wait_for(lambda: {e.worker_id for e in events if e.kind == "join"} == {"short", "long"})
    assert [w.worker_id for w in registry.workers()] == ["long", "short"]
    assert [w.worker_id for w in registry.workers("prefill")] == ["long"]
    long.update(_info("long", role="prefill", capacity=7))
    wait_for(lambda: any(e.kind == "update" for e in events))

    # An orchestrator restart: a fresh client sees the same workers from etcd alone.
    rebuilt = EtcdRegistry.from_url(etcd_url + prefix)
    info = rebuilt.get("long")
    assert info is not None and info.capacity == 7

    # 'short' stops heartbeating: etcd expires its lease and the watch reports the leave.
    del short
    wait_for(lambda: any(e.kind == "leave" and e.worker_id == "short" for e in events), 15)
    assert [w.worker_id for w in rebuilt.workers()] == ["long"]
    long.heartbeat()
    long.deregister()
    wait_for(lambda: any(e.kind == "leave" and e.worker_id == "long" for e in events))
    assert rebuilt.workers() == []
    registry.close()
    rebuilt.close()
