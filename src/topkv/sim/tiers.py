"""Decode memory with tiers (paper §3.7): HBM, then CXL, then NVMe, in simulated time.

``topkv sim --tiers hbm,hbm+cxl,hbm+cxl+nvme`` runs each layout on the same requests
(:func:`compare_layouts`, :func:`run_tier_layout`) and compares concurrency, goodput, TPOT
p50/p99 and the bytes moved between tiers. :class:`DecodePool` is one decode instance's
tiers, placing, demoting and promoting with :mod:`topkv.policy.tiers`; the figures start from
the paper's Table 3, or this host's (:func:`calibrated`). The model: docs/tiers.md
("Simulator").
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Any

from topkv.policy import tiers as policy
from topkv.policy.clock import ManualClock
from topkv.sim.cluster import SimCluster
from topkv.sim.compute import ComputeModel
from topkv.sim.errors import SimError
from topkv.sim.runner import SimConfig
from topkv.traces import Workload

LAYOUTS = {"hbm": ("hbm",), "hbm+cxl": ("hbm", "cxl"), "hbm+cxl+nvme": ("hbm", "cxl", "nvme")}
#: The paper's node: four CXL 3.0 endpoints of 128 GB and 64 GB/s; NVMe at 7 GB/s. The
#: NVMe capacity per node is ours (8 x 3.84 TB drives, a common GPU-server layout).
CXL_ENDPOINTS = 4
NVME_BYTES_PER_NODE = 8 * 3.84e12
GPUS_PER_NODE = 8


def parse_layouts(text: str) -> list[str]:
    """``hbm,hbm+cxl`` or ``all`` -> the layouts, in order; unknown names are refused."""
    names = list(LAYOUTS) if text.strip() == "all" else [t.strip() for t in text.split(",")]
    bad = [n for n in names if n not in LAYOUTS]
    if bad or not names:
        raise SimError(f"--tiers {text!r}: use {', '.join(LAYOUTS)} (comma-separated) or all")
    return names


def instance_tiers(
    compute: ComputeModel, layout: str, paper: dict[str, policy.TierSpec]
) -> list[policy.TierSpec]:
    """The tiers one decode instance of ``compute.tp`` GPUs has under ``layout``."""
    share = compute.tp / GPUS_PER_NODE
    hbm_bw = compute.tp * compute.gpu.hbm_bandwidth * compute.mbu / 1e9
    out = [
        replace(paper["hbm"], capacity_bytes=int(compute.kv_capacity_bytes), bandwidth_gbps=hbm_bw)
    ]
    if "cxl" in LAYOUTS[layout]:
        cxl = paper["cxl"]
        out.append(replace(cxl, capacity_bytes=int(share * CXL_ENDPOINTS * cxl.capacity_bytes),
                           bandwidth_gbps=share * CXL_ENDPOINTS * cxl.bandwidth_gbps))  # fmt: skip
    if "nvme" in LAYOUTS[layout]:
        out.append(replace(paper["nvme"], capacity_bytes=int(share * NVME_BYTES_PER_NODE)))
    return out


def calibrated(bench: dict[str, Any]) -> dict[str, policy.TierSpec]:
    """Table 3 with this host's measured figures where ``benchmarks/tiers.py`` has them
    (NVMe: the disk tier's read bandwidth; host DRAM: the host tier's get)."""
    tiers = dict(policy.PAPER_TIERS)
    if isinstance(bench.get("disk_read_gbps"), float | int) and bench["disk_read_gbps"] > 0:
        tiers["nvme"] = replace(tiers["nvme"], bandwidth_gbps=float(bench["disk_read_gbps"]))
    if isinstance(bench.get("host_get_gbps"), float | int) and bench["host_get_gbps"] > 0:
        tiers["dram"] = replace(tiers["dram"], bandwidth_gbps=float(bench["host_get_gbps"]))
    return tiers


@dataclass
class _Seq:
    rid: int
    ready_s: float
    kv_bytes: int  # reserved for its whole life: prompt + output tokens
    tokens: int  # output tokens to decode
    prompt: int
    tier: str = ""
    done_tokens: int = 0
    first_step_s: float | None = None
    last_use_s: float = 0.0
    wait_s: float = 0.0  # from ready for decode to its first decode step


@dataclass
class TierRunResult:
    layout: str
    requests: int = 0
    completed: int = 0
    concurrency_max: int = 0
    concurrency_mean: float = 0.0
    tpot_s: list[float] = field(default_factory=list)
    queue_s: list[float] = field(default_factory=list)
    bytes_moved: dict[str, int] = field(default_factory=dict)
    goodput_rps: float = 0.0
    tokens_per_s: float = 0.0
    makespan_s: float = 0.0
    tiers: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        def pct(values: list[float], q: int) -> float | None:
            if len(values) < 2:
                return values[0] if values else None
            return statistics.quantiles(values, n=100, method="inclusive")[q - 1]

        def ms(value: float | None) -> float | None:
            return None if value is None else value * 1e3

        return {
            "layout": self.layout,
            "requests": self.requests,
            "completed": self.completed,
            "concurrency_max_per_instance": self.concurrency_max,
            "concurrency_mean": self.concurrency_mean,
            "goodput_rps": self.goodput_rps,
            "tokens_per_s": self.tokens_per_s,
            "tpot_p50_ms": ms(pct(self.tpot_s, 50)),
            "tpot_p99_ms": ms(pct(self.tpot_s, 99)),
            "decode_wait_p50_s": pct(self.queue_s, 50),
            "decode_wait_p99_s": pct(self.queue_s, 99),
            "bytes_moved": dict(self.bytes_moved),
            "tiers": self.tiers,
        }


class _Instance:
    """One decode instance's tiers, sequences and clock."""

    def __init__(
        self, compute: ComputeModel, tiers: list[policy.TierSpec], max_batch: int, slo_s: float
    ) -> None:
        self.compute = compute
        self.slo_s = slo_s
        self.tiers = tiers
        self.by_name = {t.name: t for t in tiers}
        self.free = {t.name: t.capacity_bytes for t in tiers}
        self.model = policy.TierModel(tiers, ManualClock())
        self.max_batch = max_batch
        self.admitted: list[_Seq] = []
        self.moved: dict[str, int] = {}
        self.step_s = 0.02
        self.mean_tokens = 128
        self.slots = max_batch

    def _needed(self, extra: int | None = None) -> dict[int, float]:
        """Seconds until each held sequence (and ``extra``, queued last) is decoded next:
        the last step's batch size is the number of decode slots."""
        slots = self.slots
        running = [policy.Running(s.rid, s.tokens - s.done_tokens) for s in self.admitted[:slots]]
        waiting = [s.rid for s in self.admitted[slots:]] + ([] if extra is None else [extra])
        return policy.next_use_s(running, waiting, slots=slots, step_s=self.step_s,
                          tokens_per_request=self.mean_tokens)  # fmt: skip

    def _move(self, s: _Seq, dst: str) -> float:
        """Move ``s`` to ``dst``; returns the seconds its bytes take at the slower side."""
        key = f"{s.tier}->{dst}"
        self.moved[key] = self.moved.get(key, 0) + s.kv_bytes
        self.free[s.tier] += s.kv_bytes
        self.free[dst] -= s.kv_bytes
        slow = min(self.by_name[s.tier].bandwidth_gbps, self.by_name[dst].bandwidth_gbps)
        seconds = s.kv_bytes / (slow * 1e9)
        s.tier = dst
        return seconds

    def _make_room(self, tier: str, nbytes: int, keep: set[int]) -> bool:
        """Demote least-soon-needed sequences out of ``tier`` (never those in ``keep``)."""
        if self.free[tier] >= nbytes:
            return True
        residents = [policy.Resident(s.rid, s.tier, s.kv_bytes, s.last_use_s, s.rid in keep)
                     for s in self.admitted if s.tier == tier]  # fmt: skip
        victims = policy.choose_victims(residents, self._needed(), nbytes, self.free[tier])
        if victims is None:
            return False
        lower = [
            t
            for t in self.tiers
            if t.name != tier and t.bandwidth_gbps < self.by_name[tier].bandwidth_gbps
        ]
        by_rid = {s.rid: s for s in self.admitted}
        for v in victims:
            target = policy.place(v.nbytes, lower, self.free)
            if target is None:
                return False
            self._move(by_rid[v.request_id], target.name)
        return True

    def admit(self, s: _Seq) -> bool:
        needed_in = self._needed(s.rid)[s.rid]
        disk = next((t.name for t in self.tiers if t.kind == "disk"), None)
        allow_disk = disk is None or policy.admit_to_disk(needed_in, s.kv_bytes, self.model, disk)
        target = policy.place(s.kv_bytes, self.tiers, self.free, allow_disk=allow_disk)
        if target is None:
            return False
        s.tier = target.name
        self.free[target.name] -= s.kv_bytes
        self.admitted.append(s)
        return True

    def _lower_s(self, s: _Seq) -> float:
        """What reading ``s`` from a lower tier adds to a decode step."""
        tier = self.by_name[s.tier]
        return self.compute.kv_bytes_per_token * _context(s) / (tier.bandwidth_gbps * 1e9)

    def _promote(self, candidates: list[_Seq], keep: set[int]) -> None:
        """Bring the sequences needed next up to HBM: into free HBM, or in place of an idle
        one needed later (demoted); from disk at least to a memory tier."""
        hbm = self.tiers[0].name
        for s in candidates:
            if s.tier == hbm:
                continue
            if self._make_room(hbm, s.kv_bytes, keep):
                self._move(s, hbm)
            elif self.by_name[s.tier].kind == "disk":
                memory = [t for t in self.tiers if t.kind != "disk"]
                target = policy.place(s.kv_bytes, memory, self.free)
                if target is not None:
                    self._move(s, target.name)

    def _batch(self) -> list[_Seq]:
        """The sequences this step decodes: in order, at most ``max_batch``, none on disk,
        while the predicted step stays within the TPOT SLO (always at least one); one read
        in place from a lower tier only where it raises the tokens per second."""
        hbm = self.tiers[0].name
        batch: list[_Seq] = []
        hbm_tokens, lower_s = 0, 0.0
        for s in self.admitted:
            if len(batch) >= self.max_batch:
                break
            if self.by_name[s.tier].kind == "disk":
                continue
            tokens = hbm_tokens + (_context(s) if s.tier == hbm else 0)
            extra = lower_s + (self._lower_s(s) if s.tier != hbm else 0.0)
            before = self.compute.decode_step_s(len(batch), hbm_tokens) + lower_s
            after = self.compute.decode_step_s(len(batch) + 1, tokens) + extra
            if batch and after > self.slo_s:
                break
            # A sequence read in place from a slower tier must not lower the tokens/s.
            if batch and s.tier != hbm and (len(batch) + 1) / after <= len(batch) / before:
                continue
            batch.append(s)
            hbm_tokens, lower_s = tokens, extra
        return batch

    def step(self, now: float) -> tuple[float, list[_Seq]]:
        """One decode step: (seconds, the sequences that finished)."""
        head = self.admitted[: self.max_batch]
        self._promote(head, {s.rid for s in head})
        running = self._batch()
        if not running:  # everything needed is on disk: read the first back, stalling
            s = self.admitted[0]
            memory = [t for t in self.tiers if t.kind != "disk"]
            target = policy.place(s.kv_bytes, memory, self.free)
            stall = self._move(s, target.name) if target is not None else self.step_s
            return stall, []
        hbm = self.tiers[0].name
        hbm_tokens = sum(_context(s) for s in running if s.tier == hbm)
        lower_s = sum(self._lower_s(s) for s in running if s.tier != hbm)
        seconds = self.compute.decode_step_s(len(running), hbm_tokens) + lower_s
        self.step_s = 0.9 * self.step_s + 0.1 * seconds
        self.slots = len(running)
        finished = []
        for s in running:
            if s.first_step_s is None:
                s.first_step_s = now
            s.done_tokens += 1
            s.last_use_s = now + seconds
            if s.done_tokens >= s.tokens:
                finished.append(s)
        for s in finished:
            self.admitted.remove(s)
            self.free[s.tier] += s.kv_bytes
        return seconds, finished


def _context(s: _Seq) -> int:
    """Tokens in its KV now (what a decode step reads)."""
    return s.prompt + s.done_tokens


@dataclass(frozen=True)
class DecodePool:
    """The decode pool a layout runs on, and its SLOs.

    Goodput counts the requests that met the TPOT SLO and waited at most ``slo_wait_s``
    from the end of their prefill to their first decode step (for decode memory, then for
    a place in the batch: that wait adds straight to their time to first token)."""

    decode_instances: int = 1
    max_batch: int = 256
    slo_tpot_s: float = 0.1
    slo_wait_s: float = 2.0
    paper: dict[str, policy.TierSpec] | None = None  # None: the paper's Table 3


def run_tier_layout(
    compute: ComputeModel, workload: Workload, layout: str, pool: DecodePool
) -> TierRunResult:
    """Simulate ``pool`` under ``layout`` on ``workload``."""
    decode_instances, max_batch, paper = pool.decode_instances, pool.max_batch, pool.paper
    slo_tpot_s, slo_wait_s = pool.slo_tpot_s, pool.slo_wait_s
    if decode_instances < 1:
        raise SimError(f"a decode pool needs at least one instance, got {decode_instances}")
    tiers = instance_tiers(compute, layout, dict(paper or policy.PAPER_TIERS))
    result = TierRunResult(layout, requests=len(workload.requests))
    result.tiers = [{"name": t.name, "capacity_bytes": t.capacity_bytes,
                     "bandwidth_gbps": t.bandwidth_gbps, "latency_ns": t.latency_s * 1e9}
                    for t in tiers]  # fmt: skip
    mean_out = max(1, round(statistics.fmean(r.output_tokens for r in workload.requests)))
    weighted = 0.0
    tokens = 0
    good = 0
    end = 0.0
    for index in range(decode_instances):
        inst = _Instance(compute, tiers, max_batch, slo_tpot_s)
        inst.mean_tokens = mean_out
        pending = []
        for r in workload.requests[index::decode_instances]:
            ready = r.arrival_s + compute.prefill_s([r.input_tokens])
            kv = compute.kv_bytes(r.input_tokens + r.output_tokens)
            pending.append(_Seq(r.rid, ready, kv, max(1, r.output_tokens), r.input_tokens))
        pending.sort(key=lambda s: s.ready_s)
        now = 0.0
        i = 0
        while i < len(pending) or inst.admitted:
            if not inst.admitted and pending[i].ready_s > now:
                now = pending[i].ready_s
            while i < len(pending) and pending[i].ready_s <= now and inst.admit(pending[i]):
                i += 1
            if not inst.admitted:  # the next one is larger than every tier: never admitted
                raise SimError(f"request {pending[i].rid}: its KV fits in no tier of {layout}")
            concurrency = len(inst.admitted)
            result.concurrency_max = max(result.concurrency_max, concurrency)
            seconds, finished = inst.step(now)
            weighted += concurrency * seconds
            now += seconds
            for s in finished:
                assert s.first_step_s is not None
                s.wait_s = s.first_step_s - s.ready_s
                result.queue_s.append(s.wait_s)
                tpot = (now - s.first_step_s) / s.tokens
                result.tpot_s.append(tpot)
                tokens += s.tokens
                good += tpot <= slo_tpot_s and s.wait_s <= slo_wait_s
                result.completed += 1
        end = max(end, now)
        for key, n in inst.moved.items():
            result.bytes_moved[key] = result.bytes_moved.get(key, 0) + n
    result.makespan_s = end
    if end > 0:
        result.concurrency_mean = weighted / end
        result.goodput_rps = good / end
        result.tokens_per_s = tokens / end
    return result


def compare_layouts(
    config: SimConfig,
    workload: Workload,
    layouts: list[str],
    *,
    paper: dict[str, policy.TierSpec] | None = None,
) -> dict[str, Any]:
    """Every layout on the same requests, over the decode pool ``config`` builds."""
    tp = config.resolved_tp()
    compute = config.compute_model(tp)
    decode = len(SimCluster.build(config.cluster, tp, config.pd_ratio).decode)
    pool = DecodePool(decode, config.max_decode_batch, config.slo_tpot_s, config.slo_ttft_s, paper)
    runs = [run_tier_layout(compute, workload, layout, pool).to_dict() for layout in layouts]
    return {
        "model": config.model.name,
        "tp": tp,
        "decode_instances": decode,
        "max_decode_batch": config.max_decode_batch,
        "tier_figures": "calibrated" if paper is not None else "paper Table 3",
        "layouts": runs,
    }
