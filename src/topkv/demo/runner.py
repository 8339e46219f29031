"""Drives one demo run: replay the workload through the one runtime and measure every request.

:class:`DemoRun` drives the ``topkv worker --engine hf`` processes (:mod:`topkv.demo.cluster`)
through the relay :class:`~topkv.relay.orchestrator.Orchestrator` and
:class:`~topkv.service.orchestrator.executor.RemoteExecutor`, the same worker, executor and
orchestrator a deployment runs: each prefill streams its KV layer by layer, paced to the chosen
emulated path, and decode starts from the verified copy. Then come the serial and uniform-RDMA
baselines and the single-worker reference generation. Options: :class:`DemoOptions`. The
steps, in order: docs/demo.md ("What it runs").
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from topkv.demo.adp import DemoPool
from topkv.demo.cluster import DemoWorkers
from topkv.demo.compute import DEMO_TORCH_THREADS, ComputeEmulation, PacedTurns
from topkv.demo.emulation import Dilation, StandIn, resolve_dilation
from topkv.demo.errors import DemoError
from topkv.demo.executor import DemoExecutor
from topkv.demo.records import Decoded, PrefillDone, Received, ReferenceDone, SendDone
from topkv.demo.results import (
    CONTROL,
    REPLAY,
    SERIAL,
    STREAM,
    Progress,
    ProgressCallback,
    RequestResult,
    RequestState,
    baseline_copies,
    request_result,
)
from topkv.demo.tiers import demo_tiers
from topkv.demo.topology import (
    DEFAULT_FIXTURE,
    DEFAULT_PLACEMENTS,
    LinkChoice,
    demo_links,
    find_fixture,
    pair_view,
    two_node_cluster,
)
from topkv.demo.warmup import WarmUp, measure_kv_rate
from topkv.demo.workload import find_trace, load_requests
from topkv.engine.spec import DemoModelConfig
from topkv.errors import TopKVError
from topkv.policy import PairView, TransferRequest, UniformPolicy
from topkv.relay.completions import Completion
from topkv.relay.executor import AttemptPlan
from topkv.relay.orchestrator import Orchestrator
from topkv.relay.orchestrator_config import OrchestratorConfig
from topkv.relay.tasks import cancel_and_wait
from topkv.relay.transfers import Outcome, TransferState
from topkv.relay.workers import WorkerInfo
from topkv.service.compute.engines import EngineSpec
from topkv.service.compute.pace import PaceStats
from topkv.service.messages import GenerateRequest, PacedLink, PrefillRequest
from topkv.transport.base import KVLayout

now = time.perf_counter
Schedule = Literal["stream", "serial", "replay"]

#: Transfer ids of the baseline copies start here, far above any request id of a run.
_COPY_IDS_FROM = 1 << 40
#: KV caches a prefill worker may hold at once (its requests await their baselines).
PREFILL_CAPACITY = 64


@dataclass(frozen=True)
class DemoOptions:
    requests: int = 50
    seed: int = 0
    model_path: str | None = None
    new_tokens: int = 8
    #: None: derived from the stand-in deployment (topkv.demo.emulation)
    dilation: float | None = None
    speedup: float = 1.5
    min_tokens: int = 128
    max_tokens: int = 1024
    trace: Path | None = None
    fixture: str = DEFAULT_FIXTURE
    decode_capacity: int = 2
    request_timeout_s: float = 90.0
    model: DemoModelConfig = field(default_factory=DemoModelConfig)
    #: False: the relay's sends wait for the whole KV (no layer-by-layer streaming)
    pipelining: bool = True
    #: Run the Adaptive Decoder Pool on the demo's orchestrator (topkv.demo.adp)
    adp: bool = False
    #: The first trace request replayed (0-based)
    trace_start: int = 0
    #: KV caches each decode worker keeps on its device tier (topkv.demo.tiers); None: no
    #: tiers (every delivered cache stays where it landed)
    device_kv_capacity: int | None = None
    #: --compute: real (the workers share the host's cores) or paced (topkv.demo.compute)
    compute: ComputeEmulation = field(default_factory=ComputeEmulation)

    def __post_init__(self) -> None:
        if self.new_tokens < 1:
            raise DemoError(f"--new-tokens must be >= 1, got {self.new_tokens}")
        if self.dilation is not None and not (math.isfinite(self.dilation) and self.dilation >= 1):
            raise DemoError(f"--dilation must be >= 1, got {self.dilation}")
        if self.decode_capacity < 1:
            raise DemoError(f"decode capacity must be >= 1, got {self.decode_capacity}")
        if self.device_kv_capacity is not None and self.device_kv_capacity < 1:
            raise DemoError(f"--device-kv-capacity must be >= 1, got {self.device_kv_capacity}")


class _Pacing:
    """The emulated path of each attempt, as the demo's topology gives it (paced sends)."""

    def __init__(self, run: DemoRun) -> None:
        self.run = run

    def __call__(self, plan: AttemptPlan, medium: str) -> PacedLink:
        layout = plan.layout
        link = self.run.link_for(
            plan.source.worker_id,
            plan.destination.worker_id,
            plan.path_class,
            layout.total_bytes,
            layout.num_layers,
        )
        return self.run.paced(link)


#: The stand-in deployment over the run's prompt lengths (supplied above the demo, which
#: does not know the simulator's models: topkv.harness.stand_in).
StandInFactory = Callable[[Sequence[int]], StandIn]


class DemoRun:
    def __init__(
        self,
        options: DemoOptions,
        on_progress: ProgressCallback | None = None,
        stand_in: StandInFactory | None = None,
    ) -> None:
        self.options = options
        self.on_progress = on_progress
        self.requests = load_requests(
            find_trace(options.trace),
            options.requests,
            seed=options.seed,
            min_tokens=options.min_tokens,
            max_tokens=options.max_tokens,
            speedup=options.speedup,
            start=options.trace_start,
        )
        if options.model != DemoModelConfig():
            raise DemoError("the demo's workers serve the default demo model shape only")
        self.topology = two_node_cluster(find_fixture(options.fixture))
        self.placements = list(DEFAULT_PLACEMENTS)
        paced = options.compute.pace is not None
        if paced and options.compute.workers != len(self.placements):
            raise DemoError(f"paced compute derived for {options.compute.workers} workers")
        self._placement = {p.worker_id: p for p in self.placements}
        self.stand_in = stand_in([r.prompt_len for r in self.requests]) if stand_in else None
        if self.stand_in is None and options.dilation is None:
            raise DemoError("give --dilation or a stand-in deployment to derive it from")
        #: Set by the warm-up, before the timed phase.
        self.dilation: Dilation | None = None
        #: Given (a run of an ADP comparison after its first): the warm-up still runs, but
        #: the links keep this dilation, so every run of the comparison is paced alike.
        self.reuse_dilation: Dilation | None = None
        self.warmup: WarmUp | None = None
        self.states = {r.rid: RequestState(r) for r in self.requests}
        self.phase = "starting workers"
        self.started_s = now()
        self.model_id = ""
        self.layer_bytes_per_token = 0
        self.layers = 0
        #: The KV layout of one token of the model the workers serve (learnt at start).
        self._token_layout = KVLayout(num_layers=0, seq_len=1, kv_heads=0, head_dim=0)
        self.infos: dict[str, WorkerInfo] = {}
        self._links: dict[tuple[str, str, str], LinkChoice] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._finished: dict[int, tuple[str, RequestResult]] = {}
        self._copy_ids = itertools.count(_COPY_IDS_FROM)
        self._busy: dict[str, int | None] = {}
        self.attempts_total = 0
        #: With --adp: the pool during the timed phase, then its report (the "adp" key).
        self.pool: DemoPool | None = None
        self.adp_report: dict[str, object] | None = None
        #: With --compute paced: each worker's paced turns in the timed phase.
        self.paced_turns: dict[str, PaceStats] = {}
        #: The workers' logs and (with --device-kv-capacity) their disk tiers.
        self._run_dir = tempfile.TemporaryDirectory(prefix="topkv-demo-")

    # -- public ----------------------------------------------------------------------------

    def run(self) -> list[RequestResult]:
        asyncio.run(self._run())
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

    def paced(self, link: LinkChoice) -> PacedLink:
        mode = link.mode if link.mode in ("nvlink", "nvswitch", "pcie", "rdma") else "tcp"
        return PacedLink(
            mode=mode,  # type: ignore[arg-type]
            bandwidth_gbps=link.bandwidth_gbps,
            setup_s=link.setup_s,
            dilation=self._dilation_factor(),
        )

    def _dilation_factor(self) -> float:
        if self.dilation is None:
            raise DemoError("internal: a link paced before the warm-up set the dilation")
        return self.dilation.factor

    def _relay_pair_view(self, source: WorkerInfo, destination: WorkerInfo) -> PairView:
        return pair_view(
            self.topology,
            self._placement[source.worker_id].endpoint,
            self._placement[destination.worker_id].endpoint,
        )

    def _layout(self, prompt_len: int) -> KVLayout:
        return replace(self._token_layout, seq_len=prompt_len)

    # -- the run ---------------------------------------------------------------------------

    async def _run(self) -> None:
        opts = self.options
        engine = EngineSpec(
            "hf",
            model_path=Path(opts.model_path) if opts.model_path is not None else None,
            demo_seed=opts.seed if opts.model_path is None else None,
            torch_threads=DEMO_TORCH_THREADS,
            compute_pace=opts.compute.pace,
        )
        run_dir = Path(self._run_dir.name)
        capacity = opts.device_kv_capacity
        self.workers = DemoWorkers(
            self.placements,
            self.topology,
            engine,
            decode_capacity=opts.decode_capacity,
            prefill_capacity=PREFILL_CAPACITY,
            run_dir=run_dir,
            tiers=demo_tiers(capacity, run_dir) if capacity is not None else None,
        )
        self.executor = DemoExecutor(
            _Pacing(self),
            opts.request_timeout_s,
            self.workers.cluster.admin_token(),
            opts.pipelining,
        )
        try:
            self.infos = await self.workers.start()
            self._learn_model(self.workers.ready[self.placements[0].worker_id])
            await self._warm_up()
            counted = PacedTurns(self.executor, list(self.infos.values()), opts.compute)
            await counted.start()
            await self._timed_phase()
            self.paced_turns = await counted.since()
            await self._reference_phase()
        finally:
            for task in list(self._tasks):
                task.cancel()
            if self._tasks:
                await asyncio.wait(set(self._tasks), timeout=5.0)
            await self.executor.close()
            await self.workers.stop()
            self._run_dir.cleanup()
        self.attempts_total = self.executor.attempts

    def _learn_model(self, ready: dict[str, object]) -> None:
        engine = ready.get("engine")
        if not isinstance(engine, dict):
            raise DemoError("the workers did not describe their engine")
        self.model_id = str(engine["model_id"])
        self._token_layout = KVLayout(
            num_layers=int(engine["layers"]),
            seq_len=1,
            kv_heads=int(engine["kv_heads"]),
            head_dim=int(engine["head_dim"]),
            dtype=str(engine["dtype"]),
        )
        self.layers = self._token_layout.num_layers
        self.layer_bytes_per_token = self._token_layout.layer_bytes

    async def _warm_up(self) -> None:
        """Measure this host's KV production rate, then set the dilation from it."""
        self.phase = "warm-up (KV production rate)"
        self._report(force=True)
        lengths = sorted(r.prompt_len for r in self.requests)
        prefill = [self.infos[p.worker_id] for p in self.placements if p.role == "prefill"]
        self.warmup = await measure_kv_rate(
            self.executor,
            prefill,
            model_id=self.model_id,
            prompt_len=lengths[len(lengths) // 2],
            seed=self.options.seed,
        )
        self.dilation = self.reuse_dilation or resolve_dilation(
            self.options.dilation,
            self.stand_in,
            self.warmup.kv_bytes_per_prefill_s,
            demo_links(self.placements, self.link_for, self.layer_bytes_per_token, self.layers),
        )

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- timed phase -----------------------------------------------------------------------

    async def _timed_phase(self) -> None:
        """Replay the requests through the relay orchestrator."""
        self.phase = "replaying requests"
        self._wake = asyncio.Event()
        timeout = self.options.request_timeout_s
        config = OrchestratorConfig(
            attempt_timeout_s=timeout,
            executor_call_timeout_s=timeout,
            route_wait_s=timeout,
            submit_timeout_s=timeout,
        )
        async with Orchestrator(
            self.workers.registry, self.executor, config=config, pair_view=self._relay_pair_view
        ) as orch:
            self.orch = orch
            if self.options.adp:
                self.pool = DemoPool(orch, self.executor, self.options.speedup, orch.clock)
            consumer = asyncio.create_task(self._consume_completions(orch))
            try:
                await self._replay(orch)
            finally:
                if self.pool is not None:
                    self.adp_report = await self.pool.close()
                await cancel_and_wait(consumer)

    async def _replay(self, orch: Orchestrator) -> None:
        start = now() + 0.05
        waiting = sorted(self.states.values(), key=lambda s: s.request.arrival_s)
        queued: list[RequestState] = []
        busy = self._busy = {p.worker_id: None for p in self.placements if p.role == "prefill"}
        deadline_of: dict[int, float] = {}
        while any(s.stage not in ("transferred", "failed") for s in self.states.values()):
            self._wake.clear()
            self.workers.check_alive()
            t = now()
            while waiting and start + waiting[0].request.arrival_s <= t:
                state = waiting.pop(0)
                state.stage = "queued"
                state.arrival_s = start + state.request.arrival_s
                queued.append(state)
                if self.pool is not None:
                    self.pool.observe_arrival(state.request.prompt_len)
                deadline_of[state.rid] = state.arrival_s + self.options.request_timeout_s
            serving = sorted(busy)
            if self.pool is not None:  # prefill goes to the workers the pool names
                await self.pool.maybe_tick(len(queued))
                serving = self.pool.prefill_workers()
                for worker_id in serving:
                    busy.setdefault(worker_id, None)
            for worker_id in serving:
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
            max(0, self.options.decode_capacity - orch.slots_used(w.worker_id))
            for w in orch.view.workers("decode")
            if self.pool is None or w.worker_id not in self.pool.live.stage
        )
        return free > len(orch.query(TransferState.QUEUED))

    async def _dispatch(self, orch: Orchestrator, state: RequestState, prefill_worker: str) -> None:
        """Start prefill on ``prefill_worker`` and hand the request to the orchestrator at
        once: it routes, selects and starts streaming while prefill still computes."""
        state.prefill_worker = prefill_worker
        state.stage = "prefill"
        request = state.request
        source = self.infos[prefill_worker]
        self.executor.hold(state.rid)
        body = PrefillRequest(
            model_id=self.model_id,
            prompt_seed=request.prompt_seed,
            prompt_tokens=request.prompt_len,
            wait=False,
        )
        try:
            await self.executor.prefill(source, state.rid, body)
            await orch.submit(
                state.rid,
                self.model_id,
                self._layout(request.prompt_len),
                prefill_worker,
                block=False,
                defer_digest=True,
            )
        except TopKVError as exc:
            self._busy[prefill_worker] = None
            state.fail(f"relay refused the request: {exc}")
            await self.executor.release(source, state.rid, "relay")
            self._finish_transfers(state)
            return
        self._spawn(self._await_prefill(state))

    async def _await_prefill(self, state: RequestState) -> None:
        """The prefill worker is free once the forward pass ended (its KV is whole)."""
        try:
            summary = await self.executor.source_summary(
                self.infos[state.prefill_worker], state.rid
            )
            state.prefill = PrefillDone.of(state.prefill_worker, summary)
        except (TopKVError, ValueError) as exc:
            state.fail(f"{state.prefill_worker}: prefill: {exc}")
            self._finish_transfers(state)
            record = self.orch.transfers.get(state.rid)
            if record is not None and not record.terminal:
                await self.orch.abort(state.rid)
        finally:
            self._busy[state.prefill_worker] = None
            if state.stage == "prefill":
                state.stage = "transfer"
            self._wake.set()

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
        report = self.executor.delivered_report(completion.request_id)
        if completion.outcome != Outcome.DELIVERED or completion.destination is None:
            state.fail(f"relay: {completion.outcome.value}: {completion.reason}")
            self._finish_transfers(state)
            return
        destination = self.infos[completion.destination]
        if state.stage == "failed" or report is None:
            self._spawn(self._discard(destination, state.rid))
            state.fail(state.error or "delivered copy unknown to the executor")
            self._finish_transfers(state)
            return
        state.decode_worker = completion.destination
        if self.pool is not None and state.arrival_s:
            self.pool.observe_ttft(now() - state.arrival_s)
        nbytes = completion.size_bytes
        transport = completion.transport or report.sent.mode
        state.link = self.link_for(
            state.prefill_worker, state.decode_worker, transport, nbytes, self.layers
        )
        state.rdma_link = self.link_for(
            state.prefill_worker, state.decode_worker, "rdma", nbytes, self.layers
        )
        state.sends[STREAM] = SendDone.of(STREAM, report.sent)
        stream_copy = Received.of(STREAM, report.held)
        if state.stage in ("prefill", "transfer"):
            state.stage = "decode"
        self._spawn(self._decode(state, destination, stream_copy))
        self._spawn(self._baselines(state))

    async def _decode(self, state: RequestState, worker: WorkerInfo, copy: Received) -> None:
        """Generate from the verified copy with prefill's first token, then free it."""
        try:
            first = self.executor.first_token(state.rid)
            result = await self.executor.decode(worker, state.rid, first, self.options.new_tokens)
            state.decoded = Decoded.of(worker.worker_id, copy, result)
        except TopKVError as exc:
            state.fail(f"decode: {exc}")
        finally:
            await self._discard(worker, state.rid)
        self._advance(state)
        self._wake.set()

    async def _discard(self, worker: WorkerInfo, rid: int) -> None:
        await self.executor.discard_destination(worker, rid)
        self._release_slot(rid)

    async def _baselines(self, state: RequestState) -> None:
        """The serial copy over the same path, then (unless it was RDMA) the copy over
        emulated RDMA and its control (:func:`baseline_copies`); each drained by the decode
        worker."""
        assert state.link is not None and state.rdma_link is not None
        # without pipelining, uniform RDMA too sends the whole KV after prefill
        replay: Schedule = "replay" if self.options.pipelining else "serial"
        plans: dict[str, tuple[LinkChoice, Schedule]] = {
            SERIAL: (state.link, "serial"),
            REPLAY: (state.rdma_link, replay),
            CONTROL: (state.link, replay),
        }
        copies = [
            (tag, *plans[tag]) for tag in baseline_copies(state.link.mode, self.options.pipelining)
        ]
        source, destination = self.infos[state.prefill_worker], self.infos[state.decode_worker]
        try:
            for tag, link, schedule in copies:
                if state.stage == "failed":
                    break
                report = await self.executor.send_copy(
                    source,
                    destination,
                    state.rid,
                    next(self._copy_ids),
                    self._layout(state.request.prompt_len),
                    model_id=self.model_id,
                    medium=link.medium,
                    timeout_s=self.options.request_timeout_s,
                    link=self.paced(link),
                    schedule=schedule,
                )
                state.sends[tag] = SendDone.of(tag, report.sent)
                state.received[tag] = Received.of(tag, report.held)
        except TopKVError as exc:
            state.fail(f"{tag} copy: {exc}")
        self._advance(state)
        self._wake.set()

    def _release_slot(self, rid: int) -> None:
        with contextlib.suppress(TopKVError):
            self.orch.release_decode_slot(rid)

    def _advance(self, state: RequestState) -> None:
        """Decoded, with every baseline copy measured: the request's transfers are done."""
        if state.stage != "failed" and state.decoded is not None:
            state.stage = "baselines"
        self._finish_transfers(state)

    def _finish_transfers(self, state: RequestState) -> None:
        """Once the baselines are done with the request's KV (or the request failed), give
        their hold back (the relay releases its own); a decoded request is then done."""
        copies = (
            baseline_copies(state.link.mode, self.options.pipelining)
            if state.link is not None
            else (SERIAL,)
        )
        copied = all(c in state.received and c in state.sends for c in copies)
        failed = state.stage == "failed"
        if (failed or copied) and state.prefill_worker and not state.baselines_released:
            state.baselines_released = True
            source = self.infos[state.prefill_worker]
            self._spawn(self.executor.release(source, state.rid, "baselines"))
        if not failed and copied and state.decoded is not None:
            state.stage = "transferred"

    # -- reference phase -------------------------------------------------------------------

    async def _reference_phase(self) -> None:
        self.phase = "single-process reference runs"
        workers = [p.worker_id for p in self.placements]
        pending = sorted(s.rid for s in self.states.values() if s.decoded is not None)
        shares: dict[str, list[int]] = {w: [] for w in workers}
        for index, rid in enumerate(pending):
            state = self.states[rid]
            state.stage = "reference" if state.stage != "failed" else "failed"
            shares[workers[index % len(workers)]].append(rid)
        reporter = asyncio.create_task(self._report_every(0.2))
        try:
            await asyncio.wait_for(
                asyncio.gather(*(self._references(w, rids) for w, rids in shares.items())),
                self.options.request_timeout_s,
            )
        except TimeoutError:
            pass
        finally:
            await cancel_and_wait(reporter)
        for rid in pending:
            if self.states[rid].reference is None:
                self.states[rid].fail("no reference generation in time")
        self.phase = "done"
        self._report(force=True)

    async def _references(self, worker_id: str, rids: list[int]) -> None:
        worker = self.infos[worker_id]
        for rid in rids:
            state = self.states[rid]
            body = GenerateRequest(
                prompt_seed=state.request.prompt_seed,
                prompt_tokens=state.request.prompt_len,
                max_new_tokens=self.options.new_tokens,
            )
            try:
                result = await self.executor.generate(worker, body)
            except TopKVError as exc:
                state.fail(f"{worker_id}: reference: {exc}")
                continue
            state.reference = ReferenceDone.of(worker_id, rid, result)
            if state.stage != "failed":
                state.stage = "done"

    async def _report_every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.workers.check_alive()
            self._report()

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
        return request_result(
            state,
            self.layer_bytes_per_token,
            self.layers,
            self.dilation.factor if self.dilation is not None else math.nan,
            pipelined=self.options.pipelining,
        )
