"""A bounded, pre-faulted memory arena for a KV tier, optionally bound to one NUMA node
(``mbind``; a CPU-less node is how CXL memory appears), allocated first-fit in 4 KiB units;
:attr:`Arena.placement` says where the memory really is. Design: ``docs/tiers.md``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import threading

from topkv.service.errors import ServiceError
from topkv.transport.arena.protocol import ARENA_ALIGN
from topkv.transport.arena.protocol import Arena as OffsetArena
from topkv.transport.errors import FrameRejected, ResourceExhausted

PAGE = ARENA_ALIGN  # 4096
_MPOL_BIND = 2
_MPOL_MF_STRICT = 1
_MPOL_MF_MOVE = 2
#: ``mbind`` system call numbers (glibc has no wrapper; libnuma is not required).
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}


class ArenaFull(ServiceError):
    """The arena has no free run of the size asked for."""


def _round_up(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def mbind(buffer: mmap.mmap, node: int) -> str:
    """Bind ``buffer``'s pages to NUMA ``node``; returns the placement text (never raises)."""
    number = _SYS_MBIND.get(platform.machine())
    if number is None:
        return f"not bound to node {node}: no mbind number for {platform.machine()}"
    if not 0 <= node < 1024:
        return f"not bound: node {node} out of range"
    mask = (ctypes.c_ulong * 16)()
    mask[node // 64] = 1 << (node % 64)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    libc = ctypes.CDLL(None, use_errno=True)
    flags = _MPOL_MF_STRICT | _MPOL_MF_MOVE
    rc = libc.syscall(
        number,
        ctypes.c_void_p(addr),
        ctypes.c_ulong(len(buffer)),
        _MPOL_BIND,
        mask,
        ctypes.c_ulong(1024),
        flags,
    )
    if rc != 0:
        err = ctypes.get_errno()
        return f"not bound to node {node}: mbind failed ({os.strerror(err)})"
    return f"numa node {node} (mbind)"


class BlockAccounting:
    """Blocks of ``unit``-rounded sizes over ``capacity`` bytes, first fit (the arena
    transports' allocator), and the bytes handed out: the host arena and the device tier's torch
    arena both count through it. ``full`` is the error a request that finds no free run
    raises, ``what`` names the arena in it."""

    full: type[ServiceError] = ArenaFull
    what = "arena"

    def __init__(self, capacity: int, unit: int) -> None:
        self.capacity = capacity
        self._unit = unit
        self._offsets = OffsetArena(capacity)
        self._lock = threading.Lock()
        self.used = 0

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def allocate(self, nbytes: int) -> tuple[int, int]:
        """``(offset, size)`` of a free block of at least ``nbytes``; raises ``full``."""
        size = -(-max(nbytes, 1) // self._unit) * self._unit
        try:
            offset = self._offsets.allocate(size, timeout=0.0)
        except (ResourceExhausted, FrameRejected):
            raise self.full(
                f"{self.what} of {self.capacity:,} bytes has no free run of {size:,} "
                f"({self.free:,} free)"
            ) from None
        with self._lock:
            self.used += size
        return offset, size

    def release(self, block: tuple[int, int]) -> None:
        self._offsets.free(*block)
        with self._lock:
            self.used -= block[1]


class HeldBlocks:
    """Which request's copy sits in which arena block (``(block, nbytes)`` by request), for
    the stores that keep copies in an arena (host tier and device tier)."""

    def __init__(self, arena: BlockAccounting) -> None:
        self._arena = arena
        self._blocks: dict[int, tuple[tuple[int, int], int]] = {}
        self._lock = threading.Lock()

    def holds(self, key: int) -> bool:
        with self._lock:
            return key in self._blocks

    def drop(self, key: int) -> None:
        with self._lock:
            found = self._blocks.pop(key, None)
        if found is not None:
            self._arena.release(found[0])


class Arena(BlockAccounting):
    """``capacity`` bytes of pre-faulted memory, handed out in page-rounded blocks."""

    def __init__(self, capacity: int, numa_node: int | None = None) -> None:
        if capacity <= 0:
            raise ServiceError(f"an arena needs a positive capacity, got {capacity}")
        self.capacity = _round_up(capacity)
        self.buffer = mmap.mmap(-1, self.capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.placement = (
            "host memory (first touch)" if numa_node is None else mbind(self.buffer, numa_node)
        )
        self.view = memoryview(self.buffer)
        for offset in range(0, self.capacity, PAGE):  # fault every page in now
            self.buffer[offset] = 0
        BlockAccounting.__init__(self, self.capacity, PAGE)

    def block_view(self, block: tuple[int, int], nbytes: int) -> memoryview:
        return self.view[block[0] : block[0] + nbytes]

    def close(self) -> None:
        self.view.release()
        self.buffer.close()
