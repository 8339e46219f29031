"""MoE serving in simulated time: expert-parallel decode, dispatch traffic, MoE routing.

:class:`MoESimulation` is :class:`~topkv.sim.runner.Simulation`'s run with decode routed by
:class:`topkv.policy.moe.router.MoERouter` (or the ``least-loaded`` baseline), decode steps
that wait for the busiest expert host of their group, and dispatch flows sharing the
simulated links with the KV transfers; stragglers are set by :class:`MoESimOptions`.
:func:`run_moe_routers` compares the routers. The model: docs/moe.md ("Simulator").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from topkv.policy.moe.experts import ExpertReplica, ExpertSnapshot
from topkv.policy.moe.router import (
    STRATEGIES,
    MoERequest,
    MoERouter,
    MoETarget,
    dispatch_bytes_per_activation,
)
from topkv.policy.pairs import gpu_port, nic_port
from topkv.policy.route import DecodeWorkerView
from topkv.policy.view import PathCandidate, TransferRequest
from topkv.sim.cluster import Instance, SimCluster
from topkv.sim.compute import get_gpu
from topkv.sim.errors import SimError
from topkv.sim.links import Flow, SimLink
from topkv.sim.moe_setup import (
    EPGroup,
    ExpertSizes,
    ep_compute,
    load_profiles,
    min_group_size,
    place,
)
from topkv.sim.result import PolicyResult
from topkv.sim.runner import SimConfig, Simulation
from topkv.sim.state import DecodeState, ReqState
from topkv.traces import Workload

BASELINE = "least-loaded"
MOE_ROUTERS: tuple[str, ...] = (*STRATEGIES, BASELINE)
#: A long-lived flow's size: it never completes within a run.
_FOREVER = 1e18
#: The rate cap of an idle dispatch flow (bytes/s): effectively off.
_IDLE = 1.0


@dataclass(frozen=True)
class MoESimOptions:
    """The MoE side of a run: the router, stragglers, the registry's heartbeat."""

    router: str = "cost"
    stragglers: int = 0
    straggler_slowdown: float = 5.0
    heartbeat_s: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.router not in MOE_ROUTERS:
            raise SimError(f"unknown MoE router {self.router!r}; use {', '.join(MOE_ROUTERS)}")
        if self.stragglers < 0 or not self.straggler_slowdown >= 1 or not self.heartbeat_s > 0:
            raise SimError("stragglers >= 0, straggler slowdown >= 1 and heartbeat > 0 needed")


def moe_config(base: SimConfig) -> tuple[SimConfig, int]:
    """``base`` with expert parallelism: TP = one node unless given, the compute model of an
    instance holding its share of the experts; and the smallest EP group size."""
    group0 = base.cluster.node_groups[0]
    tp = base.tp or group0.gpus_per_node
    gpu = get_gpu(group0.gpu)
    built = SimCluster.build(base.cluster, tp, base.pd_ratio)
    size = min_group_size(base.model, gpu, tp, len(built.decode))
    return replace(base, tp=tp, compute=ep_compute(base.model, gpu, tp, size)), size


class _Host:
    """One decode instance's MoE state: its group, its flows and what a step sends."""

    __slots__ = ("group", "index", "local_bytes", "local_flow", "remote_bytes", "remote_flow")

    def __init__(self, group: EPGroup, index: int) -> None:
        self.group = group
        self.index = index
        self.local_flow: Flow | None = None
        self.remote_flow: Flow | None = None
        self.local_bytes = 0.0
        self.remote_bytes = 0.0


class MoESimulation(Simulation):
    """One workload under one MoE router (see the module docstring)."""

    def __init__(
        self,
        config: SimConfig,
        workload: Workload,
        policy: str,
        options: MoESimOptions,
        group_size: int,
    ) -> None:
        super().__init__(config, workload, policy)
        self.options = options
        self.sizes = ExpertSizes.of(config.model)
        self.acts = self.sizes.per_token * self.sizes.moe_layers
        self.dispatch_bytes = dispatch_bytes_per_activation(config.model.hidden_size)
        self.profiles = load_profiles(self.sizes.experts)
        rng = np.random.default_rng(options.seed)
        self._profile = {
            req.rid: int(p)
            for req, p in zip(
                workload.requests,
                rng.integers(0, len(self.profiles), len(workload.requests)),
                strict=True,
            )
        }
        self.groups = place(self.cluster.decode, group_size, self.profiles.mean(axis=0))
        self._hosts: dict[str, _Host] = {}
        for g in self.groups:
            for i, inst in enumerate(g.hosts):
                self._hosts[inst.name] = _Host(g, i)
        self.straggler_names = _pick_stragglers(self.groups, options.stragglers, rng)
        self._by_name = {d.inst.name: d for d in self.decodes}
        self._straggling_groups = frozenset(
            g.gid for g in self.groups if any(h.name in self.straggler_names for h in g.hosts)
        )
        self.moe_router = (
            MoERouter(self.loop, options.router) if options.router in STRATEGIES else None
        )
        self._snapshot: ExpertSnapshot | None = None
        self._snapshot_at = -math.inf
        self.dispatch_by_class: dict[str, float] = {}
        self.routed_to_straggler_group = 0
        self.routed = 0
        self._slow = {
            g.gid: np.array(
                [
                    options.straggler_slowdown if h.name in self.straggler_names else 1.0
                    for h in g.hosts
                ]
            )
            for g in self.groups
        }

    # -- routing -----------------------------------------------------------------------

    def _route(
        self, inst: Instance, r: ReqState, need: float
    ) -> tuple[DecodeState, PathCandidate, str] | None:
        candidates: list[DecodeState] = []
        for g in self.groups:
            candidates.extend(self._shortlist([self._by_name[h.name] for h in g.hosts], need))
        if not candidates:
            return None
        if self.moe_router is None:
            target = min(candidates, key=lambda d: (d.reserved / d.capacity, d.inst.name))
        else:
            chosen = self._moe_choice(inst, r, candidates, need)
            if chosen is None:
                return None
            target = chosen
        return self._commit(inst, r, target, need)

    def _moe_choice(
        self, inst: Instance, r: ReqState, candidates: list[DecodeState], need: float
    ) -> DecodeState | None:
        assert self.moe_router is not None
        src = inst.gpus[0]
        targets = [
            MoETarget(
                worker_id=d.inst.name,
                endpoint=d.inst.gpus[0].endpoint,
                domain=d.inst.gpus[0].domain,
                free_slots=int((d.capacity - d.reserved) // need),
                load=d.reserved / d.capacity,
                queue_s=self._queue_s(d, r),
            )
            for d in candidates
        ]
        profile = self._profile[r.req.rid]
        request = MoERequest(
            self._kv_request(r),
            decode_tokens=max(0, r.req.output_tokens - 1),
            activations_per_token=self.acts,
            dispatch_bytes=self.dispatch_bytes,
            shares={(0, e): float(s) for e, s in enumerate(self.profiles[profile]) if s > 0},
            shares_id=profile,
        )
        load = self._load_snapshot(src, candidates)
        decision = self.moe_router.decide(
            self._experts(),
            src.endpoint,
            targets,
            self._pair_view,
            request,
            self.selector,
            load,
        )
        return None if decision is None else self._by_name[decision.worker_id]

    def _kv_request(self, r: ReqState) -> TransferRequest:
        shard = self._kv(r.req.input_tokens) // self.tp
        return TransferRequest(nbytes=shard, chunks=self.layers if self.config.pipelining else 1)

    def _queue_s(self, d: DecodeState, r: ReqState) -> float:
        """What sharing ``d``'s batch costs this request: its tokens at the step time of
        the batch it joins (members and requests already routed there) over a step alone,
        plus the waiting line's steps."""
        tokens = max(0, r.req.output_tokens - 1)
        n = d.n + d.pending
        cached = d.sum_input + d.n * d.steps - d.sum_join
        shared = self.compute.decode_step_s(n + 1, cached + r.req.input_tokens)
        alone = self.compute.decode_step_s(1, float(r.req.input_tokens))
        return tokens * max(0.0, shared - alone) + len(d.waiting) * d.step_s

    def _commit(
        self, inst: Instance, r: ReqState, target: DecodeState, need: float
    ) -> tuple[DecodeState, PathCandidate, str] | None:
        decision = self.router.choose_decode(
            inst.gpus[0].endpoint,
            [
                DecodeWorkerView(
                    target.inst.name,
                    target.inst.gpus[0].endpoint,
                    free_slots=1,
                    load=target.reserved / target.capacity,
                )
            ],
            self._pair_view,
            self._kv_request(r),
            self.selector,
            self._load_snapshot(inst.gpus[0], [target]),
        )
        if decision is None:
            return None
        r.kv_bytes = (self._kv(r.req.input_tokens) // self.tp) * self.tp
        self.routed += 1
        if self._hosts[target.inst.name].group.gid in self._straggling_groups:
            self.routed_to_straggler_group += 1
        return self._reserve(inst.gpus[0], target, decision, r, need)

    def _experts(self) -> ExpertSnapshot:
        """The registry's view: rebuilt once per heartbeat from the hosts' state."""
        assert self.moe_router is not None
        now = self.loop.now()
        if self._snapshot is not None and now - self._snapshot_at < self.options.heartbeat_s:
            return self._snapshot
        mean = self.profiles.mean(axis=0)
        replicas = []
        for g in self.groups:
            slow = self._slow[g.gid]
            for e, h in enumerate(g.host_of):
                host = g.hosts[int(h)]
                d = self._by_name[host.name]
                replicas.append(
                    ExpertReplica(
                        layer=0,
                        expert=e,
                        worker_id=host.name,
                        domain=host.gpus[0].domain,
                        endpoint=host.gpus[0].endpoint,
                        rate=float(mean[e]) * (d.n + 1),
                        compute_s=self._expert_latency() * float(slow[int(h)]),
                        network_s=2 * self.cluster.spec.setup_latency_s.get("rdma", 5e-6),
                        queue_depth=len(d.waiting),
                        updated_at=now,
                    )
                )
        self._snapshot = self.moe_router.snapshot(replicas)
        self._snapshot_at = now
        return self._snapshot

    def _expert_latency(self) -> float:
        """What a host reports as its experts' compute latency: the routed-expert part of a
        decode step at batch 1, per activation of a token (its intrinsic speed; its load
        shows in the batch it serves, which the router weighs as queueing)."""
        step = self.compute.decode_step_s(1, 1024.0)
        return step * self.sizes.expert_step_share / max(1, self.acts)

    # -- decode steps ------------------------------------------------------------------

    def _advance(self, d: DecodeState, now: float) -> None:
        if d.n and d.step_s > 0:
            steps = (now - d.last_t) / d.step_s
            host = self._hosts.get(d.inst.name)
            if host is not None and steps > 0:
                self._count(d, "local", host.local_bytes * steps)
                self._count(d, "rdma", host.remote_bytes * steps)
        super()._advance(d, now)

    def _count(self, d: DecodeState, kind: str, nbytes: float) -> None:
        if nbytes <= 0:
            return
        if kind == "local":
            kind = "nvswitch" if d.inst.gpus[0].group.nvlink == "rack" else "nvlink"
        self.dispatch_by_class[kind] = self.dispatch_by_class.get(kind, 0.0) + nbytes

    def _reschedule(self, d: DecodeState, now: float) -> None:
        host = self._hosts.get(d.inst.name)
        if host is None or not d.n:
            if host is not None:
                host.local_bytes = host.remote_bytes = 0.0
                self._stop_flows(host)
            super()._reschedule(d, now)
            return
        d.version += 1
        cached = d.sum_input + d.n * d.steps - d.sum_join
        base = self.compute.decode_step_s(d.n, cached)
        group = host.group
        counts = np.bincount(
            [self._profile[m[2].req.rid] for m in d.members], minlength=len(self.profiles)
        )
        mean = counts @ self.profiles / d.n
        shares = np.bincount(group.host_of, weights=mean, minlength=len(group.hosts))
        slow = self._slow[group.gid]
        f = self.sizes.expert_step_share
        step = base * (1 - f) + base * f * float(np.max(shares * len(shares) * slow))
        per_token = self.acts * self.dispatch_bytes * d.n
        domain = d.inst.gpus[0].domain
        same = np.array([h.gpus[0].domain == domain and domain is not None for h in group.hosts])
        same[host.index] = False
        other = np.array([h.gpus[0].domain != domain or domain is None for h in group.hosts])
        host.local_bytes = per_token * float(shares[same].sum())
        host.remote_bytes = per_token * float(shares[other].sum())
        self._set_flows(d, host, host.local_bytes / base, host.remote_bytes / base)
        for flow, nbytes in (
            (host.local_flow, host.local_bytes),
            (host.remote_flow, host.remote_bytes),
        ):
            if flow is not None and nbytes > 0 and flow.rate > 0:
                step = max(step, nbytes / self.tp / flow.rate)
        if host.remote_bytes > 0:
            step += 2 * self.sizes.moe_layers * self.cluster.spec.setup_latency_s.get("rdma", 5e-6)
        d.step_s = step + d.extra_step_s
        next_finish = d.members[0][0]
        self.loop.call_at(
            now + max(0.0, next_finish - d.steps) * d.step_s, self._decode_tick, d, d.version
        )

    def _set_flows(
        self, d: DecodeState, host: _Host, local_rate: float, remote_rate: float
    ) -> None:
        """Start (once) or re-cap the instance's two dispatch flows (rates per TP shard)."""
        if host.local_flow is None and host.remote_flow is None:
            host.local_flow, host.remote_flow = self._start_dispatch_flows(d, host)
        for flow, rate in ((host.local_flow, local_rate), (host.remote_flow, remote_rate)):
            if flow is not None:
                cap = max(_IDLE, rate / self.tp)
                if not math.isclose(flow.cap, cap, rel_tol=1e-3):
                    self.network.set_cap([flow], cap)

    def _stop_flows(self, host: _Host) -> None:
        """An idle instance dispatches nothing: its flows leave the links."""
        flows = [f for f in (host.local_flow, host.remote_flow) if f is not None]
        self.network.stop_flows(flows)
        host.local_flow = host.remote_flow = None

    def _start_dispatch_flows(self, d: DecodeState, host: _Host) -> tuple[Flow | None, Flow | None]:
        gpus = d.inst.gpus
        local: list[SimLink] = []
        if gpus[0].domain is not None:
            local = [self.links.tx[gpu_port(g.endpoint, "nvlink")] for g in gpus]
        remote: list[SimLink] = []
        peer = next(
            (h for h in host.group.hosts if h.gpus[0].domain != gpus[0].domain and h.gpus[0].nic),
            None,
        )
        if peer is not None and all(g.nic for g in gpus):
            remote = [self.links.tx[nic_port(g.node, str(g.nic))] for g in gpus]
            remote += [self.links.rx[nic_port(peer.gpus[0].node, str(peer.gpus[0].nic))]]
        flows: list[Flow | None] = []
        for links in (local, remote):
            if not links:
                flows.append(None)
                continue
            flows.extend(self.network.start_flows([(_FOREVER, tuple(links), _never)], cap=_IDLE))
        return flows[0], flows[1]

    def moe_summary(self) -> dict[str, object]:
        """What ``--moe-router`` adds per router, from the finished run."""
        result = self._result(0.0)
        kv: dict[str, int] = dict(sorted(result.bytes_by_transport.items()))
        return {
            "ttft_p50_ms": result.pct_ms(result.ttft_s, 50),
            "ttft_p99_ms": result.pct_ms(result.ttft_s, 99),
            "tpot_p50_ms": result.pct_ms(result.tpot_s, 50),
            "tpot_p99_ms": result.pct_ms(result.tpot_s, 99),
            "goodput_rps": result.goodput_rps,
            "dispatch_bytes": {k: int(v) for k, v in sorted(self.dispatch_by_class.items())},
            "kv_bytes": kv,
            "completed": result.completed,
            "rejected": result.rejected,
            "routed_to_straggler_group": self.routed_to_straggler_group,
            "stragglers": sorted(self.straggler_names),
        }


def _never() -> None:  # pragma: no cover - a dispatch flow never completes
    raise SimError("a dispatch flow completed")


def _pick_stragglers(groups: list[EPGroup], count: int, rng: np.random.Generator) -> frozenset[str]:
    """``count`` hosts: one per group in turn (group 0 first), a seeded host in each."""
    free = [[h.name for h in g.hosts] for g in groups]
    picked: list[str] = []
    while len(picked) < count and any(free):
        for names in free:
            if names and len(picked) < count:
                picked.append(names.pop(int(rng.integers(0, len(names)))))
    return frozenset(picked)


def run_moe_policy(
    config: SimConfig,
    workload: Workload,
    policy: str,
    options: MoESimOptions,
    progress: Callable[[int], None] | None = None,
) -> PolicyResult:
    """Simulate ``workload`` with expert parallelism under one transport policy and one
    MoE router (:func:`moe_config` applied to ``config``)."""
    return _simulation(config, workload, policy, options).run(progress)


def run_moe_routers(
    config: SimConfig,
    workload: Workload,
    policy: str,
    routers: Sequence[str],
    options: MoESimOptions,
    progress: Callable[[str], Callable[[int], None] | None] = lambda _name: None,
) -> dict[str, dict[str, object]]:
    """Each router's :meth:`MoESimulation.moe_summary`, by name (``progress(name)`` gives
    the progress callback of that router's run)."""
    out: dict[str, dict[str, object]] = {}
    for name in routers:
        sim = _simulation(config, workload, policy, replace(options, router=name))
        sim.run(progress(name))
        out[name] = sim.moe_summary()
    return out


def _simulation(
    config: SimConfig, workload: Workload, policy: str, options: MoESimOptions
) -> MoESimulation:
    ep_config, size = moe_config(config)
    return MoESimulation(ep_config, workload, policy, options, size)
