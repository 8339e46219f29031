"""Fault injection against a real relay, and the accounting that proves nothing was lost.

:func:`run_chaos` builds a local cluster (prefill and decode workers in this process,
talking over real shared memory and TCP on loopback), runs N transfers through the
orchestrator, and injects faults:

* **bit flips in frames**: a :class:`CorruptingSource` flips one bit of one tensor of a
  transfer with probability ``corrupt_rate`` *after* the per-tensor CRC-64 was taken, so
  the frame leaves with its original CRC and corrupted bytes (what a flipped bit on the
  wire looks like to the receiver);
* **a decode worker killed mid-run** after ``kill_decoder_after`` delivered transfers: it
  leaves the registry and its sinks close under the transfers in flight to it;
* **a slowed link**: transfers from one prefill worker to one decode worker are paced to
  ``slow_link_gbps`` (:class:`~topkv.transport.emulated.EmulatedSource` over the real
  medium).

Accounting: every request's content digest (CRC-64 over all its bytes) is taken when its
KV is created; every delivered copy is read back from the decode worker and checked
against it. ``stranded_after`` counts what is still held after the run: source KV,
destination copies, active transfer records, decode slots, named shm segments of this
process, and registry entries of the killed worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from topkv.errors import ConfigError
from topkv.relay.executor import AttemptPlan, Delivery
from topkv.relay.inprocess import (
    DecodeWorker,
    InProcessExecutor,
    PrefillWorker,
    SourceWrapper,
    content_digest,
    new_secret,
)
from topkv.relay.orchestrator import Orchestrator, OrchestratorConfig, RetryPolicy
from topkv.relay.registry import MemoryRegistry
from topkv.relay.transfers import Outcome
from topkv.relay.workers import WorkerInfo
from topkv.transport.base import (
    Buffer,
    KVLayout,
    OutgoingTransfer,
    TransferDescriptor,
    TransferResult,
    TransferSource,
    TransportMode,
)
from topkv.transport.emulated import EmulatedSource, LinkModel
from topkv.transport.shm import segments_of

REPORT_KEYS = (
    "submitted",
    "delivered",
    "failed_clean",
    "lost",
    "corrupt_detected",
    "corrupt_delivered",
    "max_in_flight",
    "stranded_after",
    "rerouted",
)


@dataclass(frozen=True)
class ChaosConfig:
    """What to run and which faults to inject."""

    transfers: int = 2000
    size_bytes: int = 4 << 20
    corrupt_rate: float = 0.05
    kill_decoder_after: int | None = 500
    limit: int = 100
    prefill_workers: int = 2
    decode_workers: int = 3
    decode_capacity: int = 64
    layers: int = 8
    slow_link_gbps: float | None = 1.0
    seed: int = 0
    attempt_timeout_s: float = 30.0
    backoff_s: float = 0.01
    run_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.transfers < 1:
            raise ConfigError("--transfers must be >= 1")
        if not 0.0 <= self.corrupt_rate <= 1.0:
            raise ConfigError(f"--corrupt-rate must be in [0, 1], got {self.corrupt_rate}")
        if self.limit < 1:
            raise ConfigError("--limit must be >= 1")
        if self.prefill_workers < 1 or self.decode_workers < 2:
            raise ConfigError("chaos needs >= 1 prefill and >= 2 decode workers")
        if self.layers < 1 or self.size_bytes < self.layers * 2:
            raise ConfigError(f"--size {self.size_bytes} is too small for {self.layers} layers")
        if self.kill_decoder_after is not None and self.kill_decoder_after < 0:
            raise ConfigError("--kill-decoder-after must be >= 0")

    def layout(self) -> KVLayout:
        """A KV layout of about ``size_bytes`` (K and V per layer, fp16, 8 heads x 128)."""
        per_token = 2 * 8 * 128 * 2  # K+V, 8 heads, head_dim 128, fp16
        seq_len = max(1, self.size_bytes // (self.layers * per_token))
        return KVLayout(self.layers, seq_len, 8, 128, "fp16")


@dataclass
class ChaosReport:
    """The accounting of one chaos run (``to_dict`` holds exactly :data:`REPORT_KEYS`)."""

    submitted: int = 0
    delivered: int = 0
    failed_clean: int = 0
    lost: int = 0
    corrupt_detected: int = 0
    corrupt_delivered: int = 0
    max_in_flight: int = 0
    stranded_after: int = 0
    rerouted: int = 0
    injected_corruptions: int = 0
    killed: str | None = None
    seconds: float = 0.0
    bytes_delivered: int = 0
    retries: int = 0
    failovers: int = 0
    by_medium: dict[str, int] = field(default_factory=dict)
    stranded_detail: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, int]:
        return {key: int(getattr(self, key)) for key in REPORT_KEYS}

    def problems(self, limit: int) -> list[str]:
        """Every correctness condition that does not hold (empty when the run is correct)."""
        found = []
        if self.lost:
            found.append(f"lost == {self.lost}")
        if self.corrupt_delivered:
            found.append(f"corrupt_delivered == {self.corrupt_delivered}")
        if self.stranded_after:
            found.append(f"stranded_after == {self.stranded_after} ({self.stranded_detail})")
        if self.max_in_flight > limit:
            found.append(f"max_in_flight {self.max_in_flight} > limit {limit}")
        if self.delivered + self.failed_clean != self.submitted:
            found.append(
                f"delivered + failed_clean = {self.delivered + self.failed_clean} "
                f"!= submitted {self.submitted}"
            )
        return found


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


class _CountingExecutor(InProcessExecutor):
    """Counts concurrent attempts independently of the orchestrator's own bookkeeping."""

    active = 0
    peak = 0

    async def transfer(self, plan: AttemptPlan) -> Delivery:
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            return await super().transfer(plan)
        finally:
            self.active -= 1


class _Cluster:
    def __init__(self, config: ChaosConfig) -> None:
        self.config = config
        self.registry = MemoryRegistry()
        secret = new_secret()
        self.corrupters: list[CorruptingSource] = []
        self.prefill: list[PrefillWorker] = []
        self.decode: list[DecodeWorker] = []
        nodes = 2
        for i in range(config.decode_workers):
            info = WorkerInfo(
                worker_id=f"decode-{i}",
                role="decode",
                node=f"node{i % nodes}",
                host_id="chaos-host",
                gpus=(4 + i // nodes,),
                capacity=config.decode_capacity,
            )
            self.decode.append(DecodeWorker(info, secret))
        for i in range(config.prefill_workers):
            info = WorkerInfo(
                worker_id=f"prefill-{i}",
                role="prefill",
                node=f"node{i % nodes}",
                host_id="chaos-host",
                gpus=(i // nodes,),
            )
            self.prefill.append(PrefillWorker(info, secret, self._wrapper(i)))
        self.executor = _CountingExecutor([*self.prefill, *self.decode])
        for worker in [*self.prefill, *self.decode]:
            worker.register(self.registry, ttl_s=3600)

    def _wrapper(self, index: int) -> SourceWrapper:
        config = self.config
        slowed = index == config.prefill_workers - 1

        def wrap(medium: str, source: TransferSource) -> TransferSource:
            if config.slow_link_gbps is not None and slowed:
                link = LinkModel(TransportMode(source.mode), config.slow_link_gbps, 50e-6)
                source = EmulatedSource(source, link)
            corrupter = CorruptingSource(source, config.corrupt_rate, config.seed * 1000 + index)
            self.corrupters.append(corrupter)
            return corrupter

        return wrap


def _stamped(base: bytes, request_id: int, layout: KVLayout) -> list[tuple[bytearray, ...]]:
    stamp = request_id.to_bytes(8, "little")
    layers = []
    for layer in range(layout.num_layers):
        tensors = []
        for t in range(layout.tensors_per_layer):
            buf = bytearray(base)
            buf[:8] = stamp
            buf[8:16] = (layer * 2 + t).to_bytes(8, "little")
            tensors.append(buf)
        layers.append(tuple(tensors))
    return layers


async def run_chaos(config: ChaosConfig) -> ChaosReport:
    """Run the chaos scenario and return its accounting."""
    cluster = _Cluster(config)
    layout = config.layout()
    base = random.Random(config.seed).randbytes(layout.tensor_bytes)
    report = ChaosReport()
    expected: dict[int, int] = {}
    orch_config = OrchestratorConfig(
        max_in_flight=config.limit,
        queue_size=config.limit,
        retry=RetryPolicy(max_retries=2, backoff_s=config.backoff_s, max_reroutes=2),
        attempt_timeout_s=config.attempt_timeout_s,
        route_wait_s=30.0,
    )
    orch = Orchestrator(cluster.registry, cluster.executor, config=orch_config)
    by_id = {w.info.worker_id: w for w in cluster.decode}
    victim = cluster.decode[0] if config.kill_decoder_after is not None else None
    started = time.perf_counter()
    ended: set[int] = set()
    delivered_ok = 0

    def account(completion_outcome: Outcome, request_id: int, destination: str | None) -> None:
        nonlocal delivered_ok
        if request_id in ended:
            report.lost += 1  # a second completion for one request would be a bug
            return
        ended.add(request_id)
        if completion_outcome == Outcome.DELIVERED:
            worker = by_id.get(destination or "")
            kv = worker.take(request_id) if worker is not None else None
            orch.release_decode_slot(request_id)
            if kv is None:
                report.lost += 1
                return
            if content_digest(kv.layers) != expected[request_id]:
                report.corrupt_delivered += 1
            kv.release()
            report.delivered += 1
            delivered_ok += 1
        else:
            report.failed_clean += 1

    async def consume() -> None:
        killed = False
        while len(ended) < config.transfers:
            completion = await orch.next_completion(config.run_timeout_s)
            account(completion.outcome, completion.request_id, completion.destination)
            if (
                victim is not None
                and not killed
                and delivered_ok >= (config.kill_decoder_after or 0)
            ):
                # Decode takes each verified copy at once: drain what is waiting, then die.
                while (waiting := orch.completion_nowait()) is not None:
                    account(waiting.outcome, waiting.request_id, waiting.destination)
                victim.kill()
                report.killed = victim.info.worker_id
                killed = True

    async with orch:
        consumer = asyncio.create_task(consume())
        for request_id in range(config.transfers):
            worker = cluster.prefill[request_id % len(cluster.prefill)]
            layers = _stamped(base, request_id, layout)
            expected[request_id] = content_digest(layers)
            digest = worker.hold(request_id, "chaos", layout, layers)
            await orch.submit(
                request_id, "chaos", layout, worker.info.worker_id, source_digest=digest
            )
            report.submitted += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(consumer, config.run_timeout_s)
        report.lost += config.transfers - len(ended)
        report.max_in_flight = max(orch.max_in_flight_seen, cluster.executor.peak)
        m = orch.metrics
        report.corrupt_detected = int(m.value("topkv_checksum_failures_total"))
        report.retries = int(m.value("topkv_transfer_retries_total"))
        report.failovers = int(m.value("topkv_transfer_failovers_total"))
        records = [orch.transfers.get(i) for i in range(config.transfers)]
        report.rerouted = sum(1 for r in records if r is not None and r.reroutes > 0)
        for r in records:
            if r is not None and r.outcome == Outcome.DELIVERED:
                report.by_medium[r.medium] = report.by_medium.get(r.medium, 0) + 1
                report.bytes_delivered += r.size_bytes
        report.injected_corruptions = sum(c.injected for c in cluster.corrupters)
        detail = {
            "source_kv": sum(len(w.held()) for w in cluster.prefill),
            "destination_kv": sum(len(w.held()) for w in cluster.decode),
            "active_transfers": orch.transfers.active_count,
            "decode_slots": sum(orch.slots_used(w.info.worker_id) for w in cluster.decode),
            "registry_entries_of_killed": int(
                victim is not None
                and report.killed is not None
                and cluster.registry.get(victim.info.worker_id) is not None
            ),
        }
    await cluster.executor.close()
    detail["shm_segments"] = len(segments_of(os.getpid()))
    report.stranded_detail = detail
    report.stranded_after = sum(detail.values())
    report.seconds = time.perf_counter() - started
    return report
