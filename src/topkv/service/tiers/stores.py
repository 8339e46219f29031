"""Where a demoted KV cache's bytes go: a memory tier (host DRAM, CXL, emulated CXL) in a
bounded arena (:class:`MemoryTierStore`), or a disk tier of one file of per-layer wire
frames per KV (:class:`DiskTierStore`). Both are synchronous and thread-safe: ``write``
copies a KV's tensors in, ``read`` copies them back (a lost or corrupted copy is a
:class:`TierKVLost`, never wrong bytes), ``drop`` frees them. Design: ``docs/tiers.md``.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from topkv.policy.tiers import TierSpec
from topkv.service.errors import ServiceError
from topkv.service.kvstore import HeldKV, PrefillFailed
from topkv.service.tiers.arena import PAGE, Arena, ArenaFull, HeldBlocks
from topkv.transport.base import KVLayout, LayerTensors
from topkv.transport.emulated import LinkSlots
from topkv.wire.errors import WireError
from topkv.wire.frame import decode_layer_frame, encode_layer_frame
from topkv.wire.header import HEADER_SIZE

#: Staging buffer of a direct write or read: this many bytes per system call.
IO_CHUNK = 8 << 20


class TierFull(ServiceError):
    """The tier has no room for this KV (its configured capacity, or the disk is full)."""


class TierWriteFailed(ServiceError):
    """Writing a KV into the tier failed; the KV is still where it was."""


class TierKVLost(PrefillFailed):
    """A KV's copy in a tier cannot be read back intact (deleted, corrupted, unreadable):
    the request must be recomputed."""


def _round_up(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


class _Pacer:
    """An emulated tier's occupancy: one copy at a time, each ``dilation`` x its model time."""

    def __init__(self, spec: TierSpec, dilation: float) -> None:
        self.spec, self.dilation, self.slots = spec, dilation, LinkSlots()

    def pace(self, started: float, nbytes: int) -> None:
        slot = self.slots.book(started, self.dilation * self.spec.seconds(nbytes))
        delay = slot.end - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


class MemoryTierStore(HeldBlocks):
    """KV copies in one bounded arena (host DRAM, a CXL node, or emulated CXL)."""

    def __init__(self, spec: TierSpec, arena: Arena, *, dilation: float = 1.0) -> None:
        self.spec = spec
        self.arena = arena
        self._pacer = _Pacer(spec, dilation) if spec.emulated else None
        HeldBlocks.__init__(self, arena)

    @property
    def used_bytes(self) -> int:
        return self.arena.used

    @property
    def free_bytes(self) -> int:
        return self.arena.capacity - self.arena.used

    def write(self, kv: HeldKV) -> None:
        """Copy ``kv``'s tensors into this tier (under its request id)."""
        key, layers, layout = kv.request_id, kv.layers, kv.layout
        started = time.perf_counter()
        nbytes = layout.total_bytes
        try:
            block = self.arena.allocate(nbytes)
        except ArenaFull as exc:
            raise TierFull(f"tier {self.spec.name}: {exc}") from None
        dst = self.arena.block_view(block, nbytes)
        offset = 0
        for layer in layers:
            for tensor in layer:
                dst[offset : offset + tensor.nbytes] = tensor.cast("B")
                offset += tensor.nbytes
        with self._lock:
            self._blocks[key] = (block, nbytes)
        if self._pacer is not None:
            self._pacer.pace(started, nbytes)

    def read(
        self,
        key: int,
        layout: KVLayout,
        crcs: Sequence[tuple[int, ...]],
        out: memoryview | None = None,
    ) -> list[LayerTensors]:
        """Copies of every tensor, in ``out`` (device memory the caller holds) or in fresh
        memory; the caller's CRCs are not re-checked (memory, not a medium)."""
        started = time.perf_counter()
        with self._lock:
            found = self._blocks.get(key)
        if found is None:
            raise TierKVLost(f"tier {self.spec.name} holds no copy of request {key}")
        block, nbytes = found
        dst = memoryview(bytearray(nbytes)) if out is None else out[:nbytes]
        dst[:] = self.arena.block_view(block, nbytes)
        if self._pacer is not None:
            self._pacer.pace(started, nbytes)
        return _split(dst, layout)

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
        self.arena.close()


def _split(buf: memoryview, layout: KVLayout) -> list[LayerTensors]:
    size = layout.tensor_bytes
    per = layout.tensors_per_layer
    return [
        tuple(buf[(i * per + t) * size : (i * per + t + 1) * size] for t in range(per))
        for i in range(layout.num_layers)
    ]


def _aligned(nbytes: int) -> mmap.mmap:
    """Page-aligned (anonymous maps are), populated up front (no fault per page later)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, max(_round_up(nbytes), PAGE), flags=flags)


def probe_direct_io(directory: Path) -> str | None:
    """``None`` where ``O_DIRECT`` writes work in ``directory``, else why not."""
    probe = directory / f".topkv-direct-probe-{os.getpid()}"
    buf = _aligned(PAGE)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    except OSError as exc:
        return f"O_DIRECT open refused ({os.strerror(exc.errno or 0)})"
    try:
        os.write(fd, buf)
    except OSError as exc:
        return f"O_DIRECT write refused ({os.strerror(exc.errno or 0)})"
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)
        buf.close()
    return None


def check_directory(directory: Path) -> None:
    """Refuse a disk-tier directory that is missing, not a directory or not writable."""
    if not directory.is_dir():
        raise ServiceError(f"KV disk tier: {directory} is not a directory (create it first)")
    probe = directory / f".topkv-write-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as exc:
        raise ServiceError(
            f"KV disk tier: cannot write in {directory} ({os.strerror(exc.errno or 0)}); "
            "give a writable --kv-tier-dir"
        ) from None


class DiskTierStore:
    """One file of per-layer wire frames per KV, direct I/O where the filesystem allows."""

    def __init__(self, spec: TierSpec, directory: Path, *, direct: bool | None = None) -> None:
        """``direct``: None probes ``O_DIRECT`` in ``directory``; False never uses it."""
        check_directory(directory)
        self.directory = directory
        why_not = probe_direct_io(directory) if direct is not False else "turned off"
        self.direct_io = why_not is None
        self.io_note = "O_DIRECT" if why_not is None else f"page cache: {why_not}"
        self.spec = replace(spec, backing=f"{directory} ({self.io_note})")
        self._sizes: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    @property
    def free_bytes(self) -> int:
        return self.spec.capacity_bytes - self.used_bytes

    def file_bytes(self, key: int) -> int | None:
        """Bytes of ``key``'s file (its frames, each padded to 4 KiB), if held."""
        with self._lock:
            return self._sizes.get(key)

    def path(self, key: int) -> Path:
        return self.directory / f"kv-{key}.topkv"

    def _flags(self) -> int:
        return os.O_DIRECT if self.direct_io else 0

    def write(self, kv: HeldKV) -> None:
        """Copy ``kv``'s tensors into this tier (under its request id)."""
        key, layers, crcs, layout = kv.request_id, kv.layers, kv.crcs, kv.layout
        frames = [
            self._frame(key, i, layer, crc, layout)
            for i, (layer, crc) in enumerate(zip(layers, crcs, strict=True))
        ]
        size = sum(_round_up(sum(p.nbytes for p in parts)) for parts in frames)
        with self._lock:
            if sum(self._sizes.values()) + size > self.spec.capacity_bytes:
                raise TierFull(
                    f"tier {self.spec.name}: {size:,} bytes do not fit "
                    f"({self.spec.capacity_bytes - sum(self._sizes.values()):,} of "
                    f"{self.spec.capacity_bytes:,} free)"
                )
            self._sizes[key] = size
        try:
            self._write_file(self.path(key), frames)
        except OSError as exc:
            with self._lock:
                self._sizes.pop(key, None)
            with contextlib.suppress(OSError):
                self.path(key).unlink()
            kind = (
                TierFull
                if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
                else TierWriteFailed
            )
            raise kind(
                f"tier {self.spec.name}: writing {self.path(key)} failed: "
                f"{os.strerror(exc.errno or 0)}"
            ) from None

    def _frame(
        self, key: int, index: int, layer: LayerTensors, crc: tuple[int, ...], layout: KVLayout
    ) -> list[memoryview]:
        """Layer ``index`` as one wire frame (header with the KV's own CRC-64s, K, V)."""
        frame = encode_layer_frame(
            layer[0],
            None if layout.latent else layer[1],
            request_id=str(key),
            model_id=0,
            dtype=layout.dtype,
            seq_len=layout.seq_len,
            layers=layout.num_layers,
            layer_index=index,
            kv_heads=layout.kv_heads,
            head_dim=layout.head_dim,
            k_crc=crc[0],
            v_crc=None if layout.latent else crc[1],
        )
        return [b.cast("B") if b.format != "B" else b for b in frame.buffers]

    def _write_file(self, path: Path, frames: list[list[memoryview]]) -> None:
        """Stage the frames into aligned chunks; a writer thread writes one chunk while the
        next is filled (double buffering), so copying and the disk overlap."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | self._flags(), 0o600)
        stages = [memoryview(_aligned(IO_CHUNK)), memoryview(_aligned(IO_CHUNK))]
        pending: Future[None] | None = None
        with ThreadPoolExecutor(1, thread_name_prefix="kv-disk-write") as writer:
            try:
                fill, current = 0, 0
                for parts in frames:
                    pad = memoryview(bytes(-sum(p.nbytes for p in parts) % PAGE))
                    for part in [*parts, pad]:
                        done = 0
                        while done < part.nbytes:
                            stage = stages[current]
                            n = min(part.nbytes - done, IO_CHUNK - fill)
                            stage[fill : fill + n] = part[done : done + n]
                            fill, done = fill + n, done + n
                            if fill == IO_CHUNK:
                                if pending is not None:
                                    pending.result()
                                pending = writer.submit(_write_all, fd, stage)
                                fill, current = 0, 1 - current
                if pending is not None:
                    pending.result()
                    pending = None
                if fill:
                    _write_all(fd, stages[current][:fill])
                if not self.direct_io:
                    os.fsync(fd)
            finally:
                if pending is not None:
                    with contextlib.suppress(OSError):
                        pending.result()
                os.close(fd)

    def read(
        self,
        key: int,
        layout: KVLayout,
        crcs: Sequence[tuple[int, ...]],
        out: mmap.mmap | None = None,
    ) -> list[LayerTensors]:
        """Every layer read back and its frame's CRC-64 checked (and the caller's CRCs);
        into ``out`` (page-aligned device memory of at least :meth:`file_bytes`) or fresh
        memory. The tensors returned are views of it."""
        path = self.path(key)
        with self._lock:
            size = self._sizes.get(key)
        if size is None:
            raise TierKVLost(f"tier {self.spec.name} holds no copy of request {key}")
        buf = _aligned(size) if out is None or len(out) < size else out
        try:
            fd = os.open(path, os.O_RDONLY | self._flags())
        except FileNotFoundError:
            raise TierKVLost(f"tier {self.spec.name}: {path} was deleted; recompute") from None
        view = memoryview(buf)
        chunks = [(start, min(size, start + IO_CHUNK)) for start in range(0, size, IO_CHUNK)]
        # A reader thread reads the chunks in order while this thread checks each frame
        # whose bytes are in: the disk and the CRC-64 overlap.
        with ThreadPoolExecutor(1, thread_name_prefix="kv-disk-read") as reader:
            reads = [reader.submit(os.preadv, fd, [view[lo:hi]], lo) for lo, hi in chunks]
            try:
                return self._decode(view, reads, size, layout, crcs, path)
            except OSError as exc:
                raise TierKVLost(
                    f"tier {self.spec.name}: reading {path}: {os.strerror(exc.errno or 0)}"
                ) from None
            finally:
                for pending in reads:
                    pending.cancel()
                done = [f for f in reads if not f.cancelled()]
                for f in done:
                    with contextlib.suppress(Exception):
                        f.result()
                os.close(fd)

    def _decode(
        self,
        view: memoryview,
        reads: list[Future[int]],
        size: int,
        layout: KVLayout,
        crcs: Sequence[tuple[int, ...]],
        path: Path,
    ) -> list[LayerTensors]:
        frame_bytes = HEADER_SIZE + layout.layer_bytes
        layers: list[LayerTensors] = []
        offset, got, ready = 0, 0, 0
        for index in range(layout.num_layers):
            while got < offset + frame_bytes and ready < len(reads):
                n = reads[ready].result()
                if n < min(IO_CHUNK, size - ready * IO_CHUNK):
                    got = ready * IO_CHUNK + n  # a short read: the file ends here
                    ready = len(reads)
                    break
                got, ready = got + n, ready + 1
            if offset + frame_bytes > got:
                raise TierKVLost(f"tier {self.spec.name}: {path} is truncated at layer {index}")
            try:
                frame = decode_layer_frame(view[offset : offset + frame_bytes])
            except WireError as exc:
                raise TierKVLost(f"tier {self.spec.name}: {path} layer {index}: {exc}") from None
            tensors = (frame.k,) if frame.v is None else (frame.k, frame.v)
            held = (
                (frame.header.k_crc,)
                if frame.v is None
                else (frame.header.k_crc, frame.header.v_crc)
            )
            if held != tuple(crcs[index]):
                raise TierKVLost(f"tier {self.spec.name}: {path} layer {index} is another KV")
            layers.append(tensors)
            offset += _round_up(frame_bytes)
        return layers

    def drop(self, key: int) -> None:
        with self._lock:
            self._sizes.pop(key, None)
        with contextlib.suppress(OSError):
            self.path(key).unlink()

    def holds(self, key: int) -> bool:
        with self._lock:
            return key in self._sizes

    def close(self) -> None:
        with self._lock:
            keys = list(self._sizes)
        for key in keys:
            self.drop(key)


def _write_all(fd: int, data: memoryview) -> None:
    while data.nbytes:
        n = os.write(fd, data)
        data = data[n:]


TierStore = MemoryTierStore | DiskTierStore
