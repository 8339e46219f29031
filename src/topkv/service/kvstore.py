"""KV buffers a worker holds: produced by (stand-in) prefill, or received from a peer.

Prefill here is a stand-in for a model: :func:`synthetic_kv` fills each tensor with
deterministic pseudo-random bytes seeded by the request id and model id, so any process can
tell which bytes a request *should* have. The real-model path lives in :mod:`topkv.engine`.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from topkv.relay.executor import kv_digest
from topkv.service.errors import ServiceError
from topkv.transport.base import KVLayout, LayerTensors
from topkv.wire import crc64


class CapacityExceeded(ServiceError):
    """The worker already holds as many KV caches as its capacity allows."""


class UnknownKV(ServiceError):
    """The worker holds no KV cache for this request."""


@dataclass
class HeldKV:
    """One request's KV cache held by a worker, with the CRC-64 of every tensor."""

    request_id: int
    model_id: str
    layout: KVLayout
    layers: list[LayerTensors]
    crcs: list[tuple[int, ...]]
    origin: str
    medium: str = ""
    release: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def digest(self) -> int:
        return kv_digest([crc for layer in self.crcs for crc in layer])

    def free(self) -> None:
        release, self.release = self.release, None
        self.layers = []
        if release is not None:
            release()


def _seed(request_id: int, model_id: str) -> int:
    return (request_id << 32) ^ zlib.crc32(model_id.encode())


def synthetic_kv(request_id: int, model_id: str, layout: KVLayout) -> HeldKV:
    """Deterministic pseudo-random KV for ``request_id`` (a stand-in for a prefill's output)."""
    rng = np.random.default_rng(_seed(request_id, model_id))
    layers: list[LayerTensors] = []
    crcs: list[tuple[int, ...]] = []
    for _ in range(layout.num_layers):
        tensors = tuple(
            memoryview(rng.bytes(layout.tensor_bytes)) for _ in range(layout.tensors_per_layer)
        )
        layers.append(tensors)
        crcs.append(tuple(crc64(t) for t in tensors))
    return HeldKV(request_id, model_id, layout, layers, crcs, origin="prefill")


def received_kv(
    request_id: int,
    model_id: str,
    layout: KVLayout,
    layers: list[LayerTensors],
    medium: str,
    release: Callable[[], None],
) -> HeldKV:
    """Wrap bytes a sink delivered, checksumming every tensor from the bytes actually held."""
    crcs = [tuple(crc64(t) for t in layer) for layer in layers]
    return HeldKV(request_id, model_id, layout, layers, crcs, "received", medium, release)


class KVStore:
    """Thread-safe map request id -> :class:`HeldKV`, bounded by a capacity."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._held: dict[int, HeldKV] = {}
        self._lock = threading.Lock()

    def reserve_check(self, request_id: int) -> None:
        with self._lock:
            if request_id not in self._held and len(self._held) >= self.capacity:
                raise CapacityExceeded(
                    f"worker holds {len(self._held)} KV caches, its capacity; "
                    f"release one before adding request {request_id}"
                )

    def put(self, kv: HeldKV) -> None:
        with self._lock:
            old = self._held.get(kv.request_id)
            if old is None and len(self._held) >= self.capacity:
                raise CapacityExceeded(
                    f"worker holds {len(self._held)} KV caches, its capacity; "
                    f"release one before adding request {kv.request_id}"
                )
            self._held[kv.request_id] = kv
        if old is not None and old is not kv:
            old.free()

    def get(self, request_id: int) -> HeldKV:
        with self._lock:
            kv = self._held.get(request_id)
        if kv is None:
            raise UnknownKV(f"this worker holds no KV for request {request_id}")
        return kv

    def pop(self, request_id: int) -> HeldKV | None:
        with self._lock:
            return self._held.pop(request_id, None)

    def all(self) -> list[HeldKV]:
        with self._lock:
            return list(self._held.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def clear(self) -> None:
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for kv in held:
            kv.free()
