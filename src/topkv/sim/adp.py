"""The Adaptive Decoder Pool in simulated time: the simulator's side of
:mod:`topkv.policy.adp.pool`.

:class:`AdpDriver` feeds the policy object the live orchestrator uses, on the event loop's
clock, with the simulated pools' state every ``adp_tick_s`` and applies its plans to the
simulation (:class:`AdaptiveHost`): conversions that take ``adp_conversion_s``, chunked
prefill on a converted instance, and the counts the report shows. How: docs/adp.md
("In the simulator").
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

from topkv.policy.adp.pool import AdaptiveDecoderPool, ADPConfig, ConversionPlan, WorkerView
from topkv.sim.cluster import Instance
from topkv.sim.compute import ComputeModel
from topkv.sim.events import EventLoop
from topkv.sim.state import DecodeState, ReqState


class AdaptiveHost(Protocol):
    """What the driver needs of the :class:`~topkv.sim.runner.Simulation` it runs in."""

    loop: EventLoop
    queue: deque[ReqState]
    idle: list[Instance]
    decodes: list[DecodeState]
    compute: ComputeModel
    prefill_pool: list[Instance]
    max_decode_batch: int
    _local: dict[str, list[DecodeState]]
    _remote: dict[str, list[DecodeState]]

    def _dispatch(self) -> None: ...

    def _advance(self, d: DecodeState, now: float) -> None: ...

    def _reschedule(self, d: DecodeState, now: float) -> None: ...

    def _arrivals_left(self) -> bool: ...


class AdpDriver:
    """Applies the ADP's plans to one simulation (module docstring)."""

    def __init__(
        self,
        host: AdaptiveHost,
        config: ADPConfig,
        tick_s: float = 1.0,
        conversion_s: float = 10.0,
    ) -> None:
        self.host = host
        self.config = config
        self.tick_s = tick_s
        self.conversion_s = conversion_s
        self.pool = AdaptiveDecoderPool(host.loop, config, conversion_s=conversion_s)
        self.by_name = {d.inst.name: d for d in host.decodes}
        self._by_iid = {d.inst.iid: d for d in host.decodes}
        #: converted (or converting) decode instances, by iid
        self.converted: set[int] = set()
        self.ready: set[int] = set()
        self.draining: set[int] = set()
        self.fenced: set[int] = set()
        self.prefilling: set[int] = set()
        self._returning: set[int] = set()
        #: KV a converted instance prefilled that has not arrived, by source iid
        self.out_pending: dict[int, int] = {}
        self._src_of: dict[int, int] = {}
        native = len(host.prefill_pool)
        self.prefill_workers = native
        self.min_prefill = native
        self.max_prefill = native
        self.series: list[tuple[float, int, int]] = []
        for d in host.decodes:  # converted instances route like prefill ones
            g = d.inst.gpus[0]
            near = [
                o
                for o in host.decodes
                if o is not d
                and (
                    o.inst.gpus[0].node == g.node
                    or (g.domain is not None and o.inst.gpus[0].domain == g.domain)
                )
            ]
            host._local[d.inst.name] = near
            host._remote[d.inst.name] = [o for o in host.decodes if o is not d and o not in near]
        self._ticking = False

    # -- observations ------------------------------------------------------------------

    def start(self, at: float) -> None:
        if not self._ticking:
            self._ticking = True
            self.host.loop.call_at(at, self._tick)

    def arrival(self, prompt_tokens: int) -> None:
        self.pool.observe_arrival(prompt_tokens)

    def kv_arrived(self, r: ReqState, ttft_s: float) -> None:
        self.pool.observe_ttft(ttft_s)
        src = self._src_of.pop(id(r), None)
        if src is not None:
            self.out_pending[src] -= 1

    # -- prefill on converted instances ------------------------------------------------

    def is_converted(self, inst: Instance) -> bool:
        return inst.role == "decode" and inst.iid in self.converted

    def prefill_duration(self, inst: Instance, prompts: list[int], plain_s: float) -> float:
        """Chunked prefill time of ``prompts`` on ``inst`` (``plain_s`` if not converted)."""
        if not self.is_converted(inst):
            return plain_s
        d = self._by_iid[inst.iid]
        chunks = self.config.chunks(sum(prompts))
        floor = self.host.compute.prefill_s([1])  # one pass over the weights
        compute_s = max(plain_s, chunks * floor)
        now = self.host.loop.now()
        self.host._advance(d, now)
        # the residents step once per chunk, each step one chunk longer
        step = d.step_s if d.n else 0.0
        d.extra_step_s = compute_s / chunks
        if d.n:
            self.host._reschedule(d, now)
        return compute_s + chunks * step

    def prefill_started(self, inst: Instance, batch: Sequence[ReqState]) -> None:
        if not self.is_converted(inst):
            return
        self.prefilling.add(inst.iid)
        self.out_pending[inst.iid] = self.out_pending.get(inst.iid, 0) + len(batch)
        for r in batch:
            self._src_of[id(r)] = inst.iid

    def prefill_done(self, inst: Instance) -> bool:
        """Whether ``inst`` goes back to the idle prefill list (False while draining)."""
        if not self.is_converted(inst):
            return True
        self.prefilling.discard(inst.iid)
        d = self._by_iid[inst.iid]
        now = self.host.loop.now()
        self.host._advance(d, now)
        d.extra_step_s = 0.0
        if d.n:
            self.host._reschedule(d, now)
        return inst.iid not in self.draining

    # -- the tick ----------------------------------------------------------------------

    def views(self) -> list[WorkerView]:
        slots = self.host.max_decode_batch
        out = [
            WorkerView(p.name, "prefill", "prefill", 0, 0, prefilling=p not in self.host.idle)
            for p in self.host.prefill_pool
        ]
        for d in self.host.decodes:
            iid = d.inst.iid
            conv = iid in self.converted
            out.append(
                WorkerView(
                    d.inst.name,
                    "decode",
                    "prefill" if conv else "decode",
                    d.n + len(d.waiting),
                    slots,
                    unacked_kv=d.pending + self.out_pending.get(iid, 0),
                    prefilling=iid in self.prefilling or (conv and iid not in self.ready),
                    fenced=iid in self.fenced,
                    kv_used=d.reserved,
                    kv_capacity=d.capacity,
                    kv_released=d.released,
                )
            )
        return out

    def _tick(self) -> None:
        host = self.host
        now = host.loop.now()
        # the dispatcher leaves a request queued with a prefill instance idle only when no
        # open decode instance has KV room for it
        blocked = bool(host.queue) and bool(host.idle)
        plan = self.pool.update(len(host.queue), self.views(), decode_blocked=blocked)
        self._apply(plan)
        self.series.append((now, self.prefill_workers, len(host.queue)))
        busy = (
            host._arrivals_left()
            or host.queue
            or self.converted
            or self.fenced
            or self.pool.in_rush
        )
        if busy:
            host.loop.call_at(now + self.tick_s, self._tick)
        else:
            self._ticking = False

    def _apply(self, plan: ConversionPlan) -> None:
        host = self.host
        loop = host.loop
        for name in plan.fence:
            d = self.by_name[name]
            d.closed = True
            self.fenced.add(d.inst.iid)
        for name in plan.unfence:
            d = self.by_name[name]
            d.closed = False
            self.fenced.discard(d.inst.iid)
        for name in plan.to_prefill:
            d = self.by_name[name]
            d.closed = True
            self.fenced.discard(d.inst.iid)
            self.converted.add(d.inst.iid)
            loop.call_at(loop.now() + self.conversion_s, self._joined_prefill, d)
        if self.pool.in_rush and self.draining:  # a new rush: drained ones serve again
            for iid in sorted(self.draining):
                d = self._by_iid[iid]
                if iid not in self.prefilling and d.inst not in host.idle:
                    host.idle.append(d.inst)
            self.draining.clear()
            host._dispatch()
        for name in plan.drain:
            d = self.by_name[name]
            if d.inst.iid in self.ready:
                self.draining.add(d.inst.iid)
                if d.inst in host.idle:
                    host.idle.remove(d.inst)
        for name in plan.to_decode:
            d = self.by_name[name]
            iid = d.inst.iid
            if iid in self._returning:
                continue
            self._returning.add(iid)
            if d.inst in host.idle:
                host.idle.remove(d.inst)
            if iid in self.ready:
                self.ready.discard(iid)
                self._set_prefill_workers(self.prefill_workers - 1)
            self.draining.discard(iid)
            loop.call_at(loop.now() + self.conversion_s, self._joined_decode, d)

    def _joined_prefill(self, d: DecodeState) -> None:
        iid = d.inst.iid
        if iid not in self.converted or iid in self._returning:
            return
        self.ready.add(iid)
        self._set_prefill_workers(self.prefill_workers + 1)
        self.host.idle.append(d.inst)
        self.host._dispatch()

    def _joined_decode(self, d: DecodeState) -> None:
        iid = d.inst.iid
        self._returning.discard(iid)
        self.converted.discard(iid)
        d.closed = False
        self.host._dispatch()

    def _set_prefill_workers(self, n: int) -> None:
        self.prefill_workers = n
        self.min_prefill = min(self.min_prefill, n)
        self.max_prefill = max(self.max_prefill, n)

    @property
    def conversions(self) -> int:
        return self.pool.conversions

    @property
    def rush_periods(self) -> list[tuple[float, float | None]]:
        return self.pool.rush_periods
