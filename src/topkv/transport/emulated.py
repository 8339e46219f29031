"""Emulated links: a real transport paced by the occupancy of a modelled link.

This is the paper's ``BandwidthThrottledSink``, but the bytes still really move over the
inner transport (shm or tcp) and are verified by the receiver. Each layer is one chunk on
the modelled link and pays its setup latency, as in the planner's pipeline model
(:func:`topkv.planner.simulate_pipeline`). When ``send_layer`` offers a layer, it is booked
the link's next free slot::

    start  = max(now, link_free_at)
    finish = start + dilation * (setup + layer_bytes / bandwidth)
    link_free_at = finish

and a pacing thread of the transfer hands it to the inner transport no earlier than
``finish``. ``send_layer`` never waits: a producer that computes layers (a prefill forward
pass) calls it as each layer becomes ready, and a layer that becomes ready late still needs
its own slot after it is ready (it does not cross the link instantly). A bulk transfer on
an idle link therefore takes ``dilation * (layers * setup + total / bandwidth)``.

One :class:`EmulatedSource` is one link: concurrent transfers through it share the link's
slots, in the order their layers were offered. Make one source per modelled link (the demo
makes one per transfer, each transfer being its own path). Slots booked by a transfer that
then fails or is cancelled are given back when no later booking depends on them.

``dilation`` (>= 1) stretches time so that links faster than this machine can move bytes
(NVLink at 450 GB/s on a box that copies at 10 GB/s) are represented honestly: with
``dilation=100`` a 450 GB/s link is paced at 4.5 GB/s of wall clock, and reported durations
are wall time divided by the dilation. Every result says ``emulated=True`` and the factor; if
the inner transport could not keep the pace, the reported time is longer than the model's,
never shorter. Clock and sleep are injectable for tests.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from topkv.planner.errors import PlannerInputError
from topkv.planner.transports import DEFAULT_TRANSPORTS, TransportSpec
from topkv.transport.base import (
    Buffer,
    OutgoingTransfer,
    TransferDescriptor,
    TransferResult,
    TransferSource,
    TransportMode,
)
from topkv.transport.errors import TransferCancelled, TransportError
from topkv.transport.stream.sending import check_layer


@dataclass(frozen=True)
class LinkModel:
    """The modelled link: one-direction bandwidth (decimal GB/s) and per-chunk setup."""

    mode: TransportMode
    bandwidth_gbps: float
    setup_latency_s: float

    def __post_init__(self) -> None:
        try:  # the planner's figures of a medium, checked the planner's way
            TransportSpec(TransportMode(self.mode).value, self.bandwidth_gbps, self.setup_latency_s)
        except PlannerInputError as exc:
            raise TransportError(f"link model: {exc}") from None

    def seconds(self, nbytes: int) -> float:
        """Modelled time to move one chunk of ``nbytes`` (paper Eq. 2: setup + bytes / bw)."""
        return self.setup_latency_s + nbytes / (self.bandwidth_gbps * 1e9)

    @classmethod
    def default(cls, mode: TransportMode | str) -> LinkModel:
        """The reference figures (SPEC.md) from ``topkv.planner.DEFAULT_TRANSPORTS``."""
        mode = TransportMode(mode)
        spec = DEFAULT_TRANSPORTS[mode.value]
        return cls(mode, spec.bandwidth_gbps, spec.setup_latency_s)


def dilation_for(link: LinkModel, real_gbps: float, headroom: float = 0.5) -> float:
    """Smallest dilation (>= 1) that keeps the paced rate within ``headroom`` of the medium."""
    if real_gbps <= 0:
        raise TransportError(f"real bandwidth must be positive, got {real_gbps}")
    return max(1.0, link.bandwidth_gbps / (real_gbps * headroom))


def _check_dilation(dilation: float) -> float:
    if not (math.isfinite(dilation) and dilation >= 1.0):
        raise TransportError(f"time dilation must be >= 1, got {dilation}")
    return dilation


Clock = Callable[[], float]
Sleep = Callable[[float], None]


@dataclass(frozen=True)
class Slot:
    """Wall-clock interval during which one chunk occupies the link."""

    start: float
    end: float


class LinkSlots:
    """Busy-until clock of one link: books back-to-back slots (thread-safe, no clock of its own).

    Times are in whatever clock the caller uses; :meth:`book` is the whole policy.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free_at = -math.inf

    @property
    def free_at(self) -> float:
        """When the last booked slot ends (``-inf`` before the first booking)."""
        with self._lock:
            return self._free_at

    def book(self, ready_at: float, duration: float) -> Slot:
        """The first slot of ``duration`` that starts no earlier than ``ready_at``."""
        with self._lock:
            start = max(ready_at, self._free_at)
            self._free_at = start + duration
            return Slot(start, self._free_at)

    def give_back(self, last_end: float, free_at: float) -> bool:
        """Roll the link back to ``free_at`` if nothing was booked after ``last_end``."""
        with self._lock:
            if self._free_at != last_end:
                return False
            self._free_at = free_at
            return True


_Item = tuple[Slot, int, Sequence[Buffer], Sequence[int] | None]


class _EmulatedOutgoing(OutgoingTransfer):
    """Books each offered layer a slot; a pacing thread hands it on at the slot's end."""

    def __init__(self, source: EmulatedSource, inner: OutgoingTransfer) -> None:
        self.descriptor = inner.descriptor
        self._source = source
        self._inner = inner
        self._dilation = source.dilation
        self._chunk_wall_s = self._dilation * source.link.seconds(
            self.descriptor.layout.layer_bytes
        )
        self._start = source.clock()
        self._state = threading.Condition()
        self._handoff = threading.Lock()  # held while the inner transport reads the buffers
        self._pending: deque[_Item] = deque()
        self._finishing = False
        self._aborted = False
        self._last_booked: Slot | None = None
        self._last_handed: Slot | None = None
        self._future: Future[TransferResult] = Future()
        self._future.set_running_or_notify_cancel()
        #: the slot each layer was booked on the link, by layer
        self.slots: dict[int, Slot] = {}
        #: clock time each layer left the link and was handed to the real medium, by layer
        self.handed_to_medium: dict[int, float] = {}
        threading.Thread(
            target=self._pace, name=f"emulated-link-{self.descriptor.request_id}", daemon=True
        ).start()

    def send_layer(
        self, layer: int, tensors: Sequence[Buffer], crcs: Sequence[int] | None = None
    ) -> None:
        """Book the layer's slot on the link and return at once."""
        check_layer(self.descriptor, layer, tensors, crcs)
        with self._state:
            if self._aborted:
                raise TransferCancelled(f"transfer {self.descriptor.request_id} was aborted")
            if self._finishing:
                raise TransportError("send_layer() after finish()")
            slot = self._source.slots.book(self._source.clock(), self._chunk_wall_s)
            self.slots[layer] = slot
            self._last_booked = slot
            self._pending.append((slot, layer, tensors, crcs))
            self._state.notify()

    def finish(self) -> Future[TransferResult]:
        with self._state:
            self._finishing = True
            self._state.notify()
        return self._future

    def cancel(self) -> None:
        if self._future.done():
            return
        self._abort(TransferCancelled(f"transfer {self.descriptor.request_id} cancelled"))

    def _pace(self) -> None:
        clock, sleep = self._source.clock, self._source.sleep
        while True:
            with self._state:
                self._state.wait_for(lambda: self._pending or self._finishing or self._aborted)
                if self._aborted:
                    return
                if not self._pending:
                    break
                slot, layer, tensors, crcs = self._pending.popleft()
            if (wait := slot.end - clock()) > 0:
                sleep(wait)
            with self._handoff:
                if self._aborted:
                    return
                self.handed_to_medium[layer] = clock()
                try:
                    self._inner.send_layer(layer, tensors, crcs)
                except Exception as exc:
                    self._abort(exc, holding_handoff=True)
                    return
                with self._state:
                    self._last_handed = slot
        with self._handoff:
            if self._aborted:
                return
            try:
                inner = self._inner.finish()
            except Exception as exc:
                self._abort(exc, holding_handoff=True)
                return
        inner.add_done_callback(self._complete)

    def _abort(self, error: BaseException, *, holding_handoff: bool = False) -> None:
        """Stop pacing, give unused slots back, cancel the inner transfer, fail the future."""
        with self._state:
            if self._aborted:
                return
            self._aborted = True
            self._pending.clear()
            last_booked, last_handed = self._last_booked, self._last_handed
            self._state.notify()
        if last_booked is not None and last_booked is not last_handed:
            handed_end = last_handed.end if last_handed is not None else -math.inf
            self._source.slots.give_back(last_booked.end, max(self._source.clock(), handed_end))
        if holding_handoff:
            self._inner.cancel()
        else:
            with self._handoff:  # wait until the inner transport no longer reads our buffers
                self._inner.cancel()
        with contextlib.suppress(Exception):
            self._future.set_exception(error)

    def _complete(self, inner: Future[TransferResult]) -> None:
        error = inner.exception()
        if error is not None:
            with contextlib.suppress(Exception):
                self._future.set_exception(error)
            return
        result = inner.result()
        wall = self._source.clock() - self._start
        with contextlib.suppress(Exception):
            self._future.set_result(
                TransferResult(
                    request_id=result.request_id,
                    medium=self._source.name,
                    mode=self._source.mode,
                    size_bytes=result.size_bytes,
                    seconds=wall / self._dilation,
                    checksum_verified=result.checksum_verified,
                    emulated=True,
                    dilation=self._dilation,
                    wall_seconds=wall,
                )
            )


class EmulatedSource(TransferSource):
    """Paces a real :class:`TransferSource` to one modelled link (see the module docstring).

    ``send_layer`` books the layer's slot and returns at once; pair the source with the
    inner transport's sink on the receiving side. ``dilation`` may be changed between
    transfers (a transfer uses the value it was opened with). :meth:`close` closes the
    inner source; a wrapper over a shared medium can simply be dropped instead.
    """

    emulated = True

    def __init__(
        self,
        inner: TransferSource,
        link: LinkModel,
        *,
        dilation: float = 1.0,
        clock: Clock = time.perf_counter,
        sleep: Sleep = time.sleep,
    ) -> None:
        self.inner = inner
        self.link = link
        self.dilation = _check_dilation(dilation)
        self.clock = clock
        self.sleep = sleep
        self.slots = LinkSlots()
        self.mode = link.mode
        self.name = f"emulated-{link.mode.value}"

    def open(self, descriptor: TransferDescriptor, destination: str) -> OutgoingTransfer:
        _check_dilation(self.dilation)
        return _EmulatedOutgoing(self, self.inner.open(descriptor, destination))

    def close(self) -> None:
        self.inner.close()
