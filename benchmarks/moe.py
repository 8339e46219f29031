"""MoE routing evaluation (issue #17): the four MoE routers and the EPLB-style static
placement + least-loaded baseline, DeepSeek-V3 on ``2x-gb200-nvl72`` and ``4x-dgx-h100``,
on the Azure 2023 conversation sample and the Mooncake conversation slice, with and
without one straggling expert host (5x slower experts).

Everything printed is simulated (``topkv sim``'s roofline compute, link and dispatch models,
:mod:`topkv.sim.moe`), not measured on GPUs. Checks the issue's targets: the cost router
at least matches the best single strategy in every scenario (TPOT p99 within 2%, an
equal-or-better goodput counted as a match too), and beats each single strategy by >= 15%
on TPOT p99 in at least one straggler scenario.

Run: ``.venv/bin/python benchmarks/moe.py [--json] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from topkv.kv.catalog import get_model
from topkv.packaged import SAMPLE_TRACE
from topkv.policy.moe.router import STRATEGIES
from topkv.sim.cluster import load_cluster_spec
from topkv.sim.moe import BASELINE, MoESimOptions, run_moe_routers
from topkv.sim.runner import SimConfig
from topkv.traces import Workload, head, load_trace, scale_rate

ROOT = Path(__file__).resolve().parents[1]
MOONCAKE = ROOT / "tests" / "fixtures" / "traces" / "mooncake" / "conversation_trace.jsonl"
#: (cluster, TP, rate scale per trace): scales that load each cluster (decode batches of
#: tens of requests), picked once by sweeping x1..x40.
CLUSTERS = {
    "2x-gb200-nvl72": (None, {"azure": 20.0, "mooncake": 4.0}),
    "4x-dgx-h100": (4, {"azure": 2.0, "mooncake": 0.5}),
}


def _traces(limit: int) -> dict[str, Workload]:
    return {
        "azure": head(load_trace(SAMPLE_TRACE), limit),
        "mooncake": head(load_trace(MOONCAKE, jitter_s=3.0, seed=0), limit),
    }


def run(limit: int) -> list[dict[str, object]]:
    model = get_model("DeepSeek-V3")
    rows: list[dict[str, object]] = []
    traces = _traces(limit)
    for cluster, (tp, scales) in CLUSTERS.items():
        config = SimConfig(model=model, cluster=load_cluster_spec(cluster), tp=tp)
        for trace, workload in traces.items():
            scaled = scale_rate(workload, scales[trace])
            for stragglers in (0, 1):
                started = time.perf_counter()
                out = run_moe_routers(
                    config,
                    scaled,
                    "cost",
                    [*STRATEGIES, BASELINE],
                    MoESimOptions(stragglers=stragglers),
                )
                rows.append(
                    {
                        "cluster": cluster,
                        "trace": trace,
                        "rate_scale": scales[trace],
                        "requests": len(scaled),
                        "stragglers": stragglers,
                        "wall_s": time.perf_counter() - started,
                        "routers": out,
                    }
                )
    return rows


def verdict(rows: list[dict[str, object]]) -> dict[str, object]:
    """The issue's two targets over ``rows``."""
    matches, wins = [], []
    for row in rows:
        routers = row["routers"]
        assert isinstance(routers, dict)
        cost = routers["cost"]["tpot_p99_ms"]
        singles = {k: v["tpot_p99_ms"] for k, v in routers.items() if k not in ("cost", BASELINE)}
        best = min(singles.values())
        matches.append(cost <= best * 1.02)
        if row["stragglers"]:
            wins.append(all(cost <= 0.85 * v for v in singles.values()))
    return {
        "matches_best_everywhere": all(matches),
        "beats_all_by_15pct_somewhere": any(wins),
        "matches": matches,
        "straggler_wins": wins,
    }


def table(rows: list[dict[str, object]]) -> str:
    head = (
        "cluster",
        "trace",
        "stragglers",
        "router",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99",
        "goodput rps",
        "dispatch GB (by class)",
        "KV GB (by class)",
        "to straggler group",
    )
    lines = [
        "| " + " | ".join(head) + " |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    for row in rows:
        routers = row["routers"]
        assert isinstance(routers, dict)
        for name, e in routers.items():
            dispatch = " ".join(f"{k} {v / 1e9:,.0f}" for k, v in e["dispatch_bytes"].items())
            kv = " ".join(f"{k} {v / 1e9:,.1f}" for k, v in e["kv_bytes"].items())
            times = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")
            cells = [
                row["cluster"],
                f"{row['trace']} x{row['rate_scale']:g}",
                row["stragglers"],
                name,
                *(f"{e[k]:.1f}" for k in times),
                f"{e['goodput_rps']:.2f}",
                dispatch,
                kv,
                e["routed_to_straggler_group"],
            ]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="200 requests per trace")
    args = parser.parse_args()
    rows = run(200 if args.quick else 1000)
    result = {"rows": rows, "verdict": verdict(rows)}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(table(rows))
    print(json.dumps(result["verdict"]))


if __name__ == "__main__":
    main()
