"""Fault injection at the transport contract (chaos runs and tests).

:class:`CorruptingSource` wraps any :class:`~topkv.transport.base.TransferSource` and, for a
fraction ``rate`` of transfers, flips one bit of one tensor of one layer *after* the
producer's per-tensor CRC-64 was taken: the frame leaves with its original CRC and corrupted
bytes, which is what a flipped bit on the wire looks like to the receiver. It only acts on
layers sent with ``crcs=`` (otherwise the transport would checksum the damaged copy).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from concurrent.futures import Future

from topkv.transport.base import (
    Buffer,
    OutgoingTransfer,
    TransferDescriptor,
    TransferResult,
    TransferSource,
)


class _CorruptingTransfer(OutgoingTransfer):
    def __init__(self, inner: OutgoingTransfer, flip_layer: int | None, rng: random.Random):
        self.descriptor = inner.descriptor
        self._inner = inner
        self._flip_layer = flip_layer
        self._rng = rng
        self._keep: list[bytearray] = []

    def send_layer(
        self, layer: int, tensors: Sequence[Buffer], crcs: Sequence[int] | None = None
    ) -> None:
        if layer == self._flip_layer and crcs is not None:
            which = self._rng.randrange(len(tensors))
            damaged = bytearray(memoryview(tensors[which]).cast("B"))
            bit = self._rng.randrange(len(damaged) * 8)
            damaged[bit // 8] ^= 1 << (bit % 8)
            self._keep.append(damaged)  # borrowed by the transport until finish() resolves
            tensors = [damaged if i == which else t for i, t in enumerate(tensors)]
        self._inner.send_layer(layer, tensors, crcs)

    def finish(self) -> Future[TransferResult]:
        return self._inner.finish()

    def cancel(self) -> None:
        self._inner.cancel()


class CorruptingSource(TransferSource):
    """Flips one bit in one frame of a fraction ``rate`` of transfers (after the CRC)."""

    def __init__(self, inner: TransferSource, rate: float, seed: int) -> None:
        self.inner = inner
        self.rate = rate
        self.name = inner.name
        self.mode = inner.mode
        self.emulated = inner.emulated
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.injected = 0

    def open(self, descriptor: TransferDescriptor, destination: str) -> OutgoingTransfer:
        with self._lock:
            flip = self._rng.random() < self.rate
            layer = self._rng.randrange(descriptor.layout.num_layers) if flip else None
            rng = random.Random(self._rng.getrandbits(64))
            if flip:
                self.injected += 1
        return _CorruptingTransfer(self.inner.open(descriptor, destination), layer, rng)

    def close(self) -> None:
        self.inner.close()
