"""The device tier of a worker's KV tiers: GPU memory where torch sees a GPU
(:class:`TorchDeviceTier`, over a :class:`~topkv.service.tiers.torch_arena.TorchArena`),
else host memory standing in for it (:class:`HostStandIn`), labelled so;
:func:`open_device_tier` chooses (``--device-tier``). Design: ``docs/tiers.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from topkv.errors import ConfigError
from topkv.policy.tiers import PAPER_TIERS, TierSpec
from topkv.service.kvstore import HeldKV
from topkv.service.tiers.arena import HeldBlocks
from topkv.service.tiers.stores import TierFull, TierKVLost
from topkv.service.tiers.torch_arena import (
    CorruptCopy,
    TorchArena,
    TorchArenaFull,
    device_name,
    resolve_device,
)
from topkv.transport.base import KVLayout, LayerTensors

if TYPE_CHECKING:
    import torch

    from topkv.service.tiers.config import TierConfig

DEVICE = "device"
GPU = "gpu"
HOST_STAND_IN = "host-stand-in"
DEVICE_TIER_CHOICES = ("auto", GPU, HOST_STAND_IN)


class DeviceTier(Protocol):
    """Where the K device-resident caches' bytes are."""

    spec: TierSpec
    kind: str  # "gpu", "host-stand-in", or "torch-cpu" (the GPU code on the CPU: tests)

    @property
    def stand_in(self) -> bool: ...
    @property
    def used_bytes(self) -> int: ...
    def fits(self, kv: HeldKV) -> bool: ...
    def hold(self, kv: HeldKV) -> str | None: ...
    def load(self, kv: HeldKV) -> bool: ...
    def unload(self, kv: HeldKV) -> None: ...
    def holds(self, key: int) -> bool: ...
    def drop(self, key: int) -> None: ...
    def describe(self) -> dict[str, object]: ...
    def close(self) -> None: ...


def _spec(capacity_bytes: int, *, stand_in: bool, backing: str) -> TierSpec:
    hbm = PAPER_TIERS["hbm"]
    return TierSpec(
        DEVICE,
        "device",
        capacity_bytes,
        hbm.latency_s,
        hbm.bandwidth_gbps,
        emulated=stand_in,
        backing=backing,
    )


class HostStandIn:
    """The device tier in host memory: a KV on the device keeps its arrival buffers."""

    kind = HOST_STAND_IN

    def __init__(self, device_capacity: int, why: str) -> None:
        self.why = why
        self.spec = _spec(
            0,
            stand_in=True,
            backing=f"host memory standing in for GPU memory ({why}), {device_capacity} KV caches",
        )

    @property
    def stand_in(self) -> bool:
        return True

    @property
    def used_bytes(self) -> int:
        return 0

    def fits(self, kv: HeldKV) -> bool:
        return True

    def hold(self, kv: HeldKV) -> str | None:
        return None  # its bytes stay in kv.layers

    def load(self, kv: HeldKV) -> bool:
        return False

    def unload(self, kv: HeldKV) -> None:
        return None

    def holds(self, key: int) -> bool:
        return False

    def drop(self, key: int) -> None:
        return None

    def describe(self) -> dict[str, object]:
        return {"kind": self.kind, "stand_in": True, "device": None, "why": self.why}

    def close(self) -> None:
        return None


class TorchDeviceTier(HeldBlocks):
    """Device-resident KV in one :class:`TorchArena` (GPU memory on a CUDA device)."""

    def __init__(self, arena: TorchArena, device_capacity: int, why: str = "") -> None:
        self.arena = arena
        self.why = why
        self.device_name = device_name(arena.device)
        self.kind = GPU if arena.cuda else f"torch-{arena.device.type}"
        where = (
            f"GPU memory: {self.device_name}"
            if arena.cuda
            else f"a torch {arena.device.type} tensor standing in for GPU memory"
        )
        self.spec = _spec(
            arena.capacity,
            stand_in=not arena.cuda,
            backing=f"{where}, one {arena.capacity:,}-byte torch.uint8 arena"
            f"{' (pinned staging)' if arena.pinned else ''}, {device_capacity} KV caches",
        )
        HeldBlocks.__init__(self, arena)

    @property
    def stand_in(self) -> bool:
        return not self.arena.cuda

    @property
    def used_bytes(self) -> int:
        return self.arena.used

    @property
    def free_bytes(self) -> int:
        return self.arena.free

    # -- the tier store API (bytes in, bytes out), like MemoryTierStore ------------------------

    def write(self, kv: HeldKV) -> None:
        """Copy ``kv``'s tensors into the arena (under its request id); raises TierFull."""
        nbytes = kv.layout.total_bytes
        try:
            block = self.arena.allocate(nbytes)
        except TorchArenaFull as exc:
            raise TierFull(f"tier {DEVICE}: {exc}") from None
        try:
            self.arena.put(block, [t.cast("B") for layer in kv.layers for t in layer])
        except BaseException:
            self.arena.release(block)
            raise
        with self._lock:
            old = self._blocks.pop(kv.request_id, None)
            self._blocks[kv.request_id] = (block, nbytes)
        if old is not None:
            self.arena.release(old[0])

    def read(
        self,
        key: int,
        layout: KVLayout,
        crcs: Sequence[tuple[int, ...]],
        out: memoryview | None = None,
    ) -> list[LayerTensors]:
        """Every tensor copied back into ``out`` or fresh host memory, each CRC-64 checked:
        a copy that differs is a :class:`TierKVLost` (the request is recomputed)."""
        with self._lock:
            found = self._blocks.get(key)
        if found is None:
            raise TierKVLost(f"tier {DEVICE} holds no copy of request {key}")
        block, _ = found
        per = layout.tensors_per_layer
        sizes = [layout.tensor_bytes] * (layout.num_layers * per)
        flat = [c for layer in crcs for c in layer]
        try:
            views = self.arena.get(block, sizes, flat, out)
        except CorruptCopy as exc:
            raise TierKVLost(
                f"tier {DEVICE} ({self.device_name}): request {key}'s copy is corrupt: "
                f"{exc}; recompute"
            ) from None
        return [tuple(views[i * per : (i + 1) * per]) for i in range(layout.num_layers)]

    # -- residency of a HeldKV (what TieredKV calls) -------------------------------------------

    def fits(self, kv: HeldKV) -> bool:
        """Room for ``kv`` (or it is in already); fragmentation may still refuse it."""
        return self.holds(kv.request_id) or self.arena.free >= kv.layout.total_bytes

    def hold(self, kv: HeldKV) -> str | None:
        """Move ``kv``'s host bytes into the arena and release them; returns why not (the
        arena is full: the KV stays in host memory) or None."""
        with kv.use():
            if not kv.layers:
                return None
            try:
                self.write(kv)
            except TierFull as exc:
                return str(exc)
            release, kv.release = kv.release, None
            kv.layers = []
        if release is not None:
            release()
        return None

    def load(self, kv: HeldKV) -> bool:
        """Host buffers of ``kv``'s device copy for the engine (True if copied); raises
        :class:`TierKVLost` when the copy is corrupt."""
        with kv.use():
            if kv.layers or not self.holds(kv.request_id):
                return False
            kv.layers = self.read(kv.request_id, kv.layout, kv.crcs)
        return True

    def unload(self, kv: HeldKV) -> None:
        """Drop the host copy :meth:`load` made (the device copy stays)."""
        with kv.use():
            if self.holds(kv.request_id):
                kv.layers = []

    def describe(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "stand_in": self.stand_in,
            "device": self.device_name,
            "why": self.why,
            "capacity_bytes": self.arena.capacity,
            "pinned_staging": self.arena.pinned,
        }

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
        self.arena.close()


def choose_device_tier(choice: str) -> tuple[str, str]:
    """``(kind, why)``: ``"gpu"`` or ``"host-stand-in"`` for ``--device-tier choice``;
    ``gpu`` where torch sees none is refused with why."""
    if choice not in DEVICE_TIER_CHOICES:
        raise ConfigError(f"--device-tier must be auto, gpu or host-stand-in, not {choice!r}")
    if choice == HOST_STAND_IN:
        return HOST_STAND_IN, "--device-tier host-stand-in"
    try:
        import torch
    except ImportError:
        why = "torch is not installed (the model extra)"
    else:
        if torch.cuda.is_available():
            return GPU, f"torch {torch.__version__} sees {torch.cuda.device_count()} GPU(s)"
        why = f"torch {torch.__version__} sees no CUDA GPU"
    if choice == GPU:
        raise ConfigError(f"--device-tier gpu: {why}")
    return HOST_STAND_IN, why


def open_device_tier(config: TierConfig, device: torch.device | str | None = None) -> DeviceTier:
    """The device tier ``config`` asks for; ``device`` forces a :class:`TorchDeviceTier` on
    that torch device (``"cpu"`` in tests). A GPU arena larger than the device's free
    memory is refused with both numbers."""
    if device is not None:
        arena = TorchArena(config.device_bytes, resolve_device(device))
        return TorchDeviceTier(arena, config.device_capacity, f"device {device} given")
    kind, why = choose_device_tier(config.device_tier)
    if kind == HOST_STAND_IN:
        return HostStandIn(config.device_capacity, why)
    arena = TorchArena(config.device_bytes, resolve_device("cuda"))
    return TorchDeviceTier(arena, config.device_capacity, why)
