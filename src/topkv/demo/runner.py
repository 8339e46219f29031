"""Drives one demo run: replay the workload through the cluster and measure every request.

Per request: route it (decode worker and transport, chosen by the same routing and
selection policies as the relay) when a prefill worker is free; the prefill worker runs
one forward pass and streams each layer to the decode worker as soon as it is computed;
the decode worker starts when the last layer landed verified and prefill's first token
arrived, and generates ``new_tokens`` greedily. Then the same KV is sent again as a whole
(the serial baseline) and, unless the path was already RDMA, once more over emulated RDMA
replaying the recorded layer-ready schedule (the uniform-RDMA baseline, measured). Finally
every prompt is generated in a single process (spread over all workers, after the timed
phase so it disturbs no measurement) and the tokens are compared.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from topkv.demo import measure
from topkv.demo.cluster import LocalCluster
from topkv.demo.errors import DemoError
from topkv.demo.protocol import (
    Decoded,
    Event,
    Expect,
    Failed,
    LinkSpec,
    Prefill,
    PrefillDone,
    Received,
    Reference,
    ReferenceDone,
    Release,
    Send,
    SendDone,
)
from topkv.demo.topology import (
    DEFAULT_FIXTURE,
    DEFAULT_PLACEMENTS,
    LinkChoice,
    Placement,
    find_fixture,
    pair_view,
    two_node_cluster,
    worker_info,
)
from topkv.demo.workload import DemoRequest, find_trace, load_requests
from topkv.engine.spec import DemoModelConfig
from topkv.policy import CostPolicy, DecodeWorkerView, RoutingPolicy, TransferRequest, UniformPolicy
from topkv.policy.route import RouteDecision
from topkv.relay.registry import MemoryRegistry
from topkv.topology.model import Cluster

now = time.perf_counter
STREAM, SERIAL, REPLAY = "stream", "serial", "replay"
_TAG_INDEX = {STREAM: 0, SERIAL: 1, REPLAY: 2}


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


@dataclass(frozen=True)
class RequestResult:
    """One request's figures (milliseconds of wall clock on this host)."""

    id: int
    transport: str
    medium: str
    prefill_worker: str
    decode_worker: str
    prompt_len: int
    trace_prompt_tokens: int
    bytes: int
    prefill_ms: float
    transfer_ms: float
    exposed_ms: float
    modelled_exposed_ms: float
    serial_ms: float
    ttft_ms: float
    uniform_rdma_exposed_ms: float
    uniform_rdma_ttft_ms: float
    tokens_identical: bool
    emulated: bool
    dilation: float
    error: str | None = None


@dataclass
class _Request:
    request: DemoRequest
    stage: str = "waiting"
    arrival_s: float = 0.0
    prefill_worker: str = ""
    decode_worker: str = ""
    link: LinkChoice | None = None
    rdma_link: LinkChoice | None = None
    prefill: PrefillDone | None = None
    sends: dict[str, SendDone] = field(default_factory=dict)
    received: dict[str, Received] = field(default_factory=dict)
    decoded: Decoded | None = None
    reference: ReferenceDone | None = None
    error: str | None = None

    @property
    def rid(self) -> int:
        return self.request.rid

    def fail(self, message: str) -> None:
        if self.error is None:
            self.error = message
        self.stage = "failed"


@dataclass(frozen=True)
class Progress:
    """A snapshot for the live view."""

    phase: str
    elapsed_s: float
    total: int
    stages: dict[str, int]
    by_transport: dict[str, int]
    finished: list[RequestResult]


ProgressCallback = Callable[[Progress], None]


class DemoRouter:
    """Decode-worker routing and transport selection (the relay's policies) on the topology.

    Workers are registered in the embedded registry; each decode worker has
    ``capacity`` slots, taken from routing until its decode ends.
    """

    def __init__(
        self,
        topology: Cluster,
        placements: list[Placement],
        registry: MemoryRegistry,
        capacity: int,
    ) -> None:
        self.topology = topology
        self.placements = {p.worker_id: p for p in placements}
        self.registry = registry
        self.capacity = capacity
        self.used: dict[str, int] = {}
        self.selector = CostPolicy()
        self.routing = RoutingPolicy()

    def route(self, source: str, nbytes: int, chunks: int) -> RouteDecision | None:
        src = self.placements[source].endpoint
        views = [
            DecodeWorkerView(
                worker_id=info.worker_id,
                endpoint=self.placements[info.worker_id].endpoint,
                free_slots=self.capacity - self.used.get(info.worker_id, 0),
                load=self.used.get(info.worker_id, 0) / self.capacity,
            )
            for info in self.registry.workers("decode")
        ]
        decision = self.routing.choose_decode(
            src,
            views,
            lambda a, b: pair_view(self.topology, a, b),
            TransferRequest(nbytes, chunks),
            self.selector,
        )
        if decision is not None:
            self.used[decision.worker_id] = self.used.get(decision.worker_id, 0) + 1
        return decision

    def release(self, worker_id: str) -> None:
        self.used[worker_id] = max(0, self.used.get(worker_id, 0) - 1)

    def uniform_rdma(self, source: str, destination: str, nbytes: int, chunks: int) -> LinkChoice:
        pair = pair_view(
            self.topology, self.placements[source].endpoint, self.placements[destination].endpoint
        )
        return LinkChoice.from_selection(
            UniformPolicy("rdma").select(pair, TransferRequest(nbytes, chunks))
        )


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
        self.states = {r.rid: _Request(r) for r in self.requests}
        self.phase = "starting workers"
        self.started_s = now()
        self.model_id = ""
        self.layer_bytes_per_token = 0
        self.layers = 0

    # -- public ----------------------------------------------------------------------------

    def run(self) -> list[RequestResult]:
        with LocalCluster(
            self.placements,
            model=self.options.model,
            seed=self.options.seed,
            model_path=self.options.model_path,
        ) as cluster:
            self.cluster = cluster
            first = next(iter(cluster.ready.values()))
            self.model_id = first.model_id
            self.layers = first.layers
            itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[first.dtype]
            self.layer_bytes_per_token = 2 * first.kv_heads * first.head_dim * itemsize
            registry = MemoryRegistry()
            for placement in self.placements:
                ready = cluster.ready[placement.worker_id]
                address = ready.addresses.get("tcp", "")
                registry.register(worker_info(placement, self.topology, address), ttl_s=3600)
            self.router = DemoRouter(
                self.topology, self.placements, registry, self.options.decode_capacity
            )
            self.addresses = {w: r.addresses for w, r in cluster.ready.items()}
            self._timed_phase()
            self._reference_phase()
        return [self._result(s) for s in self.states.values()]

    # -- timed phase -----------------------------------------------------------------------

    def _timed_phase(self) -> None:
        self.phase = "replaying requests"
        start = now() + 0.05
        waiting = sorted(self.states.values(), key=lambda s: s.request.arrival_s)
        queued: list[_Request] = []
        busy: dict[str, int | None] = {
            p.worker_id: None for p in self.placements if p.role == "prefill"
        }
        self._busy = busy
        deadline_of: dict[int, float] = {}
        while any(s.stage not in ("transferred", "failed") for s in self.states.values()):
            t = now()
            while waiting and start + waiting[0].request.arrival_s <= t:
                state = waiting.pop(0)
                state.stage = "queued"
                state.arrival_s = start + state.request.arrival_s
                queued.append(state)
                deadline_of[state.rid] = state.arrival_s + self.options.request_timeout_s
            for worker_id in sorted(busy, key=lambda w: w):
                if busy[worker_id] is None and queued and self._dispatch(queued[0], worker_id):
                    busy[worker_id] = queued.pop(0).rid
            next_arrival = start + waiting[0].request.arrival_s - t if waiting else 0.2
            event = self.cluster.next_event(timeout=min(0.2, max(0.001, next_arrival)))
            if event is not None:
                self._handle(event)
            for rid, deadline in deadline_of.items():
                state = self.states[rid]
                if state.stage not in ("transferred", "failed") and now() > deadline:
                    state.fail(f"timed out in stage {state.stage}")
                    self._finish_transfers(state)
            self._report()

    def _dispatch(self, state: _Request, prefill_worker: str) -> bool:
        """Route ``state`` from ``prefill_worker``; False when no decode slot is free."""
        prompt_len = state.request.prompt_len
        nbytes = prompt_len * self.layer_bytes_per_token * self.layers
        decision = self.router.route(prefill_worker, nbytes, self.layers)
        if decision is None:
            return False
        state.prefill_worker = prefill_worker
        state.decode_worker = decision.worker_id
        state.link = LinkChoice.from_selection(decision.selection)
        state.rdma_link = self.router.uniform_rdma(
            prefill_worker, decision.worker_id, nbytes, self.layers
        )
        state.stage = "prefill"
        rid = state.rid
        self.cluster.send(prefill_worker, Prefill(rid, prompt_len, state.request.prompt_seed))
        self._expect(state, STREAM, "decode")
        self._send(state, STREAM, state.link, first_token_to=decision.worker_id)
        return True

    def _wire(self, state: _Request, tag: str) -> int:
        return state.rid * 4 + _TAG_INDEX[tag]

    def _expect(self, state: _Request, tag: str, kind: str) -> None:
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

    def _send(
        self, state: _Request, tag: str, link: LinkChoice, first_token_to: str | None = None
    ) -> None:
        self.cluster.send(
            state.prefill_worker,
            Send(
                rid=state.rid,
                tag=tag,
                wire_rid=self._wire(state, tag),
                medium=link.medium,
                destination=self.addresses[state.decode_worker][link.medium],
                link=LinkSpec(link.mode, link.bandwidth_gbps, link.setup_s, self.options.dilation),
                schedule="stream" if tag == STREAM else tag,  # type: ignore[arg-type]
                first_token_to=first_token_to,
                timeout_s=self.options.request_timeout_s,
            ),
        )

    def _handle(self, event: Event) -> None:
        if isinstance(event, Failed):
            for worker_id, rid in self._busy.items():
                if rid == event.rid and worker_id == event.worker_id:
                    self._busy[worker_id] = None
            if event.rid in self.states:
                self.states[event.rid].fail(f"{event.worker_id}: {event.message}")
                self._finish_transfers(self.states[event.rid])
                return
            raise DemoError(f"{event.worker_id}: {event.message}")
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
            elif event.tag == STREAM:
                if state.stage in ("prefill", "transfer"):
                    state.stage = "decode"
                self._expect(state, SERIAL, "drain")
                assert state.link is not None
                self._send(state, SERIAL, state.link)
            else:
                self._advance(state)
        elif isinstance(event, Decoded):
            state.decoded = event
            self.router.release(state.decode_worker)
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

    def _advance(self, state: _Request) -> None:
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

    def _finish_transfers(self, state: _Request) -> None:
        if state.prefill_worker:
            self.cluster.send(state.prefill_worker, Release(state.rid))
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
                finished.append(self._result(state))
        self.on_progress(
            Progress(
                self.phase, t - self.started_s, len(self.states), stages, by_transport, finished
            )
        )

    def _result(self, state: _Request) -> RequestResult:
        link = state.link
        request = state.request
        nbytes = request.prompt_len * self.layer_bytes_per_token * self.layers
        nan = math.nan
        figures = dict(
            prefill_ms=nan, transfer_ms=nan, exposed_ms=nan, modelled_exposed_ms=nan,
            serial_ms=nan, ttft_ms=nan, uniform_rdma_exposed_ms=nan, uniform_rdma_ttft_ms=nan,
        )  # fmt: skip
        error = state.error
        try:
            figures.update(self._figures(state))
        except DemoError as exc:
            error = error or str(exc)
        except (KeyError, AssertionError) as exc:
            error = error or f"incomplete measurement (stage {state.stage}): {exc!r}"
        identical = (
            error is None
            and state.decoded is not None
            and state.reference is not None
            and state.decoded.tokens == state.reference.tokens
        )
        return RequestResult(
            id=request.rid,
            transport=link.mode if link else "",
            medium=link.medium if link else "",
            prefill_worker=state.prefill_worker,
            decode_worker=state.decode_worker,
            prompt_len=request.prompt_len,
            trace_prompt_tokens=request.trace_prompt_tokens,
            bytes=nbytes,
            tokens_identical=bool(identical),
            emulated=True,
            dilation=self.options.dilation,
            error=error,
            **figures,
        )

    def _figures(self, state: _Request) -> dict[str, float]:
        prefill, decoded = state.prefill, state.decoded
        stream, serial_send = state.sends[STREAM], state.sends[SERIAL]
        serial_recv = state.received[SERIAL]
        assert prefill is not None and decoded is not None
        prefill_end = prefill.forward_end_s
        exposed = measure.exposed_after(prefill_end, decoded.arrivals_s)
        link_s = measure.link_times_from_serial(
            serial_send.offered_s, serial_send.handed_s, serial_recv.arrivals_s
        )
        modelled = measure.modelled_exposed_s(
            prefill.forward_start_s, prefill.layer_ready_s, prefill_end, link_s
        )
        ttft = decoded.decode_start_s - state.arrival_s
        if REPLAY in state.received:
            replay_send, replay_recv = state.sends[REPLAY], state.received[REPLAY]
            replay_end = replay_send.start_s + (prefill_end - prefill.forward_start_s)
            rdma_exposed = measure.exposed_after(replay_end, replay_recv.arrivals_s)
        else:
            rdma_exposed = exposed
        ms = 1e3
        return {
            "prefill_ms": (prefill_end - prefill.forward_start_s) * ms,
            "transfer_ms": (measure.last_landed(decoded.arrivals_s) - stream.offered_s[0]) * ms,
            "exposed_ms": exposed * ms,
            "modelled_exposed_ms": modelled * ms,
            "serial_ms": (measure.last_landed(serial_recv.arrivals_s) - serial_send.start_s) * ms,
            "ttft_ms": ttft * ms,
            "uniform_rdma_exposed_ms": rdma_exposed * ms,
            "uniform_rdma_ttft_ms": (ttft - exposed + rdma_exposed) * ms,
        }
