"""Workers as objects in this process, and an executor that moves their KV for real.

:class:`PrefillWorker` holds each request's KV (its buffers, per-tensor CRC-64s and digest)
until the orchestrator releases it. :class:`DecodeWorker` listens with real sinks (shared
memory and TCP on loopback) and holds each verified copy until decode takes it.
:class:`InProcessExecutor` runs one attempt over ``topkv.transport``: the bytes really
cross a unix-socket-announced shared-memory segment or a TCP connection, and the receiver
really verifies every CRC. Only the processes are shared; a worker can be *killed*
(:meth:`DecodeWorker.kill`): it leaves the registry and its sinks close under any transfer
in flight, which then fail the way a crashed peer makes them fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from topkv.relay.executor import AttemptFailed, AttemptPlan, Delivery, kv_digest
from topkv.relay.registry import Registration, WorkerRegistry
from topkv.relay.transfers import FailureKind
from topkv.relay.workers import WorkerInfo
from topkv.transport import catalog as transports
from topkv.transport.base import (
    Buffer,
    KVLayout,
    OutgoingTransfer,
    ReceivedKV,
    TransferDescriptor,
    TransferResult,
    TransferSink,
    TransferSource,
)
from topkv.transport.errors import TransferTimeout, TransportError
from topkv.transport.media import DEFAULT_MEDIA
from topkv.transport.sending import as_bytes_view
from topkv.transport.shm import ShmSink
from topkv.transport.tcp import TcpSink
from topkv.wire import crc64

SourceWrapper = Callable[[str, TransferSource], TransferSource]


def content_digest(layers: Sequence[Sequence[Buffer]]) -> int:
    """CRC-64 of every byte of a KV cache in layout order (an end-to-end content check)."""
    crc = 0
    for tensors in layers:
        for tensor in tensors:
            crc = crc64(tensor, crc)
    return crc


def _tensor_crcs(layers: Sequence[Sequence[Buffer]]) -> list[tuple[int, ...]]:
    return [tuple(crc64(t) for t in tensors) for tensors in layers]


@dataclass(frozen=True)
class InProcessKV:
    """One request's KV at its source: buffers, per-tensor CRCs and the whole digest."""

    descriptor: TransferDescriptor
    layers: tuple[tuple[memoryview, ...], ...]
    crcs: tuple[tuple[int, ...], ...]
    digest: int


class _Worker:
    def __init__(self, info: WorkerInfo) -> None:
        self.info = info
        self.alive = True
        self._registration: Registration | None = None

    def register(self, registry: WorkerRegistry, ttl_s: float = 10.0) -> None:
        self._registration = registry.register(self.info, ttl_s)

    def deregister(self) -> None:
        registration, self._registration = self._registration, None
        if registration is not None:
            registration.deregister()

    def close(self) -> None:
        self.alive = False


class PrefillWorker(_Worker):
    """Holds prefilled KV caches and owns one transfer source per medium it uses."""

    def __init__(
        self, info: WorkerInfo, secret: bytes, wrap_source: SourceWrapper | None = None
    ) -> None:
        super().__init__(info)
        self._secret = secret
        self._wrap = wrap_source
        self._held: dict[int, InProcessKV] = {}
        self._sources: dict[str, TransferSource] = {}
        self._lock = threading.Lock()

    def hold(
        self,
        request_id: int,
        model_id: str,
        layout: KVLayout,
        layers: Sequence[Sequence[Buffer]],
    ) -> int:
        """Take ownership of a prefilled KV cache; returns its :func:`kv_digest`."""
        views = tuple(tuple(as_bytes_view(t) for t in tensors) for tensors in layers)
        if len(views) != layout.num_layers or any(
            len(t) != layout.tensors_per_layer or any(v.nbytes != layout.tensor_bytes for v in t)
            for t in views
        ):
            raise TransportError(f"request {request_id}: buffers do not match the layout")
        crcs = tuple(_tensor_crcs(views))
        digest = kv_digest([c for layer in crcs for c in layer])
        held = InProcessKV(TransferDescriptor(request_id, model_id, layout), views, crcs, digest)
        with self._lock:
            self._held[request_id] = held
        return digest

    def get(self, request_id: int) -> InProcessKV | None:
        with self._lock:
            return self._held.get(request_id)

    def release(self, request_id: int) -> None:
        with self._lock:
            self._held.pop(request_id, None)

    def held(self) -> list[int]:
        with self._lock:
            return sorted(self._held)

    def source_for(self, medium: str) -> TransferSource:
        with self._lock:
            source = self._sources.get(medium)
            if source is None:
                source = transports.get(medium).make_source(self._secret)
                if self._wrap is not None:
                    source = self._wrap(medium, source)
                self._sources[medium] = source
            return source

    def close(self) -> None:
        self.alive = False
        with self._lock:
            sources, self._sources = list(self._sources.values()), {}
            self._held.clear()
        for source in sources:
            with contextlib.suppress(Exception):
                source.close()


class DecodeWorker(_Worker):
    """Receives KV with real sinks (shm and TCP) and holds verified copies for decode."""

    def __init__(self, info: WorkerInfo, secret: bytes, host: str = "127.0.0.1") -> None:
        super().__init__(info)
        self.sinks: dict[str, TransferSink] = {
            "shm": ShmSink(secret),
            "tcp": TcpSink(secret, host=host),
        }
        self._received: dict[int, ReceivedKV] = {}
        self._lock = threading.Lock()

    def sink_for(self, medium: str) -> TransferSink:
        kind = "shm" if transports.get(medium).make_sink is ShmSink else "tcp"
        return self.sinks[kind]

    def store(self, kv: ReceivedKV) -> None:
        with self._lock:
            if not self.alive:
                kv.release()
                raise AttemptFailed(FailureKind.DESTINATION_DIED, f"{self.info.worker_id} died")
            old = self._received.pop(kv.descriptor.request_id, None)
            self._received[kv.descriptor.request_id] = kv
        if old is not None:
            old.release()

    def take(self, request_id: int) -> ReceivedKV | None:
        """Hand the verified KV to decode (the caller must ``release()`` it when done)."""
        with self._lock:
            return self._received.pop(request_id, None)

    def discard(self, request_id: int) -> None:
        kv = self.take(request_id)
        if kv is not None:
            kv.release()

    def held(self) -> list[int]:
        with self._lock:
            return sorted(self._received)

    def kill(self) -> None:
        """Die abruptly: leave the registry, close every sink, lose every held copy."""
        with self._lock:
            self.alive = False
            held, self._received = list(self._received.values()), {}
        with contextlib.suppress(Exception):
            self.deregister()
        for sink in self.sinks.values():
            with contextlib.suppress(Exception):
                sink.close()
        for kv in held:
            kv.release()

    def close(self) -> None:
        self.kill()


_T = TypeVar("_T")


def _await_cf(future: Future[_T]) -> asyncio.Future[_T]:
    """An awaitable of a concurrent future that never cancels it (we clean up ourselves)."""
    return asyncio.shield(asyncio.wrap_future(future))


class InProcessExecutor:
    """:class:`~topkv.relay.executor.TransferExecutor` over workers living in this process."""

    def __init__(
        self,
        workers: Sequence[PrefillWorker | DecodeWorker] = (),
        media: Mapping[str, str] = DEFAULT_MEDIA,
        threads: int = 64,
        settle_timeout_s: float = 2.0,
    ) -> None:
        self.prefill: dict[str, PrefillWorker] = {}
        self.decode: dict[str, DecodeWorker] = {}
        self.media = dict(media)
        self.settle_timeout_s = settle_timeout_s
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="topkv-relay")
        for worker in workers:
            self.add(worker)

    def add(self, worker: PrefillWorker | DecodeWorker) -> None:
        if isinstance(worker, PrefillWorker):
            self.prefill[worker.info.worker_id] = worker
        else:
            self.decode[worker.info.worker_id] = worker

    def medium_for(self, plan: AttemptPlan) -> str:
        medium = self.media.get(plan.transport)
        if medium is None:
            raise AttemptFailed(
                FailureKind.TRANSPORT, f"no medium here serves {plan.transport!r} paths"
            )
        if self._is_shm(medium) and plan.source.host_id != plan.destination.host_id:
            raise AttemptFailed(
                FailureKind.TRANSPORT,
                f"{medium} needs one host; {plan.source.worker_id} and "
                f"{plan.destination.worker_id} are on different hosts",
            )
        return medium

    @staticmethod
    def _is_shm(medium: str) -> bool:
        return transports.get(medium).make_sink is ShmSink

    # -- TransferExecutor ------------------------------------------------------------------

    async def source_digest(self, source: WorkerInfo, request_id: int, layout: KVLayout) -> int:
        held = self._held(source, request_id)
        if held.descriptor.layout != layout:
            raise AttemptFailed(
                FailureKind.SOURCE_LOST,
                f"{source.worker_id} holds request {request_id} with another layout",
            )
        return held.digest

    async def probe(self, worker: WorkerInfo) -> bool:
        found = self.prefill.get(worker.worker_id) or self.decode.get(worker.worker_id)
        return found is not None and found.alive

    async def release_source(self, source: WorkerInfo, request_id: int) -> None:
        worker = self.prefill.get(source.worker_id)
        if worker is not None:
            worker.release(request_id)

    async def discard_destination(self, destination: WorkerInfo, request_id: int) -> None:
        worker = self.decode.get(destination.worker_id)
        if worker is not None:
            worker.discard(request_id)

    async def transfer(self, plan: AttemptPlan) -> Delivery:
        held = self._held(plan.source, plan.request_id)
        source_worker = self.prefill[plan.source.worker_id]
        sink_worker = self.decode.get(plan.destination.worker_id)
        if sink_worker is None or not sink_worker.alive:
            raise AttemptFailed(
                FailureKind.DESTINATION_DIED, f"{plan.destination.worker_id} is not running"
            )
        medium = self.medium_for(plan)
        source = source_worker.source_for(medium)
        sink = sink_worker.sink_for(medium)
        received = sink.receive(plan.request_id)
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        outgoing: list[OutgoingTransfer] = []

        def send() -> Future[TransferResult]:
            out = source.open(held.descriptor, sink.address)
            outgoing.append(out)
            for layer, tensors in enumerate(held.layers):
                out.send_layer(layer, tensors, held.crcs[layer])
            return out.finish()

        try:
            finished = await asyncio.wait_for(
                loop.run_in_executor(self._pool, send), plan.timeout_s
            )
            result = await asyncio.wait_for(_await_cf(finished), plan.timeout_s)
            kv = await asyncio.wait_for(_await_cf(received), self.settle_timeout_s)
        except BaseException as exc:
            for out in outgoing:
                out.cancel()
            await self._settle(received)
            if isinstance(exc, TimeoutError):
                raise TransferTimeout(
                    f"request {plan.request_id}: no verified copy within {plan.timeout_s} s"
                ) from None
            raise
        seconds = time.perf_counter() - started
        crcs = [crc64(t) for tensors in kv.layers for t in tensors]
        sink_worker.store(kv)
        return Delivery(
            request_id=plan.request_id,
            destination=plan.destination.worker_id,
            transport=plan.transport,
            medium=medium,
            size_bytes=held.descriptor.layout.total_bytes,
            seconds=result.seconds if result.emulated else seconds,
            digest=kv_digest(crcs),
            emulated=result.emulated,
        )

    async def close(self) -> None:
        for worker in [*self.prefill.values(), *self.decode.values()]:
            worker.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- helpers ---------------------------------------------------------------------------

    def _held(self, source: WorkerInfo, request_id: int) -> InProcessKV:
        worker = self.prefill.get(source.worker_id)
        held = worker.get(request_id) if worker is not None and worker.alive else None
        if held is None:
            raise AttemptFailed(
                FailureKind.SOURCE_LOST, f"{source.worker_id} holds no KV for {request_id}"
            )
        return held

    async def _settle(self, received: Future[ReceivedKV]) -> None:
        """After a failed attempt: wait briefly for the sink's verdict, free any copy."""
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(_await_cf(received), self.settle_timeout_s)
        if received.done() and not received.cancelled() and received.exception() is None:
            received.result().release()
        elif not received.done():
            received.cancel()


def new_secret() -> bytes:
    """A fresh shared secret for the transports' handshake."""
    return secrets.token_bytes(32)
