"""One simulation: a workload through prefill pool -> KV transfer -> decode pool.

Lifecycle of a request (times in simulated seconds):

1. it arrives and, if it can ever be served (:func:`topkv.policy.admission.admit`: not
   longer than the model's context, KV not larger than the largest decode instance's KV
   memory), joins the prefill pool's FIFO queue; otherwise it is counted as rejected;
2. an idle prefill instance takes the head of the queue and more requests while the batch
   stays within ``max_prefill_tokens``; for each, the shared :class:`RoutingPolicy` picks a
   decode instance (with room for the request's whole KV cache, reserved now) and the
   shared transport selector (uniform RDMA, Algorithm 1 or the cost policy) picks the
   transport; if no decode instance has room the queue waits (back-pressure);
3. prefill takes the roofline time of the batch; with pipelining, each TP shard's
   transfer starts when the first layer is done and is capped at the rate prefill produces
   KV until prefill ends; without, it starts when prefill ends. Per-chunk setup latency is
   charged as ``chunks * setup * bandwidth`` extra bytes, which reproduces
   :func:`topkv.planner.pipeline.simulate_pipeline` exactly on an idle link;
4. when every shard has arrived the first token is out (TTFT) and the request joins the
   decode instance's continuous batch; decode advances all members together, one token per
   step, the step time given by the roofline for the batch's size and cached tokens;
5. it leaves after its last token; its KV memory is released.

The prefill instance is free as soon as its compute ends (transfers are asynchronous).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from topkv.kv.spec import ModelSpec
from topkv.policy.admission import AdmissionLimits, admit
from topkv.policy.adp.pool import ADPConfig
from topkv.policy.bandwidth import BandwidthEstimator
from topkv.policy.route import DecodeWorkerView, RouteDecision, RoutingPolicy
from topkv.policy.select import TransportSelector, policy_from_name
from topkv.policy.view import Endpoint, LinkLoad, PairView, PathCandidate, TransferRequest
from topkv.sim.adp import AdpDriver
from topkv.sim.cluster import ClusterSpec, Instance, LinkMap, SimCluster, SimGPU
from topkv.sim.compute import ComputeModel, default_tp, get_gpu
from topkv.sim.errors import SimError
from topkv.sim.events import EventLoop, make_loop
from topkv.sim.links import Flow, LinkNetwork, SimLink
from topkv.sim.result import PolicyResult as PolicyResult
from topkv.sim.state import DecodeState, ReqState
from topkv.traces import Request, Workload

POLICIES: tuple[str, ...] = ("uniform-rdma", "paper", "cost")

# The state classes under their historical names (subclasses of Simulation use them).
_Req = ReqState
_Decode = DecodeState


@dataclass(frozen=True)
class SimConfig:
    """Everything that defines a run except the workload and the policy."""

    model: ModelSpec
    cluster: ClusterSpec
    tp: int | None = None
    pd_ratio: tuple[int, int] = (1, 1)
    pipelining: bool = True
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.1
    max_prefill_tokens: int = 8192
    max_decode_batch: int = 256
    compute: ComputeModel | None = None
    util_bin_s: float = 1.0
    event_core: str = "heap"
    shortlist: int = 2
    #: When set, each decode instance holds at most this many requests at once (a slot
    #: count, as the live demo's decode workers have) instead of a KV-memory budget.
    decode_slots: int | None = None
    #: The Adaptive Decoder Pool's thresholds; None = static pools (no ADP).
    adp: ADPConfig | None = None
    #: Simulated seconds between ADP updates, and the time one conversion takes (the
    #: paper's 10 s target; the worker serves neither new prefill nor new decode then).
    adp_tick_s: float = 1.0
    adp_conversion_s: float = 10.0

    def compute_model(self, tp: int) -> ComputeModel:
        if self.compute is not None:
            return self.compute if self.compute.tp == tp else replace(self.compute, tp=tp)
        gpus = {g.gpu for g in self.cluster.node_groups}
        if len(gpus) != 1:
            raise SimError(f"mixed GPU types {sorted(gpus)} are not supported in one cluster")
        return ComputeModel(self.model, get_gpu(gpus.pop()), tp=tp)

    def resolved_tp(self) -> int:
        if self.tp is not None:
            return self.tp
        if self.compute is not None:
            return self.compute.tp
        gpu = get_gpu(self.cluster.node_groups[0].gpu)
        return default_tp(self.model, gpu)


class Simulation:
    """Runs one workload under one transport policy."""

    def __init__(self, config: SimConfig, workload: Workload, policy: str) -> None:
        self.config = config
        self.workload = workload
        self.policy_name = policy
        self.tp = config.resolved_tp()
        self.compute = config.compute_model(self.tp)
        self.cluster = SimCluster.build(config.cluster, self.tp, config.pd_ratio)
        self.loop: EventLoop = make_loop(config.event_core)
        self.network = LinkNetwork(self.loop, config.util_bin_s)
        self.links = LinkMap(self.cluster, self.network)
        # Simulated time reaches the policies through the estimator's clock (the loop).
        self.estimator = BandwidthEstimator(self.loop)
        self.selector: TransportSelector = policy_from_name(policy, self.estimator)
        self.router = RoutingPolicy()
        self.layers = config.model.num_layers
        self._gpu_by_ep: dict[Endpoint, SimGPU] = {g.endpoint: g for g in self.cluster.gpus}
        self.queue: deque[_Req] = deque()
        self.idle: list[Instance] = list(reversed(self.cluster.prefill))
        slots = config.decode_slots
        cap = float(slots) if slots is not None else self.compute.kv_capacity_bytes
        self.decodes = [_Decode(inst, cap) for inst in self.cluster.decode]
        self.limits = AdmissionLimits.of(
            config.model.max_context, (d.capacity for d in self.decodes)
        )
        self._local, self._remote = self._partition_decodes()
        self._kv_cache: dict[int, int] = {}
        self.done: list[_Req] = []
        self.rejected = 0
        self.rejected_by_reason: dict[str, int] = {}
        self._next_arrival = 0
        self._requests = workload.requests
        self.prefill_pool = self.cluster.prefill
        self.max_decode_batch = config.max_decode_batch
        self.adp: AdpDriver | None = None
        if config.adp is not None:
            self.adp = AdpDriver(self, config.adp, config.adp_tick_s, config.adp_conversion_s)

    def _arrivals_left(self) -> bool:
        return self._next_arrival < len(self._requests)

    # -- setup -------------------------------------------------------------------------

    def _partition_decodes(self) -> tuple[dict[str, list[_Decode]], dict[str, list[_Decode]]]:
        """Decode instances near (same node or NVLink domain) each prefill instance and the
        rest, keyed by instance name (unique across pools: iids restart per pool)."""
        local: dict[str, list[_Decode]] = {}
        remote: dict[str, list[_Decode]] = {}
        for p in self.cluster.prefill:
            g = p.gpus[0]
            near = [
                d
                for d in self.decodes
                if d.inst.gpus[0].node == g.node
                or (g.domain is not None and d.inst.gpus[0].domain == g.domain)
            ]
            local[p.name] = near
            remote[p.name] = [d for d in self.decodes if d not in near]
        return local, remote

    def _kv_need(self, req: Request) -> float:
        """What a request reserves on its decode instance: a slot, or its whole KV."""
        if self.config.decode_slots is not None:
            return 1.0
        return float(self._kv(req.input_tokens + req.output_tokens))

    def _kv(self, tokens: int) -> int:
        nbytes = self._kv_cache.get(tokens)
        if nbytes is None:
            nbytes = self._kv_cache[tokens] = self.compute.kv_bytes(tokens)
        return nbytes

    # -- run ---------------------------------------------------------------------------

    def run(self, progress: Callable[[int], None] | None = None) -> PolicyResult:
        started = time.perf_counter()
        if self._requests:
            self.loop.call_at(self._requests[0].arrival_s, self._arrive)
            if self.adp is not None:
                self.adp.start(self._requests[0].arrival_s)
        if progress is None:
            self.loop.run()
        else:
            horizon = self.workload.requests[-1].arrival_s if self._requests else 0.0
            slices = 50
            for k in range(1, slices + 1):
                self.loop.run(until=horizon * k / slices)
                progress(self._next_arrival)
            self.loop.run()
            progress(len(self._requests))
        wall = time.perf_counter() - started
        return self._result(wall)

    def _arrive(self) -> None:
        reqs = self._requests
        i = self._next_arrival
        req = reqs[i]
        self._next_arrival = i + 1
        if i + 1 < len(reqs):
            self.loop.call_at(reqs[i + 1].arrival_s, self._arrive)
        verdict = admit(req.input_tokens + req.output_tokens, self._kv_need(req), self.limits)
        if not verdict.admitted:
            self.rejected += 1
            self.rejected_by_reason[verdict.reason] = (
                self.rejected_by_reason.get(verdict.reason, 0) + 1
            )
            return
        if self.adp is not None:
            self.adp.arrival(req.input_tokens)
        self.queue.append(_Req(req))
        self._dispatch()

    # -- prefill -----------------------------------------------------------------------

    def _dispatch(self) -> None:
        limit = self.config.max_prefill_tokens
        while self.idle and self.queue:
            inst = self.idle[-1]
            batch: list[tuple[_Req, _Decode, PathCandidate, str]] = []
            tokens = 0
            while self.queue:
                r = self.queue[0]
                if batch and tokens + r.req.input_tokens > limit:
                    break
                need = self._kv_need(r.req)
                routed = self._route(inst, r, need)
                if routed is None:
                    break  # back-pressure: no decode instance has room
                self.queue.popleft()
                batch.append((r, *routed))
                tokens += r.req.input_tokens
            if not batch:
                return
            self.idle.pop()
            self._start_prefill(inst, batch)

    def _route(
        self, inst: Instance, r: _Req, need: float
    ) -> tuple[_Decode, PathCandidate, str] | None:
        src = inst.gpus[0]
        candidates = self._shortlist(self._local[inst.name], need)
        candidates.extend(self._shortlist(self._remote[inst.name], need))
        if not candidates:
            return None
        by_id = {d.inst.name: d for d in candidates}
        views = [
            DecodeWorkerView(
                worker_id=d.inst.name,
                endpoint=d.inst.gpus[0].endpoint,
                free_slots=int((d.capacity - d.reserved) // need),
                load=d.reserved / d.capacity,
            )
            for d in candidates
        ]
        shard = self._kv(r.req.input_tokens) // self.tp
        r.kv_bytes = shard * self.tp
        chunks = self.layers if self.config.pipelining else 1
        request = TransferRequest(nbytes=shard, chunks=chunks)
        load = self._load_snapshot(src, candidates)
        decision = self.router.choose_decode(
            src.endpoint, views, self._pair_view, request, self.selector, load
        )
        if decision is None:
            return None
        return self._reserve(src, by_id[decision.worker_id], decision, r, need)

    def _reserve(
        self, src: SimGPU, target: _Decode, decision: RouteDecision, r: _Req, need: float
    ) -> tuple[_Decode, PathCandidate, str]:
        """Reserve ``need`` on ``target`` for ``r``; the simulated path of the decision."""
        chosen = decision.selection.chosen
        view = self.cluster.pair_view(src, target.inst.gpus[0])
        path = next(
            c
            for c in view.candidates
            if c.transport == chosen.transport and c.links == chosen.links
        )
        target.reserved += need
        target.pending += 1
        r.mem = need
        r.decode = target
        return target, path, decision.selection.choice

    def _shortlist(self, pool: list[_Decode], need: float) -> list[_Decode]:
        """The least-reserved instances of ``pool`` with room for ``need`` bytes."""
        fits = [d for d in pool if d.capacity - d.reserved >= need and not d.closed]
        k = self.config.shortlist
        if len(fits) > k:
            fits = heapq.nsmallest(k, fits, key=lambda d: d.reserved)
        return fits

    def _pair_view(self, src: Endpoint, dst: Endpoint) -> PairView:
        return self.cluster.pair_view(self._gpu_by_ep[src], self._gpu_by_ep[dst])

    def _load_snapshot(self, src: SimGPU, candidates: list[_Decode]) -> LinkLoad:
        in_flight: dict[str, int] = {}
        flows: dict[str, int] = {}
        if self.network.active_flows == 0:
            return LinkLoad()
        now = self.loop.now()
        for d in candidates:
            view = self.cluster.pair_view(src, d.inst.gpus[0])
            for cand in view.candidates:
                for link_id, link in zip(cand.links, self.links.path(cand.links), strict=False):
                    if link.flows and link_id not in flows:
                        left = sum(
                            max(0.0, f.remaining - f.rate * (now - f.last_t)) for f in link.flows
                        )
                        in_flight[link_id] = int(left)
                        flows[link_id] = len(link.flows)
        return LinkLoad(in_flight, flows)

    def _start_prefill(
        self, inst: Instance, batch: list[tuple[_Req, _Decode, PathCandidate, str]]
    ) -> None:
        now = self.loop.now()
        prompts = [r.req.input_tokens for r, *_ in batch]
        duration = self.compute.prefill_s(prompts)
        if self.adp is not None:
            duration = self.adp.prefill_duration(inst, prompts, duration)
            self.adp.prefill_started(inst, [r for r, *_ in batch])
        end = now + duration
        for r, _d, _path, _t in batch:
            r.prefill_start = now
            r.prefill_end = end
        if self.config.pipelining:
            first_layer = duration / self.layers
            self.loop.call_at(now + first_layer, self._start_transfers, inst, batch, duration)
        else:
            self.loop.call_at(end, self._start_transfers, inst, batch, 0.0)
        self.loop.call_at(end, self._prefill_done, inst)

    def _prefill_done(self, inst: Instance) -> None:
        if self.adp is None or self.adp.prefill_done(inst):
            self.idle.append(inst)
        self._dispatch()

    # -- transfer ----------------------------------------------------------------------

    def _start_transfers(
        self,
        inst: Instance,
        batch: list[tuple[_Req, _Decode, PathCandidate, str]],
        prefill_s: float,
    ) -> None:
        now = self.loop.now()
        chunks = self.layers if prefill_s > 0 else 1
        capped: list[Flow] = []
        for r, d, path, transport in batch:
            r.transport = transport
            r.path = path
            r.xfer_start = now
            shard = r.kv_bytes // self.tp
            bundle: list[SimLink] = []
            for k in range(self.tp):
                if k == 0:
                    links = path.links
                else:
                    view = self.cluster.pair_view(inst.gpus[k], d.inst.gpus[k])
                    links = view.paths_for(transport)[0].links
                bundle.extend(self.links.path(links))
            setup_bytes = chunks * path.setup_latency_s * path.bandwidth_gbps * 1e9
            spec = (shard + setup_bytes, tuple(bundle), self._transfer_done(r))
            if prefill_s > 0:
                capped.extend(self.network.start_flows([spec], cap=spec[0] / prefill_s))
            else:
                self.network.start_flows([spec])
        if capped:
            remaining = prefill_s - prefill_s / self.layers
            self.loop.call_at(now + remaining, self.network.set_cap, capped, math.inf)

    def _transfer_done(self, r: _Req) -> Callable[[], None]:
        return lambda: self._kv_arrived(r)

    def _kv_arrived(self, r: _Req) -> None:
        now = self.loop.now()
        r.xfer_end = now
        r.ttft = now - r.req.arrival_s
        r.exposed = max(0.0, now - r.prefill_end)
        if self.adp is not None:
            self.adp.kv_arrived(r, r.ttft)
        # what a live sender measures feeds the cost policy's bandwidth estimate
        measured = not self.config.pipelining and now > r.xfer_start and r.kv_bytes > 0
        if measured and r.path is not None:
            self.estimator.record(r.path, r.kv_bytes // self.tp, now - r.xfer_start)
        d = r.decode
        assert d is not None
        d.pending -= 1
        if r.req.output_tokens <= 1:
            self._finish(r, d)
            self._dispatch()
            return
        if d.n >= self.config.max_decode_batch:
            d.waiting.append(r)
        else:
            self._join(d, r)

    # -- decode ------------------------------------------------------------------------

    def _advance(self, d: _Decode, now: float) -> None:
        if d.n and d.step_s > 0:
            d.steps += (now - d.last_t) / d.step_s
        d.last_t = now

    def _join(self, d: _Decode, r: _Req) -> None:
        now = self.loop.now()
        self._advance(d, now)
        d.seq += 1
        heapq.heappush(d.members, (d.steps + r.req.output_tokens - 1, d.seq, r))
        d.n += 1
        d.sum_input += r.req.input_tokens
        d.sum_join += d.steps
        self._reschedule(d, now)

    def _reschedule(self, d: _Decode, now: float) -> None:
        d.version += 1
        if not d.n:
            d.step_s = 0.0
            return
        cached = d.sum_input + d.n * d.steps - d.sum_join
        d.step_s = self.compute.decode_step_s(d.n, cached) + d.extra_step_s
        next_finish = d.members[0][0]
        when = now + max(0.0, next_finish - d.steps) * d.step_s
        self.loop.call_at(when, self._decode_tick, d, d.version)

    def _decode_tick(self, d: _Decode, version: int) -> None:
        if version != d.version:
            return
        now = self.loop.now()
        self._advance(d, now)
        members = d.members
        limit = d.steps + 1e-6
        freed = False
        while members and members[0][0] <= limit:
            finish_steps, _seq, r = heapq.heappop(members)
            d.n -= 1
            d.sum_input -= r.req.input_tokens
            d.sum_join -= finish_steps - (r.req.output_tokens - 1)
            self._finish(r, d)
            freed = True
        while d.waiting and d.n < self.config.max_decode_batch:
            r = d.waiting.popleft()
            d.seq += 1
            heapq.heappush(members, (d.steps + r.req.output_tokens - 1, d.seq, r))
            d.n += 1
            d.sum_input += r.req.input_tokens
            d.sum_join += d.steps
        self._reschedule(d, now)
        if freed:
            self._dispatch()

    def _finish(self, r: _Req, d: _Decode) -> None:
        now = self.loop.now()
        r.finish = now
        r.e2e = now - r.req.arrival_s
        d.reserved -= r.mem
        d.released += r.mem
        if d.reserved < 1e-6:
            d.reserved = 0.0
        self.done.append(r)

    # -- results -----------------------------------------------------------------------

    def _result(self, wall: float) -> PolicyResult:
        done = self.done
        if len(done) + self.rejected != len(self._requests):
            raise SimError(
                f"simulation ended with {len(self._requests) - len(done) - self.rejected} "
                "requests unfinished (no decode instance could be routed to)"
            )
        ttft = np.array([r.ttft for r in done])
        e2e = np.array([r.e2e for r in done])
        tpot = np.array(
            [
                (r.finish - r.xfer_end) / (r.req.output_tokens - 1)
                for r in done
                if r.req.output_tokens > 1
            ]
        )
        exposed = np.array([r.exposed for r in done])
        transfer = np.array([r.xfer_end - r.xfer_start for r in done])
        cfg = self.config
        good = 0
        for r in done:
            out = r.req.output_tokens
            tp_ok = out <= 1 or (r.finish - r.xfer_end) / (out - 1) <= cfg.slo_tpot_s
            if r.ttft <= cfg.slo_ttft_s and tp_ok:
                good += 1
        bytes_by: dict[str, int] = {}
        count_by: dict[str, int] = {}
        for r in done:
            bytes_by[r.transport] = bytes_by.get(r.transport, 0) + r.kv_bytes
            count_by[r.transport] = count_by.get(r.transport, 0) + 1
        sim_seconds = max((r.finish for r in done), default=0.0)
        return PolicyResult(
            policy=self.policy_name,
            pipelining=cfg.pipelining,
            completed=len(done),
            rejected=self.rejected,
            sim_seconds=sim_seconds,
            wall_seconds=wall,
            events=self.loop.events_processed,
            ttft_s=ttft,
            tpot_s=tpot,
            e2e_s=e2e,
            exposed_transfer_s=exposed,
            transfer_s=transfer,
            prefill_wait_s=np.array([r.prefill_start - r.req.arrival_s for r in done]),
            prefill_s=np.array([r.prefill_end - r.prefill_start for r in done]),
            good=good,
            bytes_by_transport=bytes_by,
            count_by_transport=count_by,
            utilization=self.network.utilization(sim_seconds),
            rejected_by_reason=dict(self.rejected_by_reason),
            **self._pool_stats(),
        )

    def _pool_stats(self) -> dict[str, Any]:
        adp = self.adp
        if adp is None:
            n = len(self.cluster.prefill)
            return {"prefill_workers_min": n, "prefill_workers_max": n}
        return {
            "adp": True,
            "conversions": adp.conversions,
            "prefill_workers_min": adp.min_prefill,
            "prefill_workers_max": adp.max_prefill,
            "pool_series": list(adp.series),
            "rush_periods": adp.rush_periods,
        }


def run_policy(
    config: SimConfig,
    workload: Workload,
    policy: str,
    progress: Callable[[int], None] | None = None,
) -> PolicyResult:
    """Simulate ``workload`` under one policy (``uniform-rdma``, ``paper``, ``cost``, ...)."""
    return Simulation(config, workload, policy).run(progress)
