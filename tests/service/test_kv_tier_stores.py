"""KV tier stores (arena, emulated CXL, disk) and the tiered KV manager, without a worker.

Real bytes: synthetic KV caches are written to each tier and read back byte for byte; the
disk tier's faults are real (a corrupted, truncated or deleted file, ENOSPC from /dev/full,
a directory nothing can be written in).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from topkv.errors import ConfigError
from topkv.policy.tiers import TierSpec
from topkv.service.errors import ServiceError
from topkv.service.kvstore import CapacityExceeded, HeldKV, synthetic_kv
from topkv.service.tiers.arena import Arena
from topkv.service.tiers.config import TierConfig, build_tier_stores
from topkv.service.tiers.stores import (
    DiskTierStore,
    MemoryTierStore,
    TierFull,
    TierKVLost,
    check_directory,
)
from topkv.service.tiers.tiered import DEVICE, TieredKV, open_tiered_kv
from topkv.topology.tiers import MemoryNode, TierInventory
from topkv.transport.base import KVLayout

LAYOUT = KVLayout(num_layers=4, seq_len=64, kv_heads=2, head_dim=64)  # 128 KiB
NBYTES = LAYOUT.total_bytes


def _kv(rid: int) -> HeldKV:
    kv = synthetic_kv(rid, "m", LAYOUT)
    kv.origin = "received"
    return kv


def _same(kv: HeldKV, layers: list[tuple[memoryview, ...]]) -> bool:
    return [bytes(t) for la in kv.layers for t in la] == [bytes(t) for la in layers for t in la]


def _host(capacity: int, *, emulated: bool = False, dilation: float = 1.0) -> MemoryTierStore:
    spec = TierSpec(
        "cxl" if emulated else "host",
        "cxl" if emulated else "host",
        capacity,
        150e-9,
        64.0 if emulated else 10.0,
        emulated=emulated,
    )
    return MemoryTierStore(spec, Arena(capacity), dilation=dilation)


def _disk(directory: Path, capacity: int = 1 << 30, direct: bool | None = None) -> DiskTierStore:
    return DiskTierStore(TierSpec("disk", "disk", capacity, 20e-6, 1.0), directory, direct=direct)


def test_arena_allocates_frees_and_merges() -> None:
    arena = Arena(4 * 4096)
    a, b = arena.allocate(4096), arena.allocate(4097)
    assert arena.used == 3 * 4096 and b == (4096, 8192)
    arena.release(a)
    arena.release(b)
    assert arena.used == 0 and arena.allocate(4 * 4096) == (0, 4 * 4096)


def test_memory_tier_round_trip_and_full() -> None:
    store = _host(NBYTES + 4096)
    kv = _kv(1)
    store.write(kv)
    assert store.holds(1) and store.free_bytes < NBYTES
    with pytest.raises(TierFull, match="tier host"):
        store.write(_kv(2))
    assert _same(kv, store.read(1, LAYOUT, kv.crcs))
    store.drop(1)
    with pytest.raises(TierKVLost, match="no copy of request 1"):
        store.read(1, LAYOUT, kv.crcs)


def test_emulated_cxl_is_paced() -> None:
    # 128 KiB at 64 GB/s x 200000 dilation is 0.41 s of modelled time per copy.
    store = _host(1 << 20, emulated=True, dilation=200_000.0)
    kv = _kv(1)
    started = time.perf_counter()
    store.write(kv)
    store.read(1, LAYOUT, kv.crcs)
    modelled = 2 * 200_000.0 * (150e-9 + NBYTES / 64e9)
    assert time.perf_counter() - started >= modelled * 0.99


@pytest.mark.parametrize("direct", [None, False])
def test_disk_round_trip(tmp_path: Path, direct: bool | None) -> None:
    store = _disk(tmp_path, direct=direct)
    assert store.direct_io is (direct is None and store.io_note == "O_DIRECT")
    kv = _kv(7)
    store.write(kv)
    assert store.path(7).stat().st_size % 4096 == 0
    assert _same(kv, store.read(7, LAYOUT, kv.crcs))
    store.drop(7)
    assert not store.path(7).exists()


def test_disk_corruption_truncation_deletion_are_kv_lost(tmp_path: Path) -> None:
    store = _disk(tmp_path)
    kvs = {rid: _kv(rid) for rid in (3, 4, 5)}
    for held in kvs.values():
        store.write(held)
    with open(store.path(3), "r+b") as f:  # flip one bit of layer 2's payload
        stride = -(-(128 + LAYOUT.layer_bytes) // 4096) * 4096  # frames are 4 KiB aligned
        f.seek(2 * stride + 128 + 100)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))
    with pytest.raises(TierKVLost, match="layer 2"):
        store.read(3, LAYOUT, kvs[3].crcs)
    os.truncate(store.path(4), 4096 * 20)
    with pytest.raises(TierKVLost, match="truncated"):
        store.read(4, LAYOUT, kvs[4].crcs)
    store.path(5).unlink()
    with pytest.raises(TierKVLost, match="deleted"):
        store.read(5, LAYOUT, kvs[5].crcs)
    other = _kv(9)  # a file of another KV under this one's name
    store.write(other)
    os.replace(store.path(9), store.path(3))
    with pytest.raises(TierKVLost, match="another KV"):
        store.read(3, LAYOUT, kvs[3].crcs)


def test_disk_full_is_tier_full(tmp_path: Path) -> None:
    store = _disk(tmp_path, direct=False)
    kv = _kv(1)
    store.path(1).symlink_to("/dev/full")  # the kernel answers ENOSPC to every write
    with pytest.raises(TierFull, match="No space left"):
        store.write(kv)
    assert store.used_bytes == 0
    small = _disk(tmp_path, capacity=NBYTES // 2)
    with pytest.raises(TierFull, match="do not fit"):
        small.write(_kv(2))


def test_unwritable_or_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ServiceError, match="cannot write in /proc/self"):
        check_directory(Path("/proc/self"))
    with pytest.raises(ServiceError, match="not a directory"):
        check_directory(tmp_path / "nope")


INVENTORY = TierInventory(
    numa=(MemoryNode(0, 64 << 30, 32 << 30, False),),
    host_total_bytes=64 << 30,
    host_available_bytes=32 << 30,
    sources={"gpu": "none"},
)


def test_config_more_than_exists_is_refused_with_numbers(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"40.00 GiB .* has 32.00 GiB .* available of 64.00 GiB"):
        build_tier_stores(TierConfig(2, host_bytes=40 << 30), INVENTORY)
    with pytest.raises(ConfigError, match="emulated CXL"):
        build_tier_stores(TierConfig(2, host_bytes=20 << 30, cxl_bytes=20 << 30), INVENTORY)
    with pytest.raises(ConfigError, match="free"):
        build_tier_stores(TierConfig(2, disk_bytes=1 << 60, disk_dir=tmp_path), INVENTORY)
    cxl = TierInventory(
        numa=(MemoryNode(0, 8 << 30, 4 << 30, False), MemoryNode(1, 1 << 30, 1 << 30, True)),
        host_total_bytes=8 << 30,
        host_available_bytes=4 << 30,
    )
    with pytest.raises(ConfigError, match=r"NUMA node 1 has 1.00 GiB .* free"):
        build_tier_stores(TierConfig(2, host_bytes=0, cxl_bytes=2 << 30), cxl)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device_capacity": 0}, "at least 1"),
        ({"host_bytes": 0}, "every tier below"),
        ({"disk_bytes": 10}, "needs a directory"),
        ({"cxl": "maybe"}, "auto, emulated or off"),
    ],
)
def test_bad_tier_config(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"device_capacity": 1, **kwargs}
    with pytest.raises(ConfigError, match=match):
        TierConfig(**args)  # type: ignore[arg-type]


def test_cxl_emulated_where_no_cpuless_node(tmp_path: Path) -> None:
    stores = build_tier_stores(
        TierConfig(2, host_bytes=1 << 20, cxl_bytes=1 << 20, disk_bytes=1 << 20, disk_dir=tmp_path),
        INVENTORY,
    )
    assert [s.spec.name for s in stores] == ["host", "cxl", "disk"]
    assert stores[1].spec.emulated and "emulated" in stores[1].spec.backing
    for s in stores:
        s.close()


def _tiers(tmp_path: Path, k: int, **kwargs: int) -> TieredKV:
    config = TierConfig(
        k,
        host_bytes=kwargs.get("host", 2 * NBYTES + 8192),
        cxl_bytes=kwargs.get("cxl", 0),
        disk_bytes=kwargs.get("disk", 0),
        disk_dir=tmp_path,
        device_tier="host-stand-in",  # the GPU tier: test_kv_tier_device.py
    )
    return open_tiered_kv(config, INVENTORY)


def test_k_on_device_rest_demoted_then_promoted(tmp_path: Path) -> None:
    tiers = _tiers(tmp_path, 2, disk=1 << 24)
    kvs = [_kv(i) for i in range(5)]
    originals = [[bytes(t) for la in kv.layers for t in la] for kv in kvs]
    for kv in kvs:
        tiers.admit(kv)
    assert sorted(tiers.on_device()) == [0, 1]  # the queue's head stays, the tail goes
    assert {tiers.tier_of(i) for i in (2, 3, 4)} <= {"host", "disk"}
    assert all(kvs[i].layers == [] for i in (2, 3, 4))
    for kv, original in zip(kvs, originals, strict=True):
        ticket = tiers.begin_decode(kv, 4)
        ticket.wait()
        assert tiers.tier_of(kv.request_id) == DEVICE and len(tiers.on_device()) <= 2
        assert [bytes(t) for la in kv.layers for t in la] == original
        tiers.end_decode(ticket, 0.01, 4)
        trail = tiers.forget(kv.request_id)
        assert trail is not None and trail.tiers[0] == DEVICE and trail.tiers[-1] == DEVICE
    assert tiers.counters["demotions"] == tiers.counters["promotions"] >= 3
    assert tiers.bytes_moved[(DEVICE, "host")] >= 2 * NBYTES
    tiers.close()


def test_a_decoded_kv_gives_its_device_slot_to_a_prefetch(tmp_path: Path) -> None:
    tiers = _tiers(tmp_path, 1)
    a, b = _kv(0), _kv(1)
    tiers.admit(a)
    tiers.admit(b)
    assert tiers.on_device() == [0] and tiers.tier_of(1) == "host"
    ticket = tiers.begin_decode(a, 4)
    ticket.wait()
    tiers.end_decode(ticket, 0.01, 4)  # decoded, not released yet: b is prefetched
    tiers.begin_decode(b, 4).wait()
    assert tiers.counters["prefetches"] == 1 and tiers.counters["demotions"] == 1
    assert tiers.on_device() == [1] and tiers.tier_of(0) == DEVICE and a.layers
    tiers.close()


def test_disk_full_fails_over_to_the_next_tier(tmp_path: Path) -> None:
    fast_dir, slow_dir = tmp_path / "nvme", tmp_path / "sata"
    fast_dir.mkdir()
    slow_dir.mkdir()
    fast = DiskTierStore(TierSpec("nvme", "disk", 1 << 24, 13e-6, 7.0), fast_dir, direct=False)
    slow = DiskTierStore(TierSpec("sata", "disk", 1 << 24, 50e-6, 0.5), slow_dir)
    config = TierConfig(1, host_bytes=0, disk_bytes=1 << 24, disk_dir=tmp_path)
    tiers = TieredKV(config, [fast, slow], TierSpec(DEVICE, "device", 0, 1e-7, 3350.0))
    tiers._step_s = 100.0  # far-off next use: disk admission allows
    (fast_dir / "kv-1.topkv").symlink_to("/dev/full")
    a, b = _kv(0), _kv(1)
    tiers.admit(a)
    tiers.admit(b)
    assert tiers.tier_of(1) == "sata" and tiers.counters["failovers"] == 1
    assert tiers.failures == {("nvme", "full"): 1}
    assert (
        tiers.trails[1].tiers == [DEVICE, "sata"] and "No space left" in tiers.trails[1].failures[0]
    )
    ticket = tiers.begin_decode(b, 4)
    ticket.wait()
    assert b.layers and tiers.tier_of(1) == DEVICE
    tiers.close()


def test_write_failure_refuses_and_loses_nothing(tmp_path: Path) -> None:
    tiers = _tiers(tmp_path, 1, host=NBYTES + 4096, disk=1 << 24)
    disk = tiers.stores["disk"]
    assert isinstance(disk, DiskTierStore)
    disk.direct_io = False
    a, b, c = (_kv(i) for i in range(3))
    tiers.admit(a)
    tiers.admit(b)
    assert tiers.tier_of(1) == "host"
    (tmp_path / "kv-2.topkv").symlink_to("/dev/full")
    with pytest.raises(CapacityExceeded, match="No space left"):
        tiers.admit(c)  # c is the least soon needed; disk refuses it with ENOSPC
    assert tiers.tier_of(2) is None and tiers.counters["failovers"] == 1
    assert tiers.counters["refused"] == 1 and tiers.failures[("disk", "full")] == 1
    assert a.layers and tiers.tier_of(0) == DEVICE  # nothing else moved or was lost
    tiers.close()


def test_lost_disk_copy_fails_the_decode_not_the_tokens(tmp_path: Path) -> None:
    tiers = _tiers(tmp_path, 1, host=0, disk=1 << 24)
    a, b = _kv(0), _kv(1)
    tiers.admit(a)
    tiers.admit(b)
    assert tiers.tier_of(1) == "disk"
    (tmp_path / "kv-1.topkv").unlink()
    ticket = tiers.begin_decode(b, 4)
    with pytest.raises(TierKVLost, match="deleted"):
        ticket.wait()
    assert tiers.counters["lost"] == 1 and b.layers == []
    tiers.close()
