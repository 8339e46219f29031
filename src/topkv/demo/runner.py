"""Drives one demo run: replay the workload through the cluster and measure every request.

Per request, when a prefill worker is free (and some decode worker has a free slot): the
prefill worker starts its one forward pass and the request is submitted at once to the
relay :class:`~topkv.relay.orchestrator.Orchestrator` (embedded registry, the demo's
topology as pair views, ``CostPolicy``) with a deferred source digest. The orchestrator
routes it (decode worker), ranks the transports and starts the attempt through
:class:`~topkv.demo.executor.DemoExecutor`: each layer goes out as prefill's hook
publishes it. Once the last layer landed, the decode worker's digest is checked against
the prefill worker's; on the orchestrator's completion the decode worker takes the
verified copy with prefill's first token and generates ``new_tokens`` greedily.

Then the same KV is sent again as a whole (the serial baseline) and, unless the path was
already RDMA, once more over emulated RDMA replaying the recorded layer-ready schedule (the
uniform-RDMA baseline, measured); these two go straight between the workers. Finally every
prompt is generated in a single process (spread over all workers, after the timed phase
so it disturbs no measurement) and the tokens are compared.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from topkv.demo.cluster import DemoCluster
from topkv.demo.errors import DemoError
from topkv.demo.executor import DemoExecutor, WorkerPort
from topkv.demo.protocol import (
    Decoded,
    Discard,
    Event,
    Expect,
    Failed,
    Held,
    LinkSpec,
    Prefill,
    PrefillDone,
    Received,
    Reference,
    ReferenceDone,
    Release,
    Send,
    SendDone,
    Take,
)
from topkv.demo.results import (
    REPLAY,
    SERIAL,
    STREAM,
    Progress,
    ProgressCallback,
    RequestResult,
    RequestState,
    request_result,
)
from topkv.demo.topology import (
    DEFAULT_FIXTURE,
    DEFAULT_PLACEMENTS,
    LinkChoice,
    find_fixture,
    pair_view,
    two_node_cluster,
    worker_info,
)
from topkv.demo.workload import find_trace, load_requests
from topkv.engine.spec import DemoModelConfig
from topkv.errors import TopKVError
from topkv.policy import PairView, TransferRequest, UniformPolicy
from topkv.relay.completions import Completion
from topkv.relay.orchestrator import Orchestrator
from topkv.relay.orchestrator_config import OrchestratorConfig
from topkv.relay.registry import MemoryRegistry
from topkv.relay.transfers import Outcome, TransferState
from topkv.relay.workers import WorkerInfo
from topkv.service.engines import WIRE_DTYPES
from topkv.transport.base import KVLayout

now = time.perf_counter


@dataclass(frozen=True)
class DemoOptions:
    requests: int = 50
    seed: int = 0
    model_path: str | None = None
    new_tokens: int = 8
    dilation: float = 3000.0
    speedup: float = 1.5
    min_tokens: int = 128
    max_tokens: int = 1024
    trace: Path | None = None
    fixture: str = DEFAULT_FIXTURE
    decode_capacity: int = 2
    request_timeout_s: float = 90.0
    model: DemoModelConfig = field(default_factory=DemoModelConfig)

    def __post_init__(self) -> None:
        if self.new_tokens < 1:
            raise DemoError(f"--new-tokens must be >= 1, got {self.new_tokens}")
        if not (math.isfinite(self.dilation) and self.dilation >= 1):
            raise DemoError(f"--dilation must be >= 1, got {self.dilation}")
        if self.decode_capacity < 1:
            raise DemoError(f"decode capacity must be >= 1, got {self.decode_capacity}")


class DemoRun:
    def __init__(self, options: DemoOptions, on_progress: ProgressCallback | None = None) -> None:
        self.options = options
        self.on_progress = on_progress
        self.requests = load_requests(
            find_trace(options.trace),
            options.requests,
            seed=options.seed,
            min_tokens=options.min_tokens,
            max_tokens=options.max_tokens,
            speedup=options.speedup,
        )
        self.topology = two_node_cluster(find_fixture(options.fixture))
        self.placements = list(DEFAULT_PLACEMENTS)
        self._placement = {p.worker_id: p for p in self.placements}
        self.states = {r.rid: RequestState(r) for r in self.requests}
        self.phase = "starting workers"
        self.started_s = now()
        self.model_id = ""
        self.layer_bytes_per_token = 0
        self.layers = 0
        self.kv_heads = 0
        self.head_dim = 0
        self.wire_dtype = "fp32"
        self._links: dict[tuple[str, str, str], LinkChoice] = {}
        self._pump_error: BaseException | None = None
        self._aborts: set[asyncio.Task[object]] = set()
        self._finished: dict[int, tuple[str, RequestResult]] = {}
        self.attempts_total = 0

    # -- public ----------------------------------------------------------------------------

    def run(self) -> list[RequestResult]:
        with DemoCluster(
            self.placements,
            model=self.options.model,
            seed=self.options.seed,
            model_path=self.options.model_path,
        ) as cluster:
            self.cluster = cluster
            first = next(iter(cluster.ready.values()))
            self.model_id = first.model_id
            self.layers = first.layers
            self.kv_heads, self.head_dim = first.kv_heads, first.head_dim
            self.wire_dtype = WIRE_DTYPES[first.dtype]
            itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[first.dtype]
            self.layer_bytes_per_token = 2 * first.kv_heads * first.head_dim * itemsize
            registry = MemoryRegistry()
            for placement in self.placements:
                ready = cluster.ready[placement.worker_id]
                address = ready.addresses.get("tcp", "")
                capacity = self.options.decode_capacity if placement.role == "decode" else 1
                info = worker_info(placement, self.topology, address, capacity)
                registry.register(info, ttl_s=3600)
            self.addresses = {w: r.addresses for w, r in cluster.ready.items()}
            self.executor = DemoExecutor(
                WorkerPort(cluster.send, lambda w: bool(cluster.processes[w].is_alive())),
                self.addresses,
                self.link_for,
                dilation=self.options.dilation,
                new_tokens=self.options.new_tokens,
                timeout_s=self.options.request_timeout_s,
            )
            asyncio.run(self._timed_phase(registry))
            self._reference_phase()
        return [self._result(s) for s in self.states.values()]

    def link_for(
        self, source: str, destination: str, transport: str, nbytes: int, chunks: int
    ) -> LinkChoice:
        """The emulated path ``transport`` takes between two workers (paced to it)."""
        key = (source, destination, transport)
        found = self._links.get(key)
        if found is None:
            pair = pair_view(
                self.topology,
                self._placement[source].endpoint,
                self._placement[destination].endpoint,
            )
            selection = UniformPolicy(transport).select(pair, TransferRequest(nbytes, chunks))
            if selection.chosen.transport != transport:
                raise DemoError(f"no {transport} path from {source} to {destination}")
            found = self._links[key] = LinkChoice.from_selection(selection)
        return found

    def _relay_pair_view(self, source: WorkerInfo, destination: WorkerInfo) -> PairView:
        return pair_view(
            self.topology,
            self._placement[source.worker_id].endpoint,
            self._placement[destination.worker_id].endpoint,
        )

    def _layout(self, prompt_len: int) -> KVLayout:
        return KVLayout(
            num_layers=self.layers,
            seq_len=prompt_len,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            dtype=self.wire_dtype,
        )

    # -- timed phase -----------------------------------------------------------------------

    async def _timed_phase(self, registry: MemoryRegistry) -> None:
        """Replay the requests through the relay orchestrator, events pumped from workers."""
        self.phase = "replaying requests"
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        stop = threading.Event()
        pump = threading.Thread(
            target=self._pump, args=(loop, stop), name="demo-event-pump", daemon=True
        )
        timeout = self.options.request_timeout_s
        config = OrchestratorConfig(
            attempt_timeout_s=timeout,
            executor_call_timeout_s=timeout,
            route_wait_s=timeout,
            submit_timeout_s=timeout,
        )
        # The pump thread must get the GIL at once when an event arrives (the default 5 ms
        # switch interval would hold handoffs back while the loop thread runs).
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(0.0005)
        pump.start()
        try:
            async with Orchestrator(
                registry, self.executor, config=config, pair_view=self._relay_pair_view
            ) as orch:
                self.orch = orch
                consumer = asyncio.create_task(self._consume_completions(orch))
                try:
                    await self._replay(orch)
                finally:
                    consumer.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await consumer
        finally:
            stop.set()
            pump.join(2.0)
            sys.setswitchinterval(switch_interval)
        self.attempts_total = self.executor.attempts
        if self._pump_error is not None:
            raise self._pump_error

    def _pump(self, loop: asyncio.AbstractEventLoop, stop: threading.Event) -> None:
        """Worker events -> the event loop (this thread only blocks on the queue)."""
        while not stop.is_set():
            try:
                event = self.cluster.next_event(timeout=0.1)
            except BaseException as exc:  # a worker process died
                loop.call_soon_threadsafe(self._on_pump_error, exc)
                return
            if event is not None:
                loop.call_soon_threadsafe(self._on_event, event)

    def _on_pump_error(self, exc: BaseException) -> None:
        self._pump_error = exc
        self._wake.set()

    def _on_event(self, event: Event) -> None:
        self.executor.on_event(event)
        self._handle(event)
        self._wake.set()

    async def _replay(self, orch: Orchestrator) -> None:
        start = now() + 0.05
        waiting = sorted(self.states.values(), key=lambda s: s.request.arrival_s)
        queued: list[RequestState] = []
        busy: dict[str, int | None] = {
            p.worker_id: None for p in self.placements if p.role == "prefill"
        }
        self._busy = busy
        deadline_of: dict[int, float] = {}
        while any(s.stage not in ("transferred", "failed") for s in self.states.values()):
            self._wake.clear()
            if self._pump_error is not None:
                return
            t = now()
            while waiting and start + waiting[0].request.arrival_s <= t:
                state = waiting.pop(0)
                state.stage = "queued"
                state.arrival_s = start + state.request.arrival_s
                queued.append(state)
                deadline_of[state.rid] = state.arrival_s + self.options.request_timeout_s
            for worker_id in sorted(busy):
                if busy[worker_id] is None and queued and self._decode_slot_free(orch):
                    state = queued.pop(0)
                    busy[worker_id] = state.rid
                    await self._dispatch(orch, state, worker_id)
            for rid, deadline in deadline_of.items():
                state = self.states[rid]
                if state.stage not in ("transferred", "failed") and now() > deadline:
                    state.fail(f"timed out in stage {state.stage}")
                    self._finish_transfers(state)
                    if orch.transfers.get(rid) is not None:
                        await orch.abort(rid)
            self._report()
            next_arrival = start + waiting[0].request.arrival_s - now() if waiting else 0.2
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), min(0.2, max(0.001, next_arrival)))

    def _decode_slot_free(self, orch: Orchestrator) -> bool:
        """Admission: start a prefill only when some decode worker can take its KV (slots
        reserved by the relay's routing, less the requests it has yet to route)."""
        free = sum(
            max(0, self.options.decode_capacity - orch.slots_used(p.worker_id))
            for p in self.placements
            if p.role == "decode"
        )
        return free > len(orch.query(TransferState.QUEUED))

    async def _dispatch(self, orch: Orchestrator, state: RequestState, prefill_worker: str) -> None:
        """Start prefill on ``prefill_worker`` and hand the request to the orchestrator at
        once: it routes, selects and starts streaming while prefill still computes."""
        state.prefill_worker = prefill_worker
        state.stage = "prefill"
        request = state.request
        self.cluster.send(
            prefill_worker, Prefill(state.rid, request.prompt_len, request.prompt_seed)
        )
        try:
            await orch.submit(
                state.rid,
                self.model_id,
                self._layout(request.prompt_len),
                prefill_worker,
                block=False,
                defer_digest=True,
            )
        except TopKVError as exc:
            state.fail(f"relay refused the request: {exc}")
            self.cluster.send(prefill_worker, Release(state.rid, "relay"))
            self._finish_transfers(state)

    async def _consume_completions(self, orch: Orchestrator) -> None:
        while True:
            completion = await orch.next_completion(timeout_s=3600.0)
            self._on_completion(completion)
            self._wake.set()

    def _on_completion(self, completion: Completion) -> None:
        state = self.states.get(completion.request_id)
        if state is None:
            return
        record = self.orch.transfers.get(completion.request_id)
        if record is not None:
            state.attempts = len(record.attempts)
        if completion.outcome != Outcome.DELIVERED or completion.destination is None:
            state.fail(f"relay: {completion.outcome.value}: {completion.reason}")
            self._finish_transfers(state)
            return
        attempt = self.executor.delivered.get(completion.request_id)
        if state.stage == "failed" or attempt is None:
            self.cluster.send(completion.destination, Discard(state.rid))
            self._release_slot(state.rid)
            state.fail(state.error or "delivered copy unknown to the executor")
            self._finish_transfers(state)
            return
        state.decode_worker = completion.destination
        state.link = attempt.link
        state.sends[STREAM] = attempt.send
        nbytes = completion.size_bytes
        state.rdma_link = self.link_for(
            state.prefill_worker, state.decode_worker, "rdma", nbytes, self.layers
        )
        self.cluster.send(state.decode_worker, Take(state.rid, attempt.wire_rid))
        if state.stage in ("prefill", "transfer"):
            state.stage = "decode"
        self._expect(state, SERIAL, "drain")
        self._send(state, SERIAL, attempt.link)

    def _release_slot(self, rid: int) -> None:
        with contextlib.suppress(TopKVError):
            self.orch.release_decode_slot(rid)

    def _wire(self, state: RequestState, tag: str) -> int:
        wire = state.wires.get(tag)
        if wire is None:
            wire = state.wires[tag] = self.executor.new_wire()
        return wire

    def _expect(self, state: RequestState, tag: str, kind: str) -> None:
        link = state.rdma_link if tag == REPLAY else state.link
        assert link is not None
        self.cluster.send(
            state.decode_worker,
            Expect(
                rid=state.rid,
                tag=tag,
                wire_rid=self._wire(state, tag),
                medium=link.medium,
                kind="decode" if kind == "decode" else "drain",
                prompt_len=state.request.prompt_len,
                max_new_tokens=self.options.new_tokens,
                timeout_s=self.options.request_timeout_s,
            ),
        )

    def _send(self, state: RequestState, tag: str, link: LinkChoice) -> None:
        self.cluster.send(
            state.prefill_worker,
            Send(
                rid=state.rid,
                tag=tag,
                wire_rid=self._wire(state, tag),
                medium=link.medium,
                destination=self.addresses[state.decode_worker][link.medium],
                link=LinkSpec(link.mode, link.bandwidth_gbps, link.setup_s, self.options.dilation),
                schedule="serial" if tag == SERIAL else "replay",
                timeout_s=self.options.request_timeout_s,
            ),
        )

    def _handle(self, event: Event) -> None:
        if isinstance(event, Failed):
            for worker_id, rid in self._busy.items():
                if rid == event.rid and worker_id == event.worker_id:
                    self._busy[worker_id] = None
            failed = self.states.get(event.rid)
            if failed is not None:
                failed.fail(f"{event.worker_id}: {event.message}")
                self._finish_transfers(failed)
                record = self.orch.transfers.get(event.rid)
                if record is not None and not record.terminal:
                    task = asyncio.get_running_loop().create_task(self.orch.abort(event.rid))
                    self._aborts.add(task)
                    task.add_done_callback(self._aborts.discard)
                return
            raise DemoError(f"{event.worker_id}: {event.message}")
        if isinstance(event, Held) or (isinstance(event, SendDone) and event.tag == STREAM):
            return  # the executor's: one attempt of the relay's transfer
        state = self.states.get(event.rid) if hasattr(event, "rid") else None
        if state is None:
            return
        if isinstance(event, PrefillDone):
            state.prefill = event
            self._busy[event.worker_id] = None
            if state.stage == "prefill":
                state.stage = "transfer"
        elif isinstance(event, SendDone):
            state.sends[event.tag] = event
            if event.error is not None:
                state.fail(f"{event.tag} send: {event.error}")
                self._finish_transfers(state)
            else:
                self._advance(state)
        elif isinstance(event, Decoded):
            state.decoded = event
            self._release_slot(state.rid)
            if event.error is not None:
                state.fail(f"decode: {event.error}")
            self._advance(state)
        elif isinstance(event, Received):
            state.received[event.tag] = event
            if event.error is not None:
                state.fail(f"{event.tag} copy: {event.error}")
                self._finish_transfers(state)
            elif event.tag == SERIAL and state.link is not None and state.link.mode != "rdma":
                assert state.rdma_link is not None
                self._expect(state, REPLAY, "drain")
                self._send(state, REPLAY, state.rdma_link)
            else:
                self._advance(state)
        elif isinstance(event, ReferenceDone):
            state.reference = event

    def _advance(self, state: RequestState) -> None:
        if state.stage == "failed":
            self._finish_transfers(state)
            return
        needs_replay = state.link is not None and state.link.mode != "rdma"
        copies = (SERIAL, REPLAY) if needs_replay else (SERIAL,)
        done_copies = all(c in state.received and c in state.sends for c in copies)
        if state.decoded is None:
            return
        state.stage = "baselines" if not done_copies else "transferred"
        if done_copies:
            self._finish_transfers(state)

    def _finish_transfers(self, state: RequestState) -> None:
        """The baselines are done with the request's KV (the relay releases its own hold)."""
        if state.prefill_worker and not state.baselines_released:
            state.baselines_released = True
            self.cluster.send(state.prefill_worker, Release(state.rid, "baselines"))
        if state.stage != "failed":
            state.stage = "transferred"

    # -- reference phase -------------------------------------------------------------------

    def _reference_phase(self) -> None:
        self.phase = "single-process reference runs"
        workers = [p.worker_id for p in self.placements]
        pending = {s.rid for s in self.states.values() if s.decoded is not None}
        for index, rid in enumerate(sorted(pending)):
            state = self.states[rid]
            state.stage = "reference" if state.stage != "failed" else "failed"
            self.cluster.send(
                workers[index % len(workers)],
                Reference(
                    rid,
                    state.request.prompt_len,
                    state.request.prompt_seed,
                    self.options.new_tokens,
                ),
            )
        deadline = now() + self.options.request_timeout_s
        while pending and now() < deadline:
            event = self.cluster.next_event(timeout=0.2)
            if isinstance(event, ReferenceDone):
                pending.discard(event.rid)
                state = self.states[event.rid]
                state.reference = event
                if state.stage != "failed":
                    state.stage = "done"
            elif isinstance(event, Failed) and event.rid in pending:
                pending.discard(event.rid)
                self.states[event.rid].fail(f"{event.worker_id}: {event.message}")
            self._report()
        for rid in pending:
            self.states[rid].fail("no reference generation in time")
        self.phase = "done"
        self._report(force=True)

    # -- results ---------------------------------------------------------------------------

    _last_report = 0.0

    def _report(self, force: bool = False) -> None:
        if self.on_progress is None:
            return
        t = now()
        if not force and t - self._last_report < 0.1:
            return
        self._last_report = t
        stages: dict[str, int] = {}
        by_transport: dict[str, int] = {}
        finished: list[RequestResult] = []
        for state in self.states.values():
            stages[state.stage] = stages.get(state.stage, 0) + 1
            if state.link is not None:
                by_transport[state.link.mode] = by_transport.get(state.link.mode, 0) + 1
            if state.stage in ("transferred", "done") and state.decoded is not None:
                # Computed once per stage: the event loop must stay free for handoffs.
                cached = self._finished.get(state.rid)
                if cached is None or cached[0] != state.stage:
                    cached = self._finished[state.rid] = (state.stage, self._result(state))
                finished.append(cached[1])
        self.on_progress(
            Progress(
                self.phase, t - self.started_s, len(self.states), stages, by_transport, finished
            )
        )

    def _result(self, state: RequestState) -> RequestResult:
        return request_result(state, self.layer_bytes_per_token, self.layers, self.options.dilation)
