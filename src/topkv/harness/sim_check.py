"""``summary.sim_check`` of ``topkv demo``: the simulator, configured as the stand-in, on the
same requests, and whether it tells the demo's story.

:func:`sim_check` simulates the stand-in deployment (:mod:`topkv.harness.stand_in`) in the
demo's shape on the run's requests, loaded as the demo was (:func:`stand_in_workload`,
:func:`stand_in_compute`), under topology-aware selection and uniform RDMA, and compares the
demo's and the simulator's effects of uniform RDMA (:func:`compare`: agreement within
:data:`NEGLIGIBLE` and :data:`SIZE_FACTOR`). How and why: docs/demo.md ("``sim_check``").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from topkv.demo.results import RequestResult
from topkv.harness.stand_in import Deployment
from topkv.sim.compute import ComputeModel
from topkv.sim.result import PolicyResult
from topkv.sim.runner import SimConfig, run_policy
from topkv.traces import Request, Workload

#: An effect smaller than this fraction of TTFT is "no difference": below what the demo
#: resolves on a shared host (its uniform-RDMA copy rides TCP where the topology-aware one
#: rides shared memory: a few ms on a TTFT of hundreds; what replaying the layer schedule
#: adds by itself is measured by the control copy and taken out), and below one layer's
#: transfer, which pipelining never hides and which is a twelfth of the demo model's cache
#: but an 80th of Llama-3-70B's.
NEGLIGIBLE = 0.02
#: Two effects of one direction agree in size when within this factor of each other.
SIZE_FACTOR = 2.0
TOPOLOGY_AWARE_POLICY = "cost"
UNIFORM_POLICY = "uniform-rdma"
EFFECTS = ("exposed", "ttft")


@dataclass(frozen=True)
class Medians:
    """Topology-aware vs uniform-RDMA p50s of one body (ms, in its own time)."""

    topology_exposed_ms: float
    uniform_exposed_ms: float
    topology_ttft_ms: float
    uniform_ttft_ms: float

    def effects(self) -> dict[str, float]:
        """What uniform RDMA costs, as fractions of the topology-aware TTFT p50."""
        ttft = self.topology_ttft_ms
        if not (math.isfinite(ttft) and ttft > 0):
            return {name: math.nan for name in EFFECTS}
        return {
            "exposed": (self.uniform_exposed_ms - self.topology_exposed_ms) / ttft,
            "ttft": (self.uniform_ttft_ms - ttft) / ttft,
        }


def effects_agree(demo: float, sim: float) -> bool:
    """Both negligible, or the same direction with sizes within :data:`SIZE_FACTOR`."""
    if not (math.isfinite(demo) and math.isfinite(sim)):
        return False
    if abs(demo) < NEGLIGIBLE and abs(sim) < NEGLIGIBLE:
        return True
    if demo == 0 or sim == 0 or (demo > 0) != (sim > 0):
        return False
    return 1 / SIZE_FACTOR <= demo / sim <= SIZE_FACTOR


def compare(demo: Medians, sim: Medians) -> dict[str, Any]:
    """Each effect in both bodies, and whether they agree."""
    demo_fx, sim_fx = demo.effects(), sim.effects()
    per = {name: effects_agree(demo_fx[name], sim_fx[name]) for name in EFFECTS}
    return {
        "demo_effect": {name: _round(demo_fx[name]) for name in EFFECTS},
        "sim_effect": {name: _round(sim_fx[name]) for name in EFFECTS},
        "agree_on": per,
        "agree": all(per.values()),
    }


def demo_medians(summary: Mapping[str, Any]) -> Medians:
    """The demo's p50s from its summary (``topology_vs_uniform_rdma``)."""
    cmp_ = summary["topology_vs_uniform_rdma"]
    topo, rdma = cmp_["topology_aware"], cmp_["uniform_rdma"]
    return Medians(
        float(topo["exposed_ms"]["p50"]),
        float(rdma["exposed_ms"]["p50"]),
        float(topo["ttft_ms"]["p50"]),
        float(rdma["ttft_ms"]["p50"]),
    )


def stand_in_workload(
    deployment: Deployment, results: Sequence[RequestResult], new_tokens: int
) -> tuple[Workload, float]:
    """The run's completed requests for the stand-in: lengths kept, arrivals scaled by the
    stand-in's prefill time over the demo's. Returns the workload and that scale."""
    ok = [r for r in results if r.error is None and math.isfinite(r.prefill_ms)]
    demo_s = sum(r.prefill_ms for r in ok) * 1e-3
    stand_in_s = sum(deployment.compute.prefill_s([r.prompt_len]) for r in ok)
    scale = stand_in_s / demo_s if demo_s > 0 else math.nan
    requests = sorted(
        (Request(r.id, r.arrival_ms * 1e-3 * scale, r.prompt_len, new_tokens) for r in ok),
        key=lambda q: (q.arrival_s, q.rid),
    )
    return Workload("topkv-demo (stand-in time)", tuple(requests)), scale


def stand_in_compute(
    deployment: Deployment, results: Sequence[RequestResult], new_tokens: int, scale: float
) -> tuple[ComputeModel, float]:
    """The stand-in's compute with its decode as long, in its time, as the demo's was.

    The arrivals' ``scale`` makes the stand-in's prefill as loaded as the demo's; decode
    holds the decode slots that prefill waits for, so its share must match too, or the
    stand-in queues for another reason than the demo did (Llama-3-70B's 8 tokens on
    DGX-H100 take ~6x its prefill of a demo prompt; the demo model's, ~0.7x). The factor
    is the demo's measured decode time in stand-in time (times ``scale``) over the
    roofline's, each request's ``new_tokens - 1`` steps alone. Returns the model and the
    factor (1.0 where there is nothing to match)."""
    ok = [r for r in results if r.error is None and math.isfinite(r.decode_ms)]
    compute = deployment.compute
    demo_s = sum(r.decode_ms for r in ok) * 1e-3 * scale
    roofline_s = sum(
        compute.decode_step_s(1, r.prompt_len + step) for r in ok for step in range(new_tokens - 1)
    )
    if not (demo_s > 0 and roofline_s > 0 and math.isfinite(demo_s)):
        return compute, 1.0
    factor = demo_s / roofline_s
    return replace(compute, decode_scale=compute.decode_scale * factor), factor


def _sim_medians(topology: PolicyResult, uniform: PolicyResult) -> Medians:
    def p50(result: PolicyResult, values: Any) -> float:
        ms = result.pct_ms(values, 50)
        return math.nan if ms is None else ms

    return Medians(
        p50(topology, topology.exposed_transfer_s),
        p50(uniform, uniform.exposed_transfer_s),
        p50(topology, topology.ttft_s),
        p50(uniform, uniform.ttft_s),
    )


def sim_check(
    deployment: Deployment,
    results: Sequence[RequestResult],
    summary: Mapping[str, Any],
    *,
    pipelining: bool,
    decode_slots: int,
    new_tokens: int,
) -> dict[str, Any]:
    """``summary.sim_check``: the simulator's p50s on the stand-in and the agreement."""
    workload, scale = stand_in_workload(deployment, results, new_tokens)
    compute, decode_factor = stand_in_compute(deployment, results, new_tokens, scale)
    out: dict[str, Any] = {
        "how": (
            f"topkv sim of {deployment.model.name} on {deployment.cluster.name} (TP "
            f"{deployment.tp}) in the demo's shape, 2 prefill + 2 decode instances, on the "
            "run's prompt lengths with its arrivals scaled by the stand-in's prefill time over "
            "the demo's and its decode steps scaled so that decode takes as long, in the "
            "stand-in's time, as the demo's did (decode_scale); policies "
            f"{TOPOLOGY_AWARE_POLICY} vs {UNIFORM_POLICY}; effects are "
            "fractions of the topology-aware TTFT p50; agree: both under "
            f"{NEGLIGIBLE:.0%}, or one direction within {SIZE_FACTOR:g}x"
        ),
        "cluster": deployment.demo_shaped().name,
        "requests": len(workload.requests),
        "time_scale": _round(scale),
        "decode_scale": _round(decode_factor),
        "pipelining": pipelining,
    }
    if not workload.requests or not math.isfinite(scale):
        return out | {"topology_aware": {}, "uniform_rdma": {}, "agree": False,
                      "error": "no completed request to simulate"}  # fmt: skip
    config = SimConfig(
        model=deployment.model,
        cluster=deployment.demo_shaped(),
        tp=deployment.tp,
        pipelining=pipelining,
        max_prefill_tokens=1,  # one prompt per forward pass, as the demo's workers
        compute=compute,
        decode_slots=decode_slots,
    )
    topology = run_policy(config, workload, TOPOLOGY_AWARE_POLICY)
    uniform = run_policy(config, workload, UNIFORM_POLICY)
    sim = _sim_medians(topology, uniform)
    return out | {
        "topology_aware": _figures(topology, sim.topology_exposed_ms, sim.topology_ttft_ms),
        "uniform_rdma": _figures(uniform, sim.uniform_exposed_ms, sim.uniform_ttft_ms),
        **compare(demo_medians(summary), sim),
    }


def _figures(result: PolicyResult, exposed_ms: float, ttft_ms: float) -> dict[str, Any]:
    """One policy's p50s and transports in ``summary.sim_check``."""
    return {
        "exposed_ms_p50": _round(exposed_ms),
        "ttft_ms_p50": _round(ttft_ms),
        "transports": dict(sorted(result.count_by_transport.items())),
    }


def _round(value: float) -> float | None:
    return float(f"{value:.4g}") if math.isfinite(value) else None
