"""Demo worker processes: a prefill worker that streams per-layer KV, a decode worker.

Each worker runs in its own process (multiprocessing ``spawn``), loads the same seeded
model, and talks to the main process through two queues. A control thread reads the inbox
at all times, so a ``Send`` reaches a prefill worker while its forward pass is running; the
main thread does the model work (prefill, or decode then the reference generation).

Workers ignore SIGINT (the main process shuts them down in order on Ctrl-C) and exit on
their own when the main process disappears, closing their transports first.
"""

from __future__ import annotations

import itertools
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from topkv.demo.errors import DemoError
from topkv.demo.protocol import (
    CancelSend,
    Decoded,
    DemoWorkerConfig,
    Discard,
    Event,
    Expect,
    Failed,
    FirstToken,
    Held,
    LinkSpec,
    Prefill,
    PrefillDone,
    Ready,
    Received,
    Reference,
    ReferenceDone,
    Release,
    Send,
    SendDone,
    Stop,
    Take,
)
from topkv.relay.executor import classify_failure, kv_digest
from topkv.service.engines import WIRE_DTYPES, wire_layout
from topkv.transport.base import (
    KVLayout,
    LayerTensors,
    OutgoingTransfer,
    ReceivedKV,
    TransferDescriptor,
    TransferSink,
    TransferSource,
    TransportMode,
)
from topkv.transport.emulated import EmulatedSource, LinkModel
from topkv.transport.shm_segments import pid_alive
from topkv.wire import crc64

Outbox = Any  # multiprocessing queues are not generic at runtime
now = time.perf_counter


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _paced(medium: TransferSource, link: LinkSpec) -> EmulatedSource:
    """``medium`` paced to ``link``: one emulated link per transfer, each its own path.

    The wrapper is dropped after the transfer, never closed: the medium is the worker's.
    """
    try:
        mode = TransportMode(link.mode)
    except ValueError:
        raise DemoError(f"no transport mode {link.mode!r} to pace a link to") from None
    model = LinkModel(mode, link.bandwidth_gbps, link.setup_s)
    return EmulatedSource(medium, model, dilation=link.dilation)


def _failure(exc: BaseException) -> str:
    """The relay's failure kind of ``exc`` (decides retry, failover or reroute)."""
    return classify_failure(exc).value


def layers_digest(layers: Sequence[Sequence[memoryview | np.ndarray]]) -> int:
    """:func:`topkv.relay.executor.kv_digest` of a KV cache (K, V per layer, in order)."""
    return kv_digest([crc64(t if isinstance(t, memoryview) else t.data) for p in layers for t in p])


def _watch_parent(main_pid: int, on_orphaned: Callable[[], None]) -> None:
    """Exit the worker when the main process (or our direct parent) is gone: no orphans."""
    parent = os.getppid()

    def loop() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent or not pid_alive(main_pid):
                on_orphaned()
                os._exit(3)

    threading.Thread(target=loop, name="parent-watch", daemon=True).start()


class _Model:
    """The model, its KV spec and the prompt generator, loaded inside the worker."""

    def __init__(self, config: DemoWorkerConfig) -> None:
        import torch

        torch.set_num_threads(config.torch_threads)
        from topkv import engine

        if config.model_path is not None:
            self.loaded = engine.load_model(config.model_path)
        else:
            self.loaded = engine.build_demo_model(config.model, config.seed)
        self.spec = engine.kv_model_spec(self.loaded)
        self.vocab = int(self.loaded.config.vocab_size)
        self.engine = engine
        if self.spec["dtype"] not in WIRE_DTYPES:
            raise ValueError(f"KV dtype {self.spec['dtype']} cannot go on the wire")

    def prompt(self, length: int, seed: int) -> list[int]:
        return self.engine.prompt_token_ids(length, seed, self.vocab)

    def layout(self, prompt_len: int) -> KVLayout:
        return wire_layout(self.spec, prompt_len)

    def ready_event(self, worker_id: str, addresses: dict[str, str]) -> Ready:
        return Ready(
            worker_id=worker_id,
            pid=os.getpid(),
            model_id=self.spec["model_id"],
            layers=self.spec["layers"],
            kv_heads=self.spec["kv_heads"],
            head_dim=self.spec["head_dim"],
            dtype=self.spec["dtype"],
            addresses=addresses,
        )


def run_reference(worker_id: str, model: _Model, job: Reference) -> ReferenceDone | Failed:
    """Single-process greedy generation of the request's prompt (no transfer involved)."""
    from topkv.engine import reference_generate

    start = now()
    try:
        ids = model.prompt(job.prompt_len, job.prompt_seed)
        tokens = reference_generate(model.loaded, ids, job.max_new_tokens)
    except Exception as exc:
        return Failed(worker_id, job.rid, f"reference: {_short(exc)}")
    return ReferenceDone(worker_id, job.rid, tuple(tokens), now() - start)


# -- prefill ---------------------------------------------------------------------------


@dataclass
class _Stream:
    """An open pipelined transfer: layers are offered to it as prefill publishes them."""

    out: OutgoingTransfer
    offered_s: dict[int, float] = field(default_factory=dict)
    error: BaseException | None = None

    def offer(self, index: int, pair: tuple[np.ndarray, np.ndarray]) -> None:
        if self.error is not None:
            return
        self.offered_s[index] = now()
        try:
            self.out.send_layer(index, (pair[0].data, pair[1].data))
        except Exception as exc:  # reported by the sender thread
            self.error = exc


@dataclass
class _HeldKV:
    """One request's KV as prefill publishes it; held until the main process releases it."""

    request: Prefill
    holders: set[str] = field(default_factory=set)
    layers: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    ready_s: list[float] = field(default_factory=list)
    forward_start_s: float = 0.0
    done: bool = False
    error: str | None = None
    first_token: int | None = None
    first_token_to: str | None = None
    first_token_sent_to: set[str] = field(default_factory=set)
    streams: list[_Stream] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def publish(self, pair: tuple[np.ndarray, np.ndarray]) -> None:
        """Store the next layer and hand it to every open stream (compute thread)."""
        with self.cond:
            index = len(self.layers)
            self.layers.append(pair)
            self.ready_s.append(now())
            for stream in self.streams:
                stream.offer(index, pair)
            self.cond.notify_all()

    def wait(self, predicate: Callable[[], bool], timeout: float) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: predicate() or self.error is not None, timeout):
                raise TimeoutError(f"request {self.request.rid}: prefill produced no KV in time")
            if self.error is not None:
                raise RuntimeError(f"request {self.request.rid}: prefill failed: {self.error}")


class DemoPrefillWorker:
    def __init__(self, config: DemoWorkerConfig, outbox: Outbox, peers: dict[str, Any]) -> None:
        self.config = config
        self.outbox = outbox
        self.peers = peers
        self.model = _Model(config)
        from topkv.transport.shm import ShmSource
        from topkv.transport.tcp import TcpSource

        timeout = config.io_timeout_s
        self.sources: dict[str, TransferSource] = {
            "shm": ShmSource(config.secret, io_timeout=timeout, ack_timeout=timeout),
            "tcp": TcpSource(config.secret, io_timeout=timeout, ack_timeout=timeout),
        }
        self.held: dict[int, _HeldKV] = {}
        self.outgoing: dict[int, OutgoingTransfer] = {}
        self.lock = threading.Lock()
        self.jobs: queue.SimpleQueue[Prefill | Reference | None] = queue.SimpleQueue()

    def close(self) -> None:
        for source in self.sources.values():
            source.close()

    def ready(self) -> Ready:
        return self.model.ready_event(self.config.worker_id, {})

    def handle(self, message: object) -> None:
        """Control thread: dispatch one inbox message."""
        if isinstance(message, Prefill):
            with self.lock:
                self.held[message.rid] = _HeldKV(message, set(message.holders))
            self.jobs.put(message)
        elif isinstance(message, Send):
            threading.Thread(
                target=self._send, args=(message,), name=f"send-{message.rid}", daemon=True
            ).start()
        elif isinstance(message, CancelSend):
            with self.lock:
                out = self.outgoing.get(message.wire_rid)
            if out is not None:
                out.cancel()
        elif isinstance(message, Release):
            with self.lock:
                entry = self.held.get(message.rid)
                if entry is not None:
                    entry.holders.discard(message.holder)
                    if not entry.holders:
                        del self.held[message.rid]
        elif isinstance(message, Reference):
            self.jobs.put(message)

    def _entry(self, rid: int) -> _HeldKV:
        with self.lock:
            entry = self.held.get(rid)
        if entry is None:
            raise KeyError(f"request {rid} is not held by {self.config.worker_id}")
        return entry

    def run(self) -> None:
        """Main thread: one prefill at a time."""
        from topkv.engine import PrefillRunner, layer_to_numpy

        runner = PrefillRunner(self.model.loaded)
        while (job := self.jobs.get()) is not None:
            if isinstance(job, Reference):
                self.outbox.put(run_reference(self.config.worker_id, self.model, job))
                continue
            entry = self._entry(job.rid)
            started = now()
            try:
                ids = self.model.prompt(job.prompt_len, job.prompt_seed)

                def on_layer(index: int, k: Any, v: Any, entry: _HeldKV = entry) -> None:
                    entry.publish(layer_to_numpy(k, v))

                entry.forward_start_s = now()
                result = runner.run(ids, on_layer)
            except Exception as exc:
                with entry.cond:
                    entry.error = _short(exc)
                    entry.cond.notify_all()
                self.outbox.put(Failed(self.config.worker_id, job.rid, f"prefill: {_short(exc)}"))
                continue
            with entry.cond:
                entry.done = True
                entry.first_token = result.first_token
                entry.cond.notify_all()
            self._forward_first_token(entry)
            digest = layers_digest(entry.layers)
            self.outbox.put(
                PrefillDone(
                    worker_id=self.config.worker_id,
                    rid=job.rid,
                    first_token=result.first_token,
                    started_s=started,
                    forward_start_s=result.forward_start_s,
                    forward_end_s=result.forward_end_s,
                    layer_ready_s=tuple(entry.ready_s),
                    layer_compute_s=tuple(result.layer_compute_s),
                    digest=digest,
                )
            )

    def _stream(self, entry: _HeldKV, out: OutgoingTransfer, timeout_s: float) -> dict[int, float]:
        """Offer layers already computed, then let prefill offer each new one as it lands."""
        stream = _Stream(out)
        with entry.cond:
            for index, pair in enumerate(entry.layers):
                stream.offer(index, pair)
            entry.streams.append(stream)
        try:
            entry.wait(lambda: entry.done, timeout_s)
        finally:
            with entry.cond:
                entry.streams.remove(stream)
        if stream.error is not None:
            raise stream.error
        return stream.offered_s

    def _forward_first_token(self, entry: _HeldKV) -> None:
        """Hand prefill's first token straight to the decode worker (once both are known)."""
        with entry.cond:
            target, token = entry.first_token_to, entry.first_token
            if target is None or token is None or target in entry.first_token_sent_to:
                return
            entry.first_token_sent_to.add(target)
        self.peers[target].put(FirstToken(entry.request.rid, token, now()))

    def _send(self, cmd: Send) -> None:
        try:
            self.outbox.put(self._transfer(cmd))
        except Exception as exc:
            self.outbox.put(
                SendDone(
                    self.config.worker_id, cmd.rid, cmd.tag, 0.0, 0.0, (), (), 0, cmd.medium,
                    cmd.link is not None, 1.0, error=_short(exc), wire_rid=cmd.wire_rid,
                    failure=_failure(exc),
                )
            )  # fmt: skip

    def _transfer(self, cmd: Send) -> SendDone:
        entry = self._entry(cmd.rid)
        if cmd.first_token_to is not None:
            with entry.cond:
                entry.first_token_to = cmd.first_token_to
            self._forward_first_token(entry)
        medium = self.sources[cmd.medium]
        source: TransferSource = medium
        if cmd.link is not None:
            source = _paced(medium, cmd.link)
        layout = self.model.layout(entry.request.prompt_len)
        descriptor = TransferDescriptor(cmd.wire_rid, self.model.spec["model_id"], layout)
        if cmd.schedule != "stream":
            entry.wait(lambda: entry.done, cmd.timeout_s)
        start = now()
        out = source.open(descriptor, cmd.destination)
        with self.lock:
            self.outgoing[cmd.wire_rid] = out
        offered: dict[int, float] = {}
        try:
            if cmd.schedule == "stream":
                offered = self._stream(entry, out, cmd.timeout_s)
            else:
                for index in range(layout.num_layers):
                    if cmd.schedule == "replay":
                        due = start + (entry.ready_s[index] - entry.forward_start_s)
                        if (delay := due - now()) > 0:
                            time.sleep(delay)
                    offered[index] = now()
                    k, v = entry.layers[index]
                    out.send_layer(index, (k.data, v.data))
            result = out.finish().result(cmd.timeout_s)
        except BaseException:
            out.cancel()
            raise
        finally:
            with self.lock:
                self.outgoing.pop(cmd.wire_rid, None)
        end = now()
        handed = (
            tuple(paced_out[i] for i in range(layout.num_layers))
            if (paced_out := getattr(out, "handed_to_medium", None)) is not None
            else tuple(offered[i] for i in range(layout.num_layers))
        )
        return SendDone(
            worker_id=self.config.worker_id,
            rid=cmd.rid,
            tag=cmd.tag,
            start_s=start,
            end_s=end,
            offered_s=tuple(offered[i] for i in range(layout.num_layers)),
            handed_s=handed,
            nbytes=layout.total_bytes,
            transport=source.name,
            emulated=result.emulated,
            dilation=result.dilation,
            wire_rid=cmd.wire_rid,
        )


# -- decode ----------------------------------------------------------------------------


@dataclass
class _DecodeJob:
    """One incoming copy for decode: held once verified, decoded once taken."""

    expect: Expect
    kv: ReceivedKV | None = None
    kv_error: str | None = None
    kv_verified_s: float = 0.0
    arrivals_s: tuple[float, ...] = ()
    taken: bool = False
    discarded: bool = False
    queued: bool = False


class DemoDecodeWorker:
    def __init__(self, config: DemoWorkerConfig, outbox: Outbox) -> None:
        self.config = config
        self.outbox = outbox
        self.model = _Model(config)
        from topkv.transport.shm import ShmSink
        from topkv.transport.tcp import TcpSink

        timeout = config.io_timeout_s
        self.arrivals: dict[int, dict[int, float]] = {}
        self.lock = threading.Lock()
        self.sinks: dict[str, TransferSink] = {
            "shm": ShmSink(config.secret, on_layer=self._landed, io_timeout=timeout),
            "tcp": TcpSink(config.secret, on_layer=self._landed, io_timeout=timeout),
        }
        self.jobs: dict[int, _DecodeJob] = {}  # by wire id
        self.first_tokens: dict[int, tuple[int, float]] = {}  # rid -> (token, stamp)
        self.ready_jobs: queue.PriorityQueue[tuple[int, int, object]] = queue.PriorityQueue()
        self.order = itertools.count()

    def close(self) -> None:
        with self.lock:
            jobs, self.jobs = list(self.jobs.values()), {}
        for job in jobs:
            if job.kv is not None:
                job.kv.release()
        for sink in self.sinks.values():
            sink.close()

    def ready(self) -> Ready:
        addresses = {name: sink.address for name, sink in self.sinks.items()}
        return self.model.ready_event(self.config.worker_id, addresses)

    def _landed(self, descriptor: TransferDescriptor, layer: int, _: LayerTensors) -> None:
        stamp = now()
        with self.lock:
            self.arrivals.setdefault(descriptor.request_id, {})[layer] = stamp

    def _take_arrivals(self, wire_rid: int, layers: int) -> tuple[float, ...]:
        with self.lock:
            stamps = self.arrivals.pop(wire_rid, {})
        return tuple(stamps.get(i, float("nan")) for i in range(layers))

    def handle(self, message: object) -> None:
        if isinstance(message, Expect):
            future = self.sinks[message.medium].receive(message.wire_rid)
            if message.kind == "drain":
                future.add_done_callback(partial(self._drained, message))
                return
            job = _DecodeJob(message)
            with self.lock:
                self.jobs[message.wire_rid] = job
            future.add_done_callback(partial(self._kv_arrived, job))
        elif isinstance(message, FirstToken):
            with self.lock:
                self.first_tokens[message.rid] = (message.token, now())
                jobs = [j for j in self.jobs.values() if j.expect.rid == message.rid]
            for job in jobs:
                self._maybe_queue(job)
        elif isinstance(message, Take):
            with self.lock:
                taken = self.jobs.get(message.wire_rid)
                if taken is not None:
                    taken.taken = True
            if taken is None:
                raise KeyError(f"no copy {message.wire_rid} of request {message.rid} held")
            self._maybe_queue(taken)
        elif isinstance(message, Discard):
            self._discard(message)
        elif isinstance(message, Reference):
            self.ready_jobs.put((1, next(self.order), message))

    def _discard(self, message: Discard) -> None:
        """Drop the matching copies now, or as soon as they finish arriving."""
        release: list[ReceivedKV] = []
        with self.lock:
            for wire, job in list(self.jobs.items()):
                if job.expect.rid != message.rid or job.queued:
                    continue
                if message.wire_rid is not None and wire != message.wire_rid:
                    continue
                job.discarded = True
                if job.kv is not None or job.kv_error is not None:
                    del self.jobs[wire]
                    if job.kv is not None:
                        release.append(job.kv)
                        job.kv = None
        for kv in release:
            kv.release()

    def _drained(self, expect: Expect, future: Any) -> None:
        verified = now()
        error: str | None = None
        try:
            future.result().release()
        except Exception as exc:
            error = _short(exc)
        arrivals = self._take_arrivals(expect.wire_rid, self.model.spec["layers"])
        self.outbox.put(
            Received(self.config.worker_id, expect.rid, expect.tag, arrivals, verified, error)
        )

    def _kv_arrived(self, job: _DecodeJob, future: Any) -> None:
        """A copy landed (or failed): digest it, hold it, and tell the main process."""
        stamp = now()
        kv: ReceivedKV | None = None
        error: str | None = None
        failure: str | None = None
        digest = 0
        try:
            kv = future.result()
            digest = layers_digest(kv.layers)
        except Exception as exc:
            error, failure = _short(exc), _failure(exc)
        arrivals = self._take_arrivals(job.expect.wire_rid, self.model.spec["layers"])
        with self.lock:
            job.kv, job.kv_error, job.kv_verified_s = kv, error, stamp
            job.arrivals_s = arrivals
            drop = job.discarded or error is not None
            if drop:
                self.jobs.pop(job.expect.wire_rid, None)
                job.kv = None
        if drop and kv is not None:
            kv.release()
        if job.discarded:
            return
        self.outbox.put(
            Held(
                self.config.worker_id, job.expect.rid, job.expect.wire_rid, digest, arrivals,
                stamp, error, failure,
            )
        )  # fmt: skip

    def _maybe_queue(self, job: _DecodeJob) -> None:
        with self.lock:
            ready = job.kv is not None and job.taken and job.expect.rid in self.first_tokens
            if not ready or job.queued:
                return
            job.queued = True
        self.ready_jobs.put((0, next(self.order), job))

    def run(self) -> None:
        """Main thread: decodes first (priority 0), reference generations when idle."""
        from topkv.engine import DecodeRunner, arrays_from_bytes

        decoder = DecodeRunner(self.model.loaded)
        while True:
            _, _, job = self.ready_jobs.get()
            if job is None:
                return
            if isinstance(job, Reference):
                self.outbox.put(run_reference(self.config.worker_id, self.model, job))
                continue
            assert isinstance(job, _DecodeJob)
            expect = job.expect
            with self.lock:
                self.jobs.pop(expect.wire_rid, None)
                first_token, first_token_s = self.first_tokens.pop(expect.rid)
            start = now()
            tokens: list[int] = []
            error = job.kv_error
            if job.kv is not None:
                try:
                    layers = [
                        arrays_from_bytes(self.model.spec, expect.prompt_len, k, v)
                        for k, v in job.kv.layers
                    ]
                    tokens = decoder.generate(
                        layers, first_token, expect.prompt_len, expect.max_new_tokens
                    )
                except Exception as exc:
                    error = _short(exc)
                finally:
                    job.kv.release()
            self.outbox.put(
                Decoded(
                    worker_id=self.config.worker_id,
                    rid=expect.rid,
                    tokens=tuple(tokens),
                    arrivals_s=job.arrivals_s,
                    kv_verified_s=job.kv_verified_s,
                    first_token_s=first_token_s,
                    decode_start_s=start,
                    decode_end_s=now(),
                    error=error,
                )
            )


# -- process entry ---------------------------------------------------------------------


def worker_main(config: DemoWorkerConfig, inbox: Any, outbox: Any, peers: dict[str, Any]) -> None:
    """Entry point of a worker process (multiprocessing ``spawn`` target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Transport threads (pacer, shm/tcp senders and receivers) must get the GIL quickly
    # while the main thread runs the model, or their stamps would carry GIL waits.
    sys.setswitchinterval(0.0005)
    worker: DemoPrefillWorker | DemoDecodeWorker | None = None

    def close() -> None:
        if worker is not None:
            worker.close()

    _watch_parent(config.main_pid, close)
    try:
        worker = (
            DemoPrefillWorker(config, outbox, peers)
            if config.role == "prefill"
            else DemoDecodeWorker(config, outbox)
        )
        outbox.put(worker.ready())
    except Exception as exc:
        outbox.put(Failed(config.worker_id, -1, f"startup: {_short(exc)}"))
        close()
        return

    def control() -> None:
        assert worker is not None
        while True:
            message = inbox.get()
            if isinstance(message, Stop):
                break
            try:
                worker.handle(message)
            except Exception as exc:
                rid = getattr(message, "rid", -1)
                detail = traceback.format_exception_only(exc)[-1].strip()
                outbox.put(Failed(config.worker_id, rid, f"{type(message).__name__}: {detail}"))
        if isinstance(worker, DemoPrefillWorker):
            worker.jobs.put(None)
        else:
            worker.ready_jobs.put((-1, -1, None))

    threading.Thread(target=control, name="control", daemon=True).start()
    try:
        worker.run()
    finally:
        close()


__all__ = ["DemoDecodeWorker", "DemoPrefillWorker", "Event", "worker_main"]
