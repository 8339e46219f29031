"""Transfer manager: runs a transfer plan over ranked transports, with failover.

A :class:`TransferPlan` names what to move (a descriptor and the source's per-layer tensors),
where to (the receiver's sink address for each medium it listens on) and how (media in rank
order, e.g. from a policy :class:`~topkv.policy.select.Selection` via
:meth:`TransferPlan.from_selection`). :meth:`TransferManager.submit` starts it on a worker
thread and returns a :class:`TransferHandle` at once::

    manager = TransferManager(secret)
    handle = manager.submit(plan, callback=lambda outcome_future: ...)
    handle.layer_ready(0) ...                # only for streaming plans (see below)
    outcome = handle.result(timeout=30)      # TransferOutcome, or raises
    handle.cancel()                          # stop: TransferCancelled, no failover

Per-layer streaming
    With ``plan.streaming=True`` the producer calls :meth:`TransferHandle.layer_ready` as each
    layer's KV is computed; layer ``l`` is handed to the transport as soon as it is ready, so
    the transfer overlaps with the rest of prefill. Otherwise every layer is sent at once.

Verification
    The sinks verify every layer's CRC-64 as it lands (streamed per chunk on tcp, in place on
    shm) and acknowledge only a verified copy; a transfer counts as delivered only on that
    acknowledgement. CRCs given in ``plan.crcs`` are reused for every attempt; otherwise the
    transport computes them while sending.

Failure, failover, cancellation and timeouts
    When an attempt fails with a :class:`TransportError` (peer died, checksum mismatch,
    refused, attempt timed out, transport unavailable), the next medium in the plan's list is
    tried, re-sending every layer from the source buffers (the transport contract guarantees
    nothing is lost: the source keeps its buffers). :class:`TransferCancelled` - from
    :meth:`TransferHandle.cancel` or from the receiver - ends the transfer at once, without
    failover. ``plan.timeout_s`` bounds the whole transfer (every attempt and every wait for a
    streaming layer); ``plan.attempt_timeout_s`` bounds each attempt, after which it is
    cancelled and the next medium is tried. When every medium failed, the future fails with
    :class:`TransferFailed` carrying each attempt's error.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from topkv.transport import registry
from topkv.transport.base import (
    Buffer,
    OutgoingTransfer,
    ReceivedKV,
    TransferDescriptor,
    TransferResult,
    TransferSink,
    TransferSource,
)
from topkv.transport.errors import (
    FrameRejected,
    TransferCancelled,
    TransferTimeout,
    TransportError,
)
from topkv.transport.shm import ShmSink

if TYPE_CHECKING:
    from topkv.policy.select import Selection

#: Which medium moves each path class of a policy :class:`Selection` on this machine.
PATH_MEDIA: Mapping[str, str] = {
    "nvlink": "emulated-nvlink",
    "nvswitch": "emulated-nvswitch",
    "xgmi": "emulated-nvlink",
    "pcie": "shm",
    "rdma": "emulated-rdma",
    "tcp": "tcp",
}

Clock = Callable[[], float]


class TransferFailed(TransportError):
    """Every medium of a plan failed; ``attempts`` says how each one did."""

    def __init__(self, message: str, attempts: Sequence[AttemptRecord]) -> None:
        super().__init__(message)
        self.attempts = tuple(attempts)


@dataclass(frozen=True)
class AttemptRecord:
    """One attempt of a plan on one medium."""

    transport: str
    seconds: float
    error: str | None = None
    error_type: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class TransferOutcome:
    """A delivered transfer: the acknowledged result and every attempt made."""

    result: TransferResult
    transport: str
    attempts: tuple[AttemptRecord, ...]
    seconds: float

    @property
    def failovers(self) -> int:
        return len(self.attempts) - 1


def sink_kind(medium: str) -> str:
    """The kind of sink that receives ``medium`` (``shm`` or ``tcp`` for built-in media)."""
    info = registry.get(medium)
    if not info.emulated:
        return info.name
    return "shm" if info.make_sink is ShmSink else "tcp"


@dataclass(frozen=True)
class TransferPlan:
    """What to move, where, and over which media in rank order.

    ``layers[l]`` are layer ``l``'s tensors (K, V) or (latent,): C-contiguous buffers of
    ``layout.tensor_bytes`` each, borrowed read-only until the handle's future resolves.
    ``destination`` maps a medium name or a sink kind (``shm``, ``tcp``) to the receiver's
    sink address. ``transports`` are medium names (see :mod:`topkv.transport.registry`).
    """

    descriptor: TransferDescriptor
    layers: Sequence[Sequence[Buffer]]
    destination: Mapping[str, str]
    transports: tuple[str, ...]
    crcs: Sequence[Sequence[int]] | None = None
    streaming: bool = False
    timeout_s: float = 60.0
    attempt_timeout_s: float | None = None

    def __post_init__(self) -> None:
        layout = self.descriptor.layout
        if len(self.layers) != layout.num_layers:
            raise FrameRejected(
                f"plan for request {self.descriptor.request_id}: {len(self.layers)} layers of "
                f"buffers for a layout of {layout.num_layers}"
            )
        if self.crcs is not None and len(self.crcs) != layout.num_layers:
            raise FrameRejected(f"plan: {len(self.crcs)} CRC tuples for {layout.num_layers} layers")
        if not self.transports:
            raise TransportError("plan has no transport to try")
        if not self.timeout_s > 0:
            raise TransportError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.attempt_timeout_s is not None and not self.attempt_timeout_s > 0:
            raise TransportError(
                f"attempt_timeout_s must be positive, got {self.attempt_timeout_s}"
            )

    def address_for(self, medium: str) -> str:
        """The receiver's address for ``medium``; raises TransportError when it has none."""
        address = self.destination.get(medium)
        if address is None:
            address = self.destination.get(sink_kind(medium))
        if address is None:
            raise TransportError(
                f"the destination has no sink for {medium!r} "
                f"(it listens on: {', '.join(sorted(self.destination)) or 'nothing'})"
            )
        return address

    @classmethod
    def from_selection(
        cls,
        descriptor: TransferDescriptor,
        layers: Sequence[Sequence[Buffer]],
        destination: Mapping[str, str],
        selection: Selection,
        *,
        media: Mapping[str, str] = PATH_MEDIA,
        crcs: Sequence[Sequence[int]] | None = None,
        streaming: bool = False,
        timeout_s: float = 60.0,
        attempt_timeout_s: float | None = None,
    ) -> TransferPlan:
        """A plan trying the selection's paths in rank order, each through its medium."""
        ranked = tuple(dict.fromkeys(media[t] for t in selection.ranked_transports if t in media))
        if not ranked:
            raise TransportError(
                f"no medium here serves any of {', '.join(selection.ranked_transports)}"
            )
        return cls(
            descriptor,
            layers,
            destination,
            ranked,
            crcs=crcs,
            streaming=streaming,
            timeout_s=timeout_s,
            attempt_timeout_s=attempt_timeout_s,
        )


OutcomeCallback = Callable[["Future[TransferOutcome]"], None]


@dataclass
class TransferHandle:
    """The running transfer of one plan (thread-safe)."""

    plan: TransferPlan
    future: Future[TransferOutcome] = field(default_factory=Future)
    _ready: list[bool] = field(default_factory=list, repr=False)
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _cancelled: bool = field(default=False, repr=False)
    _current: OutgoingTransfer | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._ready = [not self.plan.streaming] * self.plan.descriptor.layout.num_layers

    @property
    def request_id(self) -> int:
        return self.plan.descriptor.request_id

    def layer_ready(self, layer: int) -> None:
        """Streaming plans: layer ``layer``'s buffers are complete and may be sent."""
        if not 0 <= layer < len(self._ready):
            raise FrameRejected(f"layer {layer} out of range 0..{len(self._ready) - 1}")
        with self._cond:
            self._ready[layer] = True
            self._cond.notify_all()

    def cancel(self) -> None:
        """Stop the transfer: the future fails with TransferCancelled; no failover."""
        with self._cond:
            self._cancelled = True
            current = self._current
            self._cond.notify_all()
        if current is not None:
            current.cancel()

    def add_done_callback(self, callback: OutcomeCallback) -> None:
        self.future.add_done_callback(callback)

    def result(self, timeout: float | None = None) -> TransferOutcome:
        return self.future.result(timeout)

    def done(self) -> bool:
        return self.future.done()

    # -- used by the manager's worker ------------------------------------------------------

    @property
    def cancelled(self) -> bool:
        with self._cond:
            return self._cancelled

    def _attach(self, out: OutgoingTransfer | None) -> bool:
        """Track the attempt in progress; False (and the attempt cancelled) if cancelled."""
        with self._cond:
            self._current = out
            cancelled = self._cancelled
        if cancelled and out is not None:
            out.cancel()
        return not cancelled

    def _wait_ready(self, layer: int, deadline: float, clock: Clock) -> None:
        with self._cond:
            while not self._ready[layer]:
                if self._cancelled:
                    raise TransferCancelled(f"request {self.request_id} cancelled")
                left = deadline - clock()
                if left <= 0:
                    raise _Deadline(
                        f"request {self.request_id}: layer {layer} was not ready within "
                        f"{self.plan.timeout_s} s"
                    )
                self._cond.wait(min(left, 1.0))


class _Deadline(TransferTimeout):
    """The plan's overall deadline passed: no failover."""


SourceFactory = Callable[[str], TransferSource]


class TransferManager:
    """Runs :class:`TransferPlan` s: one worker thread per running transfer.

    Sources are created per medium on first use by ``source_factory`` (default: the
    registry's ``make_source(secret)``) and reused by later transfers; ``sources`` supplies
    ready-made ones (for example wrapped in an emulated link). ``clock`` is injectable.
    """

    def __init__(
        self,
        secret: bytes,
        *,
        sources: Mapping[str, TransferSource] | None = None,
        source_factory: SourceFactory | None = None,
        max_concurrent: int = 16,
        clock: Clock = time.monotonic,
    ) -> None:
        self._secret = secret
        self._sources: dict[str, TransferSource] = dict(sources or {})
        self._factory = source_factory or (lambda medium: registry.get(medium).make_source(secret))
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_concurrent, thread_name_prefix="topkv-transfer")
        self._clock = clock
        self._closed = False

    def source(self, medium: str) -> TransferSource:
        """The (cached) source for ``medium``; raises TransportUnavailable if unknown."""
        with self._lock:
            source = self._sources.get(medium)
            if source is None:
                source = self._factory(medium)
                self._sources[medium] = source
            return source

    def submit(self, plan: TransferPlan, callback: OutcomeCallback | None = None) -> TransferHandle:
        """Start ``plan``; ``callback(future)`` runs once it resolves (success or failure)."""
        if self._closed:
            raise TransportError("transfer manager is closed")
        handle = TransferHandle(plan)
        handle.future.set_running_or_notify_cancel()
        if callback is not None:
            handle.add_done_callback(callback)
        self._pool.submit(self._run, handle)
        return handle

    def run(self, plan: TransferPlan) -> TransferOutcome:
        """Submit ``plan`` and wait for it (raises what the future would)."""
        return self.submit(plan).result(plan.timeout_s + 5.0)

    def close(self) -> None:
        """Wait for running transfers to settle, then close every source."""
        self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock:
            sources, self._sources = list(self._sources.values()), {}
        for source in sources:
            with contextlib.suppress(Exception):
                source.close()

    # -- worker ----------------------------------------------------------------------------

    def _run(self, handle: TransferHandle) -> None:
        plan = handle.plan
        started = self._clock()
        deadline = started + plan.timeout_s
        attempts: list[AttemptRecord] = []
        error: BaseException | None = None
        for medium in plan.transports:
            attempt_start = self._clock()
            try:
                result = self._attempt(handle, medium, deadline)
            except (TransferCancelled, _Deadline) as exc:
                attempts.append(_record(medium, self._clock() - attempt_start, exc))
                error = exc
                break
            except TransportError as exc:
                attempts.append(_record(medium, self._clock() - attempt_start, exc))
                error = exc
                if handle.cancelled:
                    error = TransferCancelled(f"request {handle.request_id} cancelled")
                    break
                continue
            except Exception as exc:  # a bug in a backend must still settle the future
                attempts.append(_record(medium, self._clock() - attempt_start, exc))
                error = TransportError(f"{medium}: unexpected {type(exc).__name__}: {exc}")
                continue
            attempts.append(AttemptRecord(medium, self._clock() - attempt_start))
            with contextlib.suppress(Exception):
                handle.future.set_result(
                    TransferOutcome(result, medium, tuple(attempts), self._clock() - started)
                )
            return
        if isinstance(error, TransferCancelled | _Deadline):
            final: BaseException = error
        else:
            tried = "; ".join(f"{a.transport}: {a.error_type}: {a.error}" for a in attempts)
            final = TransferFailed(
                f"request {handle.request_id}: every transport failed ({tried})", attempts
            )
        with contextlib.suppress(Exception):
            handle.future.set_exception(final)

    def _attempt(self, handle: TransferHandle, medium: str, deadline: float) -> TransferResult:
        plan = handle.plan
        if handle.cancelled:
            raise TransferCancelled(f"request {handle.request_id} cancelled")
        if self._clock() >= deadline:
            raise _Deadline(f"request {handle.request_id}: no time left for {medium}")
        address = plan.address_for(medium)
        source = self.source(medium)
        attempt_deadline = deadline
        if plan.attempt_timeout_s is not None:
            attempt_deadline = min(deadline, self._clock() + plan.attempt_timeout_s)
        out = source.open(plan.descriptor, address)
        if not handle._attach(out):
            raise TransferCancelled(f"request {handle.request_id} cancelled")
        try:
            for layer, tensors in enumerate(plan.layers):
                handle._wait_ready(layer, deadline, self._clock)
                crcs = plan.crcs[layer] if plan.crcs is not None else None
                out.send_layer(layer, tensors, crcs)
            finished = out.finish()
            try:
                return finished.result(max(0.0, attempt_deadline - self._clock()))
            except FutureTimeout:
                out.cancel()
                if attempt_deadline < deadline:
                    raise TransferTimeout(
                        f"request {handle.request_id}: {medium} attempt took longer than "
                        f"{plan.attempt_timeout_s} s"
                    ) from None
                raise _Deadline(
                    f"request {handle.request_id}: not delivered within {plan.timeout_s} s"
                ) from None
        except BaseException:
            out.cancel()
            raise
        finally:
            handle._attach(None)


def _record(medium: str, seconds: float, error: BaseException) -> AttemptRecord:
    return AttemptRecord(medium, seconds, str(error), type(error).__name__)


def receive_first(sinks: Sequence[TransferSink], request_id: int, timeout: float) -> ReceivedKV:
    """Receiver side of a plan with failover: the first verified copy on any of ``sinks``.

    A failed attempt on one sink (e.g. shm) is followed by an attempt on another (tcp);
    this waits for the first success. Raises the last error once every sink reported a
    failure, or TransferTimeout after ``timeout`` seconds.
    """
    futures = [sink.receive(request_id) for sink in sinks]
    deadline = time.monotonic() + timeout
    cond = threading.Condition()

    def wake(_: Future[ReceivedKV]) -> None:
        with cond:
            cond.notify_all()

    for future in futures:
        future.add_done_callback(wake)
    with cond:
        while True:
            for future in futures:
                if future.done() and future.exception() is None:
                    return future.result()
            if all(f.done() for f in futures):
                error = futures[-1].exception()
                assert error is not None
                raise error
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeout(
                    f"request {request_id}: no verified copy on any sink within {timeout} s"
                )
            cond.wait(left)
