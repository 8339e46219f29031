"""A bounded KV arena in one preallocated ``torch.uint8`` tensor on a torch device: the
device tier's GPU memory on CUDA, tested on ``torch.device("cpu")``. Copies go through two
staging buffers, every segment's CRC-64 checked on the way out; each call blocks its thread
(callers run it off the event loop). torch is imported lazily. Design: ``docs/tiers.md``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from topkv.errors import ConfigError
from topkv.service.errors import ServiceError
from topkv.service.tiers.arena import BlockAccounting
from topkv.transport.arena.protocol import ARENA_ALIGN
from topkv.wire import crc64

if TYPE_CHECKING:
    import torch

#: Bytes per staging buffer (one copy call); two of them are in flight.
STAGE_BYTES = 8 << 20


class TorchArenaFull(ServiceError):
    """The arena has no free run of the size asked for."""


class CorruptCopy(ServiceError):
    """A segment read back does not have the CRC-64 it was written with."""


def _round_up(n: int) -> int:
    return (n + ARENA_ALIGN - 1) // ARENA_ALIGN * ARENA_ALIGN


def _size(n: int) -> str:
    if n < 1 << 30:
        return f"{n / (1 << 20):.1f} MiB ({n:,} bytes)"
    return f"{n / (1 << 30):.2f} GiB ({n:,} bytes)"


def resolve_device(device: torch.device | str) -> torch.device:
    """``device`` as a torch device; a CUDA device without an index gets the current one."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def device_free_bytes(device: torch.device) -> tuple[int, int, str]:
    """``(free, total, source)`` bytes of ``device``: torch's ``cuda.mem_get_info`` for a
    GPU, the host's available and total memory for the CPU."""
    import torch

    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total), "torch.cuda.mem_get_info"
    page = os.sysconf("SC_PAGE_SIZE")
    return (
        page * os.sysconf("SC_AVPHYS_PAGES"),
        page * os.sysconf("SC_PHYS_PAGES"),
        "host available memory",
    )


def device_name(device: torch.device) -> str:
    """``"NVIDIA H200 (cuda:0)"``, or ``"cpu"``."""
    import torch

    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({device})"
    return str(device)


class TorchArena(BlockAccounting):
    """``capacity`` bytes in one ``torch.uint8`` tensor on ``device``, handed out in
    4 KiB-rounded blocks; ``free_bytes`` overrides what the device reports free (tests)."""

    full = TorchArenaFull
    what = "device arena"

    def __init__(
        self,
        capacity: int,
        device: torch.device | str,
        *,
        free_bytes: int | None = None,
        stage_bytes: int = STAGE_BYTES,
    ) -> None:
        import torch

        if capacity <= 0:
            raise ConfigError(f"a device arena needs a positive capacity, got {capacity}")
        self.device = resolve_device(device)
        self.capacity = _round_up(capacity)
        free, total, source = device_free_bytes(self.device)
        if free_bytes is not None:
            free, source = free_bytes, "given"
        if self.capacity > free:
            raise ConfigError(
                f"KV device tier asks for {_size(self.capacity)} on {self.device}; it has "
                f"{_size(free)} free of {_size(total)} ({source})"
            )
        self.cuda = self.device.type == "cuda"
        self.tensor = torch.zeros(self.capacity, dtype=torch.uint8, device=self.device)
        self._stream: torch.cuda.Stream | None = None
        if self.cuda:
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        self.pinned = self.cuda
        self._stages = [  # touched now (zero_), not on the first copy
            torch.empty(stage_bytes, dtype=torch.uint8, pin_memory=self.pinned).zero_()
            for _ in range(2)
        ]
        self._stage_np = [s.numpy() for s in self._stages]
        self._events: list[torch.cuda.Event | None] = [None, None]
        if self.cuda:
            torch.cuda.synchronize(self.device)  # the zeroing is done before any copy
        BlockAccounting.__init__(self, self.capacity, ARENA_ALIGN)
        self._copy = threading.Lock()  # one copy at a time through the staging buffers

    def _check(self, block: tuple[int, int], nbytes: int) -> None:
        offset, size = block
        if offset < 0 or nbytes > size or offset + size > self.capacity:
            raise ServiceError(
                f"{nbytes:,} bytes at {offset:,} do not fit block ({offset:,}, {size:,}) of "
                f"the {self.capacity:,}-byte device arena"
            )

    def _settle(self, stage: int) -> None:
        """Wait until the last copy through staging buffer ``stage`` has completed."""
        event = self._events[stage]
        if event is not None:
            event.synchronize()
            self._events[stage] = None

    def _copy_async(self, dst: torch.Tensor, src: torch.Tensor, stage: int) -> None:
        """``dst.copy_(src)``: on CUDA ``non_blocking`` on the arena's stream, with an
        event that :meth:`_settle` waits on; on the CPU at once, one numpy memcpy on this
        thread (torch's CPU copy spreads over its intra-op threads, slow on a busy host)."""
        import torch

        if self._stream is None:
            np.copyto(dst.numpy(), src.numpy())
            return
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._stream)
        self._events[stage] = event

    def put(self, block: tuple[int, int], segments: Sequence[memoryview]) -> int:
        """Copy ``segments`` back to back into ``block``; returns the bytes written (all
        of them have landed when it returns)."""
        total = sum(s.nbytes for s in segments)
        self._check(block, total)
        chunk = self._stage_np[0].size
        pos, stage = block[0], 0
        with self._copy:
            try:
                for segment in segments:
                    src = np.frombuffer(segment, np.uint8)
                    for lo in range(0, src.size, chunk):
                        n = min(chunk, src.size - lo)
                        self._settle(stage)  # its previous copy has left the buffer
                        self._stage_np[stage][:n] = src[lo : lo + n]
                        self._copy_async(self.tensor[pos : pos + n], self._stages[stage][:n], stage)
                        pos, stage = pos + n, 1 - stage
            finally:
                self._settle(0)
                self._settle(1)
        return total

    def get(
        self,
        block: tuple[int, int],
        sizes: Sequence[int],
        crcs: Sequence[int],
        out: memoryview | None = None,
    ) -> list[memoryview]:
        """Segments of ``sizes`` bytes read back from ``block`` into ``out`` (writable host
        memory of at least their total) or fresh memory, each checked against its CRC-64
        in ``crcs``; raises :class:`CorruptCopy` naming the first that differs."""
        total = sum(sizes)
        if len(crcs) != len(sizes):
            raise ServiceError(f"{len(sizes)} segments, {len(crcs)} CRCs")
        self._check(block, total)
        dst = memoryview(bytearray(total)) if out is None else out.cast("B")[:total]
        if dst.nbytes < total or dst.readonly:
            raise ServiceError(f"get needs {total:,} writable bytes, was given {dst.nbytes:,}")
        dst_np = np.frombuffer(dst, np.uint8)
        chunk = self._stage_np[0].size
        # (segment, offset in the arena, offset in dst, bytes) of every staged copy, in order
        copies = [
            (index, block[0] + start + lo, start + lo, min(chunk, size - lo))
            for index, (start, size) in enumerate(_starts(sizes))
            for lo in range(0, size, chunk)
        ]
        running = [0] * len(sizes)
        with self._copy:
            try:
                for i in range(min(2, len(copies))):  # both buffers in flight first
                    self._fetch(copies[i], i % 2)
                for i, (index, _, at, n) in enumerate(copies):
                    stage = i % 2
                    self._settle(stage)
                    dst_np[at : at + n] = self._stage_np[stage][:n]
                    if i + 2 < len(copies):
                        self._fetch(copies[i + 2], stage)  # overlaps the CRC below
                    running[index] = crc64(dst[at : at + n], running[index])
            finally:
                self._settle(0)
                self._settle(1)
        for index, (got, want) in enumerate(zip(running, crcs, strict=True)):
            if got != want:
                raise CorruptCopy(
                    f"segment {index} read back with CRC-64 {got:#018x}, written with {want:#018x}"
                )
        return [dst[start : start + size] for start, size in _starts(sizes)]

    def _fetch(self, copy: tuple[int, int, int, int], stage: int) -> None:
        _, pos, _, n = copy
        self._copy_async(self._stages[stage][:n], self.tensor[pos : pos + n], stage)

    def close(self) -> None:
        import torch

        with self._copy:
            self._settle(0)
            self._settle(1)
            self._stages, self._stage_np = [], []
            self.tensor = torch.empty(0, dtype=torch.uint8, device=self.device)
        if self.cuda:
            torch.cuda.empty_cache()


def _starts(sizes: Sequence[int]) -> list[tuple[int, int]]:
    out, at = [], 0
    for size in sizes:
        out.append((at, size))
        at += size
    return out
