"""KV buffers a worker holds: produced by its engine's prefill, or received from a peer.

A prefill's KV is held from the moment the prefill starts: :meth:`HeldKV.publish` adds each
layer as the engine finishes it and hands it to every subscribed send at once, so a transfer
can stream layer *i* while later layers still compute; :meth:`HeldKV.finish` marks it whole.
The synthetic engine's bytes (:func:`synthetic_layers`, :func:`synthetic_kv`) are
deterministic pseudo-random, seeded by request id and model id, so any process can tell
which bytes a request *should* have. The real-model path lives in :mod:`topkv.engine`.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from topkv.relay.executor import kv_digest
from topkv.service.errors import ServiceError
from topkv.service.messages import KVSummary, KVTimings, LayoutModel
from topkv.transport.base import KVLayout, LayerTensors
from topkv.wire import crc64

#: ``listener(layer_index, tensors, crcs)``: one published layer (runs on the engine's thread).
LayerListener = Callable[[int, LayerTensors, tuple[int, ...]], None]


class CapacityExceeded(ServiceError):
    """The worker already holds as many KV caches as its capacity allows."""


class UnknownKV(ServiceError):
    """The worker holds no KV cache for this request."""


class PrefillFailed(ServiceError):
    """The engine's prefill of this request failed, or its KV was released before the end."""


@dataclass
class HeldKV:
    """One request's KV cache held by a worker, with the CRC-64 of every tensor.

    ``complete`` is False while the engine's prefill is still publishing layers (see the
    module docstring); ``first_token`` is the token prefill produced (model engines only).
    """

    request_id: int
    model_id: str
    layout: KVLayout
    layers: list[LayerTensors]
    crcs: list[tuple[int, ...]]
    origin: str
    medium: str = ""
    release: Callable[[], None] | None = field(default=None, repr=False)
    complete: bool = True
    first_token: int | None = None
    error: str | None = None
    #: ``time.perf_counter()`` stamps: the engine took the prefill, its forward pass ended,
    #: each layer was published (prefill); each layer landed verified, the whole copy was
    #: verified (received; None where the medium reports no per-layer arrival)
    forward_start_s: float | None = None
    forward_end_s: float | None = None
    ready_s: list[float] = field(default_factory=list)
    arrivals_s: tuple[float | None, ...] = ()
    verified_s: float | None = None
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _listeners: list[LayerListener] = field(default_factory=list, repr=False)
    _on_done: list[Callable[[], None]] = field(default_factory=list, repr=False)
    _in_use: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def producing(cls, request_id: int, model_id: str, layout: KVLayout) -> HeldKV:
        """An empty KV that the engine's prefill is about to fill layer by layer."""
        return cls(request_id, model_id, layout, [], [], origin="prefill", complete=False)

    @property
    def digest(self) -> int:
        return kv_digest([crc for layer in self.crcs for crc in layer])

    @property
    def subscribers(self) -> int:
        """Sends waiting for layers not yet published (each gets them straight from prefill)."""
        with self._cond:
            return len(self._listeners)

    @property
    def ended(self) -> bool:
        """Whole, or failed: no further layer will be published."""
        return self.complete or self.error is not None

    # -- producing ---------------------------------------------------------------------------

    def publish(self, index: int, tensors: LayerTensors, crcs: tuple[int, ...]) -> None:
        """Add layer ``index`` (the next one) and offer it to every subscribed send."""
        with self._cond:
            if self.ended:
                raise PrefillFailed(
                    f"request {self.request_id}: KV released before prefill finished"
                )
            if index != len(self.layers) or index >= self.layout.num_layers:
                raise PrefillFailed(
                    f"request {self.request_id}: engine published layer {index}, expected "
                    f"{len(self.layers)} of {self.layout.num_layers}"
                )
            self.layers.append(tensors)
            self.crcs.append(crcs)
            self.ready_s.append(time.perf_counter())
            for listener in self._listeners:
                listener(index, tensors, crcs)

    def finish(self, first_token: int | None) -> None:
        """Every layer is published: the KV is whole (or, with layers missing, failed)."""

        def whole() -> None:
            if len(self.layers) != self.layout.num_layers:
                self.error = (
                    f"prefill published {len(self.layers)} of {self.layout.num_layers} layers"
                )
            else:
                self.complete = True
                self.first_token = first_token

        self._end(whole)

    def fail(self, reason: str) -> None:
        def failed() -> None:
            self.error = reason

        self._end(failed)

    def _end(self, settle: Callable[[], None]) -> None:
        """Settle the outcome once (under the lock), then wake every waiter."""
        with self._cond:
            if self.ended:
                return
            settle()
            callbacks, self._on_done = self._on_done, []
            self._listeners = []
            self._cond.notify_all()
        for callback in callbacks:
            callback()

    # -- consuming ---------------------------------------------------------------------------

    def subscribe(self, listener: LayerListener) -> Callable[[], None]:
        """Offer ``listener`` the layers published so far (now), then each new one as it is
        published; returns the function that stops the offers."""
        with self._cond:
            for index, (tensors, crcs) in enumerate(zip(self.layers, self.crcs, strict=True)):
                listener(index, tensors, crcs)
            if not self.ended:
                self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._cond:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    def when_ended(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the KV is whole or failed (at once if it already is)."""
        with self._cond:
            if not self.ended:
                self._on_done.append(callback)
                return
        callback()

    def check_whole(self) -> None:
        """Raise :class:`PrefillFailed` unless every layer is here."""
        if self.error is not None:
            raise PrefillFailed(f"request {self.request_id}: {self.error}")
        if not self.complete:
            raise PrefillFailed(f"request {self.request_id}: prefill is still running")

    def use(self) -> threading.Lock:
        """Hold while reading the tensors outside the store (decode): :meth:`free` waits."""
        return self._in_use

    def free(self) -> None:
        self.fail("the KV was released")
        with self._in_use:
            release, self.release = self.release, None
            self.layers = []
        if release is not None:
            release()


def _seed(request_id: int, model_id: str) -> int:
    return (request_id << 32) ^ zlib.crc32(model_id.encode())


def synthetic_layers(
    request_id: int, model_id: str, layout: KVLayout
) -> Iterator[tuple[LayerTensors, tuple[int, ...]]]:
    """Each layer's deterministic pseudo-random tensors and their CRC-64s, in order."""
    rng = np.random.default_rng(_seed(request_id, model_id))
    for _ in range(layout.num_layers):
        tensors = tuple(
            memoryview(rng.bytes(layout.tensor_bytes)) for _ in range(layout.tensors_per_layer)
        )
        yield tensors, tuple(crc64(t) for t in tensors)


def synthetic_kv(request_id: int, model_id: str, layout: KVLayout) -> HeldKV:
    """Deterministic pseudo-random KV for ``request_id`` (a stand-in for a prefill's output)."""
    layers: list[LayerTensors] = []
    crcs: list[tuple[int, ...]] = []
    for tensors, layer_crcs in synthetic_layers(request_id, model_id, layout):
        layers.append(tensors)
        crcs.append(layer_crcs)
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


def summarize(kv: HeldKV) -> KVSummary:
    """The JSON summary of a held KV (what ``GET /v1/kv/{id}`` answers)."""
    return KVSummary(
        request_id=kv.request_id,
        model_id=kv.model_id,
        layout=LayoutModel.of(kv.layout),
        size_bytes=kv.layout.total_bytes,
        digest=kv.digest if kv.complete else 0,
        origin="prefill" if kv.origin == "prefill" else "received",
        medium=kv.medium,
        complete=kv.complete,
        first_token=kv.first_token,
        timings=KVTimings(
            forward_start_s=kv.forward_start_s,
            forward_end_s=kv.forward_end_s,
            layer_ready_s=list(kv.ready_s),
            arrivals_s=list(kv.arrivals_s),
            verified_s=kv.verified_s,
        ),
    )
