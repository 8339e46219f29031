"""Simulator speed: event cores, Azure conv on 64 GPUs (x real time), 1,024 GPUs / 100k requests.

Targets (issue #7): >= 1,000x real time on the Azure conversation trace with 64 GPUs
(splitwise-sim reached ~340x without a link model); <= 60 s wall for 1,024 GPUs and 100k
requests. Run: ``.venv/bin/python benchmarks/sim.py [--quick]``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from topkv.kv.catalog import get_model
from topkv.packaged import SAMPLE_TRACE
from topkv.sim.cluster import load_cluster_spec
from topkv.sim.events import make_loop
from topkv.sim.runner import POLICIES, SimConfig, run_policy
from topkv.traces import Request, Workload, head, load_trace, scale_rate


def tiled(workload: Workload, copies: int) -> Workload:
    """``copies`` back-to-back repetitions of a trace (for a longer, larger workload)."""
    span = workload.duration_s + 1.0
    reqs = [
        Request(k * len(workload) + r.rid, k * span + r.arrival_s, r.input_tokens, r.output_tokens)
        for k in range(copies)
        for r in workload.requests
    ]
    return Workload(f"{workload.name}x{copies}", tuple(reqs))


def _bare_core(kind: str, count: int) -> float:
    loop = make_loop(kind)
    left = [count]

    def tick() -> None:
        left[0] -= 1
        if left[0] > 0:
            loop.call_at(loop.now() + 0.001, tick)

    for k in range(16):  # 16 concurrent chains, as with many instances and links
        loop.call_at(k * 1e-4, tick)
    started = time.perf_counter()
    loop.run()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller runs (smoke test)")
    parser.add_argument(
        "--trace",
        type=Path,
        default=SAMPLE_TRACE,
        help="Azure conversation trace CSV (default: the packaged first 4,000 requests; pass "
        "the full AzureLLMInferenceTrace_conv.csv for the published figures)",
    )
    args = parser.parse_args()
    model = get_model("Llama-3-70B")
    conv = load_trace(args.trace)
    if args.quick:
        conv = head(conv, 3000)

    print("== event core: heap loop vs SimPy")
    # (a) the bare cores: 200k callbacks that each schedule the next (a chain of timers)
    for core in ("heap", "simpy"):
        best = min(_bare_core(core, 200_000) for _ in range(3))
        print(f"  bare {core:5s}: {200_000 / best:,.0f} events/s")
    # (b) the full simulator on a slice of the workload, interleaved, best of 3
    piece = head(conv, 4000)
    walls: dict[str, list[float]] = {"heap": [], "simpy": []}
    for _ in range(3):
        for core in ("heap", "simpy"):
            cfg = SimConfig(model=model, cluster=load_cluster_spec("dgx-h100:64"), event_core=core)
            result = run_policy(cfg, piece, "cost")
            walls[core].append(result.wall_seconds)
    for core, values in walls.items():
        print(
            f"  sim  {core:5s}: best {min(values):.2f} s wall for {len(piece):,} requests "
            f"({result.events:,} events)"
        )

    print(f"== Azure conv trace ({len(conv):,} requests) on 64 H100 (dgx-h100:64), Llama-3-70B")
    cfg = SimConfig(model=model, cluster=load_cluster_spec("dgx-h100:64"))
    total_sim = total_wall = total_cpu = 0.0
    for policy in POLICIES:
        cpu0 = time.process_time()
        r = run_policy(cfg, conv, policy)
        cpu = time.process_time() - cpu0
        total_sim += r.sim_seconds
        total_wall += r.wall_seconds
        total_cpu += cpu
        print(
            f"  {policy:13s}: {r.sim_seconds:7.0f} simulated s in {r.wall_seconds:5.2f} s wall "
            f"({cpu:5.2f} s CPU) = {r.sim_seconds / r.wall_seconds:,.0f}x real time by wall, "
            f"{r.sim_seconds / cpu:,.0f}x by CPU (TTFT p50 {r.pct(r.ttft_s, 50) * 1e3:.1f} ms)"
        )
    print(
        f"  all three    : {total_sim / total_wall:,.0f}x real time by wall, "
        f"{total_sim / total_cpu:,.0f}x by CPU time (target >= 1,000x)"
    )

    count = 10_000 if args.quick else 100_000
    big = head(tiled(scale_rate(load_trace(args.trace), 16.0), 6), count)
    print(f"== 1,024 H100 (dgx-h100:1024), {len(big):,} requests (Azure conv x16 rate, tiled)")
    cfg = SimConfig(model=model, cluster=load_cluster_spec("dgx-h100:1024"))
    for policy in POLICIES:
        started = time.perf_counter()
        cpu0 = time.process_time()
        r = run_policy(cfg, big, policy)
        wall = time.perf_counter() - started
        cpu = time.process_time() - cpu0
        print(
            f"  {policy:13s}: {wall:5.1f} s wall, {cpu:5.1f} s CPU (target <= 60 s), "
            f"{r.sim_seconds:,.0f} "
            f"simulated s, TTFT p50 {r.pct(r.ttft_s, 50) * 1e3:.1f} ms"
        )


if __name__ == "__main__":
    main()
