"""A link-occupancy pacer over a real medium: the emulated transport the demo streams with.

:class:`topkv.transport.emulated.EmulatedSource` paces layer ``l`` to
``start + dilation * (setup + bytes_through_l / bandwidth)``, counted from the transfer's
start. That is right for a bulk transfer whose bytes are all ready at once, but not for a
stream whose layers appear while prefill still computes: a layer that becomes ready after
its due time would cross the "link" instantly. Here the link is busy with one layer at a
time, exactly as the planner's pipeline model (:func:`topkv.planner.simulate_pipeline`) has
it: layer ``l`` leaves the link at ``max(offered_l, leaves_{l-1}) + dilation * (setup +
bytes_l / bandwidth)``, and only then is it handed to the real medium (shm or tcp), which
moves and verifies the bytes. Each layer is one chunk and pays the setup latency.

``dilation`` stretches modelled link time so that it is measurable next to CPU prefill: a
450 GB/s NVLink paced with dilation 1000 runs at 0.45 GB/s of wall clock. Every result says
``emulated=True`` and carries the factor.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from topkv.demo.errors import DemoError
from topkv.transport.base import (
    Buffer,
    OutgoingTransfer,
    TransferDescriptor,
    TransferResult,
    TransferSource,
    TransportMode,
)
from topkv.transport.errors import TransportError

Clock = Callable[[], float]
Sleep = Callable[[float], None]


class PacedLink:
    """Modelled path: class, bandwidth (decimal GB/s), per-chunk setup, time dilation."""

    def __init__(self, mode: str, bandwidth_gbps: float, setup_s: float, dilation: float) -> None:
        if not (math.isfinite(bandwidth_gbps) and bandwidth_gbps > 0):
            raise DemoError(f"link bandwidth must be positive, got {bandwidth_gbps}")
        if not (math.isfinite(setup_s) and setup_s >= 0):
            raise DemoError(f"link setup latency must be >= 0, got {setup_s}")
        if not (math.isfinite(dilation) and dilation >= 1):
            raise DemoError(f"time dilation must be >= 1, got {dilation}")
        self.mode = mode
        self.bandwidth_gbps = bandwidth_gbps
        self.setup_s = setup_s
        self.dilation = dilation

    def chunk_wall_s(self, nbytes: int) -> float:
        """Wall seconds one chunk of ``nbytes`` occupies the paced link."""
        return self.dilation * (self.setup_s + nbytes / (self.bandwidth_gbps * 1e9))


class _PacedOutgoing(OutgoingTransfer):
    """Books each layer a slot on the link at once; a pacer thread releases it at its end.

    The schedule is ideal (slot ends are computed, not measured after each sleep), so a
    late wake-up of the pacer never delays later layers: the link model stays exact.
    """

    def __init__(self, source: PacedSource, inner: OutgoingTransfer) -> None:
        self.descriptor = inner.descriptor
        self._source = source
        self._inner = inner
        self._start = source.clock()
        self._link_free = self._start
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[
            tuple[float, int, Sequence[Buffer], Sequence[int] | None] | None
        ] = queue.SimpleQueue()
        self._future: Future[TransferResult] = Future()
        self._future.set_running_or_notify_cancel()
        self._finished = False
        #: wall time each layer left the paced link and was handed to the real medium
        self.handed_to_medium: dict[int, float] = {}
        threading.Thread(target=self._pace, name="paced-link", daemon=True).start()

    def send_layer(
        self, layer: int, tensors: Sequence[Buffer], crcs: Sequence[int] | None = None
    ) -> None:
        """Book the layer's slot on the link and return at once."""
        with self._lock:
            if self._finished:
                raise TransportError("send_layer() after finish()")
            begin = max(self._source.clock(), self._link_free)
            self._link_free = begin + self._source.link.chunk_wall_s(
                self.descriptor.layout.layer_bytes
            )
            self._queue.put((self._link_free, layer, tensors, crcs))

    def _pace(self) -> None:
        clock, sleep = self._source.clock, self._source.sleep
        while (item := self._queue.get()) is not None:
            due, layer, tensors, crcs = item
            if (wait := due - clock()) > 0:
                sleep(wait)
            self.handed_to_medium[layer] = clock()
            try:
                self._inner.send_layer(layer, tensors, crcs)
            except Exception as exc:
                with contextlib.suppress(Exception):
                    self._future.set_exception(exc)
                self._inner.cancel()
                return
        inner = self._inner.finish()
        inner.add_done_callback(self._complete)

    def finish(self) -> Future[TransferResult]:
        with self._lock:
            if not self._finished:
                self._finished = True
                self._queue.put(None)
        return self._future

    def _complete(self, inner: Future[TransferResult]) -> None:
        error = inner.exception()
        if error is not None:
            with contextlib.suppress(Exception):
                self._future.set_exception(error)
            return
        result = inner.result()
        wall = self._source.clock() - self._start
        link = self._source.link
        with contextlib.suppress(Exception):
            self._future.set_result(
                TransferResult(
                    request_id=result.request_id,
                    transport=self._source.name,
                    mode=self._source.mode,
                    size_bytes=result.size_bytes,
                    seconds=wall / link.dilation,
                    checksum_verified=result.checksum_verified,
                    emulated=True,
                    dilation=link.dilation,
                    wall_seconds=wall,
                )
            )

    def cancel(self) -> None:
        with self._lock:
            self._finished = True
            self._queue.put(None)
        self._inner.cancel()


class PacedSource(TransferSource):
    """Paces a real :class:`TransferSource` with link occupancy (see the module docstring).

    ``send_layer`` only books the layer's slot and returns at once, so the thread that
    computes the layers may call it directly.
    """

    emulated = True

    def __init__(
        self,
        inner: TransferSource,
        link: PacedLink,
        *,
        clock: Clock = time.perf_counter,
        sleep: Sleep = time.sleep,
    ) -> None:
        self.inner = inner
        self.link = link
        self.clock = clock
        self.sleep = sleep
        try:
            self.mode = TransportMode(link.mode)
        except ValueError:
            raise DemoError(f"no transport mode {link.mode!r}") from None
        self.name = f"emulated-{link.mode}"

    def open(self, descriptor: TransferDescriptor, destination: str) -> OutgoingTransfer:
        return _PacedOutgoing(self, self.inner.open(descriptor, destination))

    def close(self) -> None:
        """The inner source is shared and closed by its owner."""
