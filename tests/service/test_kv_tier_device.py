"""The device tier's torch arena and its use by the tiered KV, on real torch tensors.

The GPU tier's code (:class:`TorchArena`, :class:`TorchDeviceTier`) runs here on
``torch.device("cpu")``: the same class, the same staging and CRC-64 checks, the CPU
tensor standing in for GPU memory (and labelled so). The tests marked ``gpu`` run it on a
CUDA device (pinned staging, non-blocking copies on its own stream, the refusal against
the GPU's real free memory) and skip cleanly without one; ``scripts/gpu-check.sh`` runs
them on a GPU machine.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from topkv.errors import ConfigError
from topkv.service.kvstore import HeldKV, synthetic_kv
from topkv.service.tiers.config import TierConfig
from topkv.service.tiers.device import (
    GPU,
    HOST_STAND_IN,
    HostStandIn,
    TorchDeviceTier,
    choose_device_tier,
    open_device_tier,
)
from topkv.service.tiers.stores import TierFull, TierKVLost
from topkv.service.tiers.tiered import DEVICE, open_tiered_kv
from topkv.topology.tiers import TierInventory
from topkv.transport.base import KVLayout
from topkv.wire import crc64

torch = pytest.importorskip("torch")

from topkv.service.tiers.torch_arena import (  # noqa: E402  (after the torch skip)
    CorruptCopy,
    TorchArena,
    TorchArenaFull,
)

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch sees none)")
LAYOUT = KVLayout(num_layers=4, seq_len=64, kv_heads=2, head_dim=64)  # 128 KiB
NBYTES = LAYOUT.total_bytes
INVENTORY = TierInventory(host_total_bytes=64 << 30, host_available_bytes=32 << 30)
CPU = torch.device("cpu")
#: The same tests on the CPU here and, where torch sees one, on a CUDA GPU.
DEVICES = pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[needs_cuda, pytest.mark.gpu])]
)


def _kv(rid: int) -> HeldKV:
    kv = synthetic_kv(rid, "m", LAYOUT)
    kv.origin = "received"
    return kv


def _bytes(layers: list[tuple[memoryview, ...]]) -> list[bytes]:
    return [bytes(t) for la in layers for t in la]


def _segments(sizes: list[int], seed: int = 0) -> list[memoryview]:
    gen = torch.Generator().manual_seed(seed)
    return [
        memoryview(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).numpy())
        for n in sizes
    ]


def _tier(capacity: int, device: Any = CPU, stage: int = 64 << 10) -> TorchDeviceTier:
    return TorchDeviceTier(TorchArena(capacity, device, stage_bytes=stage), 2)


def test_torch_is_imported_only_when_a_torch_tier_is_opened() -> None:
    """torch is optional (the model extra): importing the tier modules and opening the
    stand-in never import it."""
    code = (
        "import sys\n"
        "import topkv.service.worker.service, topkv.service.tiers.device\n"
        "import topkv.service.tiers.torch_arena\n"
        "from topkv.service.tiers.config import TierConfig\n"
        "from topkv.service.tiers.device import open_device_tier\n"
        "open_device_tier(TierConfig(1, device_tier='host-stand-in'))\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "open_device_tier(TierConfig(1, device_bytes=1 << 20), 'cpu').close()\n"
        "assert 'torch' in sys.modules\n"
    )
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr


# -- the arena ----------------------------------------------------------------------------------


@DEVICES
@pytest.mark.parametrize("stage", [4096, 64 << 10, 8 << 20])
def test_put_get_round_trip_through_the_staging(device: str, stage: int) -> None:
    """Segments smaller, equal and larger than a staging buffer, odd sizes included."""
    arena = TorchArena(32 << 20, device, stage_bytes=stage)
    assert arena.tensor.dtype == torch.uint8 and arena.tensor.device.type == device
    sizes = [1, 4096, 4097, 100_000, 3 * stage + 7]
    segments = _segments(sizes)
    block = arena.allocate(sum(sizes))
    assert arena.put(block, segments) == sum(sizes)
    got = arena.get(block, sizes, [crc64(s) for s in segments])
    assert [bytes(g) for g in got] == [bytes(s) for s in segments]
    assert bytes(arena.tensor[block[0] : block[0] + 1].cpu().numpy()) == bytes(segments[0])
    out = memoryview(bytearray(sum(sizes) + 10))
    again = arena.get(block, sizes, [crc64(s) for s in segments], out=out)
    assert bytes(again[-1]) == bytes(segments[-1]) and again[0].obj is out.obj
    arena.close()


def test_bounds_are_checked() -> None:
    arena = TorchArena(3 * 4096, CPU)
    assert arena.capacity == 3 * 4096
    block = arena.allocate(4096)
    with pytest.raises(Exception, match="do not fit block"):
        arena.put(block, _segments([4097]))
    with pytest.raises(Exception, match="do not fit block"):
        arena.put((8192, 8192), _segments([10]))  # runs past the arena's end
    with pytest.raises(Exception, match="do not fit block"):
        arena.get(block, [8192], [0])
    with pytest.raises(Exception, match="writable bytes"):
        arena.get(block, [100], [0], out=memoryview(bytearray(10)))
    with pytest.raises(Exception, match="writable bytes"):
        arena.get(block, [100], [0], out=memoryview(bytes(100)))
    with pytest.raises(TorchArenaFull, match="no free run of 12,288"):
        arena.allocate(3 * 4096)
    with pytest.raises(ConfigError, match="positive capacity"):
        TorchArena(0, CPU)


@DEVICES
def test_fragmentation_and_reuse(device: str) -> None:
    """First fit in 4 KiB units: freed holes are reused, neighbours merge again."""
    arena = TorchArena(4 * 4096, device)
    a, b, c = arena.allocate(4096), arena.allocate(4096), arena.allocate(2 * 4096)
    assert arena.used == arena.capacity and (a[0], b[0], c[0]) == (0, 4096, 8192)
    arena.release(a)
    arena.release(c)
    assert arena.free == 3 * 4096
    with pytest.raises(TorchArenaFull, match="no free run of 16,384"):
        arena.allocate(4 * 4096)  # free, but not in one run
    assert arena.allocate(2 * 4096) == (8192, 8192)  # c's hole
    d = arena.allocate(100)
    assert d == (0, 4096)  # a's hole
    segment = _segments([100], seed=3)
    arena.put(d, segment)
    assert bytes(arena.get(d, [100], [crc64(segment[0])])[0]) == bytes(segment[0])
    arena.release(b)
    arena.release(d)
    arena.release((8192, 8192))
    assert arena.used == 0 and arena.allocate(4 * 4096) == (0, 4 * 4096)


@DEVICES
def test_a_corrupted_byte_fails_the_crc_check(device: str) -> None:
    arena = TorchArena(1 << 20, device, stage_bytes=4096)
    sizes = [5000, 5000]
    segments = _segments(sizes)
    crcs = [crc64(s) for s in segments]
    block = arena.allocate(sum(sizes))
    arena.put(block, segments)
    arena.tensor[block[0] + 5000 + 4242] ^= 1  # one bit of the second segment
    with pytest.raises(CorruptCopy, match="segment 1 read back with CRC-64"):
        arena.get(block, sizes, crcs)
    arena.tensor[block[0] + 5000 + 4242] ^= 1
    assert [bytes(g) for g in arena.get(block, sizes, crcs)] == [bytes(s) for s in segments]


def test_more_than_the_device_has_free_is_refused_with_the_numbers() -> None:
    with pytest.raises(ConfigError, match=r"asks for 1\.0 MiB .* on cpu; it has 0\.5 MiB"):
        TorchArena(1 << 20, CPU, free_bytes=512 << 10)
    with pytest.raises(
        ConfigError, match=r"asks for 65536\.00 GiB .* free of .*\(host available memory\)"
    ):
        TorchArena(64 << 40, CPU)  # against this host's real available memory


@DEVICES
def test_copies_run_off_the_event_loop_and_concurrently(device: str) -> None:
    """Four threads put and get their own KV at once while the loop keeps ticking."""
    tier = _tier(8 * NBYTES, device, stage=16 << 10)
    kvs = [_kv(i) for i in range(4)]
    want = [_bytes(kv.layers) for kv in kvs]

    async def main() -> tuple[float, int]:
        ticks, stop = 0, False

        async def ticker() -> None:
            nonlocal ticks
            while not stop:
                ticks += 1
                await asyncio.sleep(0.001)

        def churn(kv: HeldKV, expect: list[bytes]) -> None:
            for _ in range(20):
                tier.write(kv)
                assert _bytes(tier.read(kv.request_id, LAYOUT, kv.crcs)) == expect
                tier.drop(kv.request_id)

        ticking = asyncio.create_task(ticker())
        started = time.perf_counter()
        await asyncio.gather(
            *(asyncio.to_thread(churn, kv, w) for kv, w in zip(kvs, want, strict=True))
        )
        took = time.perf_counter() - started
        stop = True
        await ticking
        return took, ticks

    took, ticks = asyncio.run(main())
    assert tier.used_bytes == 0
    assert ticks >= 5 and ticks >= took / 0.001 / 20  # the loop ran all along
    tier.close()


# -- the tier store and residency ---------------------------------------------------------------


@DEVICES
def test_store_write_read_full_and_corrupt(device: str) -> None:
    tier = _tier(NBYTES + 4096, device)
    a, b = _kv(1), _kv(2)
    tier.write(a)
    assert tier.holds(1) and tier.used_bytes == NBYTES and tier.fits(a) and not tier.fits(b)
    with pytest.raises(TierFull, match="tier device: device arena"):
        tier.write(b)
    assert _bytes(tier.read(1, LAYOUT, a.crcs)) == _bytes(a.layers)
    with pytest.raises(TierKVLost, match="holds no copy of request 2"):
        tier.read(2, LAYOUT, b.crcs)
    tier.arena.tensor[NBYTES - 1] ^= 0xFF
    with pytest.raises(TierKVLost, match=r"request 1's copy is corrupt.*recompute"):
        tier.read(1, LAYOUT, a.crcs)
    tier.drop(1)
    assert tier.used_bytes == 0 and not tier.holds(1)
    tier.close()


@DEVICES
def test_hold_load_unload_release_the_host_buffers(device: str) -> None:
    tier = _tier(4 * NBYTES, device)
    kv = _kv(7)
    want = _bytes(kv.layers)
    released = threading.Event()
    kv.release = released.set
    assert tier.hold(kv) is None
    assert kv.layers == [] and released.is_set() and tier.holds(7)
    assert tier.load(kv) and _bytes(kv.layers) == want
    assert not tier.load(kv)  # already in host memory
    tier.unload(kv)
    assert kv.layers == [] and tier.holds(7)
    full = _tier(NBYTES // 2, device)
    other = _kv(8)
    assert "no free run" in (full.hold(other) or "") and other.layers  # kept in host memory
    tier.close()
    full.close()


def test_choice_and_labels() -> None:
    if CUDA:
        assert choose_device_tier("auto")[0] == GPU
    else:
        kind, why = choose_device_tier("auto")
        assert kind == HOST_STAND_IN and "sees no CUDA GPU" in why
        with pytest.raises(ConfigError, match=r"--device-tier gpu: torch .* sees no CUDA GPU"):
            choose_device_tier("gpu")
    assert choose_device_tier("host-stand-in")[0] == HOST_STAND_IN
    with pytest.raises(ConfigError, match="auto, gpu or host-stand-in"):
        choose_device_tier("tpu")
    with pytest.raises(ConfigError, match="auto, gpu or host-stand-in"):
        TierConfig(1, device_tier="tpu")
    stand_in = open_device_tier(TierConfig(1, device_tier="host-stand-in"))
    assert isinstance(stand_in, HostStandIn) and stand_in.spec.emulated
    assert "standing in for GPU memory" in stand_in.spec.backing
    cpu = open_device_tier(TierConfig(2, device_bytes=1 << 20), CPU)
    assert cpu.kind == "torch-cpu" and cpu.stand_in and cpu.spec.emulated
    assert "torch cpu tensor standing in for GPU memory" in cpu.spec.backing
    assert cpu.describe()["device"] == "cpu"
    cpu.close()


# -- the tiered KV over the torch arena ---------------------------------------------------------


def _tiers(
    tmp_path: Path, k: int, device_bytes: int, host: int = 8 * NBYTES, device: str = "cpu"
) -> Any:
    config = TierConfig(k, host_bytes=host, device_bytes=device_bytes, disk_dir=tmp_path)
    return open_tiered_kv(config, INVENTORY, torch_device=device)


@DEVICES
def test_k_on_device_in_the_arena_demoted_promoted_token_bytes_identical(
    tmp_path: Path, device: str
) -> None:
    tiers = _tiers(tmp_path, 2, 4 * NBYTES, device=device)
    device = tiers.device_tier
    kvs = [_kv(i) for i in range(5)]
    originals = [_bytes(kv.layers) for kv in kvs]
    for kv in kvs:
        tiers.admit(kv)
    assert sorted(tiers.on_device()) == [0, 1]
    assert device.holds(0) and device.holds(1) and device.used_bytes == 2 * NBYTES
    assert all(kv.layers == [] for kv in kvs)  # on the device: in the arena, not the host
    for kv, original in zip(kvs, originals, strict=True):
        ticket = tiers.begin_decode(kv, 4)
        ticket.wait()
        assert _bytes(kv.layers) == original  # the engine's host copy, CRC-64 checked
        assert device.holds(kv.request_id)
        tiers.end_decode(ticket, 0.01, 4)
        trail = tiers.forget(kv.request_id)
        assert trail is not None and trail.tiers[-1] == DEVICE
        # every decode waited for its copy out of the arena, part of its promotion time
        assert 0 < trail.exposed_promotion_s <= trail.promotion_s + 1e-3
    assert device.used_bytes == 0
    assert tiers.counters["demotions"] == tiers.counters["promotions"] >= 3
    readings = {(r.tier, r.direction): r for r in tiers.model.snapshot()}
    assert readings[(DEVICE, "write")].source != "nominal"  # measured copies into the arena
    assert readings[(DEVICE, "read")].source != "nominal"
    tiers.close()


@DEVICES
def test_a_full_arena_makes_room_else_keeps_host_memory(tmp_path: Path, device: str) -> None:
    tiers = _tiers(tmp_path, 3, NBYTES + 4096, device=device)  # K=3 caches, but bytes for one
    a, b = _kv(0), _kv(1)
    want = _bytes(b.layers)
    tiers.admit(a)
    tiers.admit(b)  # no room for b's bytes: the least soon needed (b) is demoted
    assert tiers.tier_of(0) == DEVICE and tiers.device_tier.holds(0)
    assert tiers.tier_of(1) == "host"
    ticket = tiers.begin_decode(b, 4)
    ticket.wait()  # b comes back: a (not pinned, needed later) makes way
    assert _bytes(b.layers) == want and tiers.device_tier.holds(1)
    assert tiers.tier_of(0) == "host" and tiers.counters["device_full"] == 0
    c = _kv(2)
    c_bytes = _bytes(c.layers)
    tiers.admit(c)  # b is pinned (decoding): c goes down itself
    assert tiers.tier_of(2) == "host"
    tiers.end_decode(ticket, 0.01, 4)
    tiers.forget(1)
    tiers.forget(0)
    ticket = tiers.begin_decode(c, 4)
    ticket.wait()
    assert _bytes(c.layers) == c_bytes
    tiers.close()


@DEVICES
def test_a_corrupted_device_copy_fails_that_decode_not_the_tokens(
    tmp_path: Path, device: str
) -> None:
    tiers = _tiers(tmp_path, 2, 4 * NBYTES, device=device)
    a, b = _kv(0), _kv(1)
    b_bytes = _bytes(b.layers)
    tiers.admit(a)
    tiers.admit(b)
    offset, size = tiers.device_tier._blocks[0][0]
    tiers.device_tier.arena.tensor[offset + size // 2] ^= 1  # one bit of a's copy
    ticket = tiers.begin_decode(a, 4)
    with pytest.raises(TierKVLost, match="request 0's copy is corrupt"):
        ticket.wait()
    assert a.layers == [] and tiers.counters["lost"] == 1
    assert tiers.failures[(DEVICE, "lost")] == 1
    tiers.end_decode(ticket, 0.0, 0)
    tiers.forget(0)
    ticket = tiers.begin_decode(b, 4)
    ticket.wait()  # the other request is unaffected
    assert _bytes(b.layers) == b_bytes
    tiers.close()


# -- on a CUDA GPU (skipped without one) --------------------------------------------------------


@needs_cuda
@pytest.mark.gpu
def test_cuda_arena_round_trip_pinned_and_non_blocking() -> None:
    arena = TorchArena(64 << 20, "cuda", stage_bytes=1 << 20)
    assert arena.tensor.is_cuda and arena.pinned and arena._stages[0].is_pinned()
    sizes = [3 << 20, 1, (5 << 20) + 123]
    segments = _segments(sizes)
    crcs = [crc64(s) for s in segments]
    block = arena.allocate(sum(sizes))
    arena.put(block, segments)
    got = arena.get(block, sizes, crcs)
    assert [bytes(g) for g in got] == [bytes(s) for s in segments]
    on_gpu = arena.tensor[block[0] : block[0] + sizes[0]].cpu().numpy().tobytes()
    assert on_gpu == bytes(segments[0])
    arena.tensor[block[0] + 7] ^= 1
    with pytest.raises(CorruptCopy, match="segment 0"):
        arena.get(block, sizes, crcs)
    arena.close()


@needs_cuda
@pytest.mark.gpu
def test_cuda_arena_refused_against_real_free_memory() -> None:
    free, total = torch.cuda.mem_get_info()
    with pytest.raises(ConfigError, match=r"on cuda:\d+; it has .* free of .*mem_get_info"):
        TorchArena(total + (1 << 30), "cuda")
    assert free <= total


@needs_cuda
@pytest.mark.gpu
def test_auto_chooses_the_gpu_and_labels_it(tmp_path: Path) -> None:
    tiers = open_tiered_kv(TierConfig(2, device_bytes=4 * NBYTES), INVENTORY)
    device = tiers.device_tier
    assert device.kind == GPU and not device.stand_in and not tiers.device.emulated
    assert "GPU memory: " in tiers.device.backing and "cuda:" in str(device.describe()["device"])
    kvs = [_kv(i) for i in range(4)]
    originals = [_bytes(kv.layers) for kv in kvs]
    for kv in kvs:
        tiers.admit(kv)
    for kv, original in zip(kvs, originals, strict=True):
        ticket = tiers.begin_decode(kv, 4)
        ticket.wait()
        assert _bytes(kv.layers) == original
        tiers.end_decode(ticket, 0.01, 4)
        tiers.forget(kv.request_id)
    tiers.close()


def test_worker_status_and_metrics_say_which_device_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    from prometheus_client import generate_latest

    from topkv.service.worker import tiers as worker_tiers

    stand_in = worker_tiers.WorkerTiers(
        TierConfig(1, host_bytes=1 << 20, device_tier="host-stand-in")
    )
    info = stand_in.describe()
    assert info is not None and info["device_tier"] == {
        "kind": "host-stand-in",
        "stand_in": True,
        "device": None,
        "why": "--device-tier host-stand-in",
    }
    text = generate_latest(stand_in.registry).decode()
    assert (
        'topkv_kv_tier_device_info{device="none",kind="host-stand-in",stand_in="true"} 1.0' in text
    )
    assert 'topkv_kv_tier_used_bytes{tier="device"}' not in text  # K caches, no bytes bound
    stand_in.close()
    monkeypatch.setattr(
        worker_tiers,
        "open_tiered_kv",
        lambda config: open_tiered_kv(config, INVENTORY, torch_device="cpu"),
    )
    arena = worker_tiers.WorkerTiers(TierConfig(1, host_bytes=1 << 20, device_bytes=1 << 20))
    info = arena.describe()
    assert info is not None
    assert info["device_tier"]["kind"] == "torch-cpu"  # type: ignore[index]
    assert info["tiers"][0]["emulated"] is True  # type: ignore[index]
    text = generate_latest(arena.registry).decode()
    assert 'topkv_kv_tier_capacity_bytes{emulated="true",tier="device"} 1.048576e+06' in text
    assert 'topkv_kv_tier_used_bytes{tier="device"} 0.0' in text
    arena.close()
