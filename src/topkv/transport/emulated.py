"""Emulated links: a real transport paced to a modelled mode's bandwidth and setup latency.

This is the paper's ``BandwidthThrottledSink``, but the bytes still really move over the
inner transport (shm or tcp) and are verified. Layer ``l`` is handed to the inner transport
no earlier than ``start + dilation * (setup + bytes_through_l / bandwidth)``, and the transfer
completes no earlier than ``start + dilation * (setup + total / bandwidth)``.

``dilation`` (>= 1) stretches time so that links faster than this machine can move bytes
(NVLink at 450 GB/s on a box that copies at 10 GB/s) are represented honestly: with
``dilation=100`` a 450 GB/s link is paced at 4.5 GB/s of wall clock, and reported durations
are wall time divided by the dilation. Every result says ``emulated=True`` and the factor; if
the inner transport could not keep the pace, the reported time is longer than the model's,
never shorter.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from topkv.transport.base import (
    Buffer,
    OutgoingTransfer,
    TransferDescriptor,
    TransferResult,
    TransferSource,
    TransportMode,
)
from topkv.transport.errors import TransportError


@dataclass(frozen=True)
class LinkModel:
    """The modelled link: one-direction bandwidth (decimal GB/s) and per-transfer setup."""

    mode: TransportMode
    bandwidth_gbps: float
    setup_latency_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth_gbps) and self.bandwidth_gbps > 0):
            raise TransportError(f"bandwidth must be positive, got {self.bandwidth_gbps}")
        if not (math.isfinite(self.setup_latency_s) and self.setup_latency_s >= 0):
            raise TransportError(f"setup latency must be >= 0, got {self.setup_latency_s}")

    def seconds(self, nbytes: int) -> float:
        """Modelled time to move ``nbytes`` (paper Eq. 2: setup + bytes / bandwidth)."""
        return self.setup_latency_s + nbytes / (self.bandwidth_gbps * 1e9)

    @classmethod
    def default(cls, mode: TransportMode | str) -> LinkModel:
        """The reference figures (SPEC.md) from ``topkv.planner.DEFAULT_TRANSPORTS``."""
        from topkv.planner.transports import DEFAULT_TRANSPORTS

        mode = TransportMode(mode)
        spec = DEFAULT_TRANSPORTS[mode.value]
        return cls(mode, spec.bandwidth_gbps, spec.setup_latency_s)


def dilation_for(link: LinkModel, real_gbps: float, headroom: float = 0.5) -> float:
    """Smallest dilation (>= 1) that keeps the paced rate within ``headroom`` of the medium."""
    if real_gbps <= 0:
        raise TransportError(f"real bandwidth must be positive, got {real_gbps}")
    return max(1.0, link.bandwidth_gbps / (real_gbps * headroom))


Clock = Callable[[], float]
Sleep = Callable[[float], None]


class _EmulatedOutgoing(OutgoingTransfer):
    def __init__(self, source: EmulatedSource, inner: OutgoingTransfer) -> None:
        self.descriptor = inner.descriptor
        self._source = source
        self._inner = inner
        self._start = source.clock()
        self._released_bytes = 0
        self._lock = threading.Lock()
        self._future: Future[TransferResult] = Future()
        self._future.set_running_or_notify_cancel()

    def _due(self, nbytes: int) -> float:
        return self._start + self._source.dilation * self._source.link.seconds(nbytes)

    def send_layer(
        self, layer: int, tensors: Sequence[Buffer], crcs: Sequence[int] | None = None
    ) -> None:
        with self._lock:
            self._released_bytes += self.descriptor.layout.layer_bytes
            due = self._due(self._released_bytes)
        wait = due - self._source.clock()
        if wait > 0:
            self._source.sleep(wait)
        self._inner.send_layer(layer, tensors, crcs)

    def finish(self) -> Future[TransferResult]:
        inner = self._inner.finish()
        inner.add_done_callback(self._complete)
        return self._future

    def _complete(self, inner: Future[TransferResult]) -> None:
        error = inner.exception()
        if error is not None:
            with contextlib.suppress(Exception):
                self._future.set_exception(error)
            return
        result = inner.result()
        wait = self._due(self.descriptor.layout.total_bytes) - self._source.clock()
        if wait > 0:
            self._source.sleep(wait)
        wall = self._source.clock() - self._start
        dilation = self._source.dilation
        with contextlib.suppress(Exception):
            self._future.set_result(
                TransferResult(
                    request_id=result.request_id,
                    transport=self._source.name,
                    mode=self._source.mode,
                    size_bytes=result.size_bytes,
                    seconds=wall / dilation,
                    checksum_verified=result.checksum_verified,
                    emulated=True,
                    dilation=dilation,
                    wall_seconds=wall,
                )
            )

    def cancel(self) -> None:
        self._inner.cancel()


class EmulatedSource(TransferSource):
    """Paces a real :class:`TransferSource` to a modelled link (see module docstring).

    ``send_layer`` blocks the caller until the layer's modelled departure time, the way a
    producer would be back-pressured by a slower link. Pair it with the inner transport's
    sink on the receiving side.
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
        if not (math.isfinite(dilation) and dilation >= 1.0):
            raise TransportError(f"dilation must be >= 1, got {dilation}")
        self.inner = inner
        self.link = link
        self.dilation = dilation
        self.clock = clock
        self.sleep = sleep
        self.mode = link.mode
        self.name = f"emulated-{link.mode.value}"

    def open(self, descriptor: TransferDescriptor, destination: str) -> OutgoingTransfer:
        return _EmulatedOutgoing(self, self.inner.open(descriptor, destination))

    def close(self) -> None:
        self.inner.close()
