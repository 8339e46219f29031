"""Adaptive Decoder Pool evaluation (issue #15): static 1:1 vs the best static split in
hindsight vs ADP starting from 1:1, on the traces shipped in the repository.

For each trace (at each rate scale) it simulates Llama-3-70B on ``4x-dgx-h100`` (TP 4: 8
instances) under the paper's transport policy:

* static 1:1 (4 prefill + 4 decode instances);
* every static split P:(8-P), in lowest terms; the best in hindsight is the one with the
  lowest TTFT p99 (as ``topkv sim --pd-ratio sweep`` names it);
* ADP from 1:1 with the defaults of :class:`topkv.policy.adp.pool.ADPConfig`.

ServeGen m-large is the packaged first day (:data:`topkv.packaged.SERVEGEN_DAY`, 162
clients, 144 ten-minute windows) scaled to the cluster: every client's rate multiplied by
the one factor that makes the day's busiest ten minutes offer exactly what the static 1:1
split's prefill pool (4 instances) can prefill, on the simulator's own compute model and
prefill batching (:func:`prefill_capacity_rps`): the peak a static deployment is sized for.

and checks the issue's targets: ADP's TTFT p90 at least 30% below static 1:1; ADP's TTFT
p99 no worse than the best static split; TPOT p50 no more than 20% above static 1:1.
Everything printed is simulated (the roofline compute model and the link model of
``topkv sim``), not measured on GPUs.

Run: ``.venv/bin/python benchmarks/adp.py [--json] [--quick] [--sensitivity]``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from topkv.kv.catalog import get_model
from topkv.packaged import SAMPLE_TRACE, SERVEGEN_DAY
from topkv.policy.adp.pool import ADPConfig
from topkv.sim.cluster import load_cluster_spec
from topkv.sim.result import PolicyResult
from topkv.sim.runner import SimConfig, run_policy
from topkv.traces import (
    Request,
    ServeGenOptions,
    Workload,
    load_trace,
    scale_rate,
    servegen_profile,
)

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "tests" / "fixtures" / "traces"


@dataclass(frozen=True)
class Case:
    name: str
    path: Path
    #: rate scales (:func:`scale_rate`); for ServeGen, samples superposed (:func:`superposed`)
    scales: tuple[float, ...]
    servegen: ServeGenOptions | None = None
    #: ServeGen scaled to the cluster (:func:`day_workload`) instead of ``scales``
    day: bool = False


#: The traces in the repository, each at its own rate and at a scale that makes bursts
#: exceed the prefill capacity of the static 1:1 split (the situation the ADP is for).
CASES: tuple[Case, ...] = (
    Case("azure-code (400 rows)", TRACES / "azure_2023/AzureLLMInferenceTrace_code.csv", (1, 4)),
    Case("azure-conv (400 rows)", TRACES / "azure_2023/AzureLLMInferenceTrace_conv.csv", (1, 4)),
    Case("azure-conv (4,000 rows, packaged)", SAMPLE_TRACE, (1, 4)),
    Case("mooncake conversation (400 rows)", TRACES / "mooncake/conversation_trace.jsonl", (1,)),
    Case(
        "servegen m-large (first day, scaled to the cluster)",
        SERVEGEN_DAY,
        (1,),
        ServeGenOptions(start_s=0.0, duration_s=86400.0, seed=0),
        day=True,
    ),
)

#: The 2 hours of ServeGen rate files in the test fixtures (3 clients), superposed 16 times:
#: the ``--sensitivity`` workload, and the evaluation before the packaged day.
SERVEGEN_2H = Case(
    "servegen m-large (2 h of rates)",
    TRACES / "servegen/m-large",
    (16,),
    ServeGenOptions(start_s=0.0, duration_s=7200.0, seed=0),
)


def prefill_capacity_rps(
    base: SimConfig, instances: int, options: ServeGenOptions, n: int = 50_000
) -> float:
    """Requests/s that ``instances`` prefill instances sustain on ServeGen's prompt lengths:
    ``n`` lengths drawn as the trace reader draws them (log-normal, its median and sigma),
    packed in arrival order into the simulator's batches (at most ``max_prefill_tokens``),
    each batch timed by the simulator's compute model."""
    compute = base.compute_model(base.resolved_tp())
    rng = np.random.default_rng(options.seed)
    drawn = rng.lognormal(math.log(options.input_median), options.input_sigma, n)
    lengths = np.clip(np.rint(drawn), 1, options.max_tokens).astype(np.int64)
    busy_s, tokens = 0.0, 0
    batch: list[int] = []
    for length in (int(x) for x in lengths):
        if batch and tokens + length > base.max_prefill_tokens:
            busy_s += compute.prefill_s(batch)
            batch, tokens = [], 0
        batch.append(length)
        tokens += length
    busy_s += compute.prefill_s(batch)
    return instances * n / busy_s


def day_scale(case: Case, base: SimConfig) -> tuple[float, float, float]:
    """``(rate scale, 1:1 prefill capacity req/s, the day's peak req/s)``: the scale at which
    the busiest ten-minute window offers what the static 1:1 prefill pool can prefill."""
    assert case.servegen is not None
    capacity = prefill_capacity_rps(base, 4, case.servegen)
    peak = max(rate for _, rate in servegen_profile(case.path))
    return capacity / peak, capacity, peak


def day_workload(case: Case, base: SimConfig) -> Workload:
    """The packaged ServeGen day at :func:`day_scale`."""
    assert case.servegen is not None
    scale, _, _ = day_scale(case, base)
    return load_trace(case.path, servegen=replace(case.servegen, rate_scale=scale))


def superposed(case: Case, k: int) -> Workload:
    """ServeGen at ``k`` times its rate: ``k`` independent samples of the same rate files
    merged (seeds 0..k-1). Unlike :func:`scale_rate` this keeps the time axis, so the
    10-minute windows stay 10 minutes long, as in a day of traffic."""
    assert case.servegen is not None
    reqs: list[Request] = []
    for seed in range(int(k)):
        options = replace(case.servegen, seed=seed)
        reqs.extend(load_trace(case.path, servegen=options).requests)
    reqs.sort(key=lambda r: r.arrival_s)
    renumbered = tuple(
        Request(i, r.arrival_s, r.input_tokens, r.output_tokens) for i, r in enumerate(reqs)
    )
    return Workload(f"servegen-x{k:g}", renumbered)


def _figures(r: PolicyResult) -> dict[str, float]:
    return {
        "ttft_p50_ms": r.pct(r.ttft_s, 50) * 1e3,
        "ttft_p90_ms": r.pct(r.ttft_s, 90) * 1e3,
        "ttft_p99_ms": r.pct(r.ttft_s, 99) * 1e3,
        "tpot_p50_ms": r.pct(r.tpot_s, 50) * 1e3,
    }


def evaluate(
    workload: Workload, base: SimConfig, policy: str = "paper", progress: bool = False
) -> dict[str, object]:
    """Static 1:1, every static split and ADP from 1:1 on ``workload``, with the targets.
    ``progress``: print each run's figures as it finishes (the day takes minutes a run)."""
    instances = 8 if base.cluster.name == "4x-dgx-h100" else None
    assert instances is not None, "the sweep below assumes 4x-dgx-h100 at TP 4"
    started = time.perf_counter()
    adp_run = run_policy(SimConfig(**{**base.__dict__, "adp": ADPConfig()}), workload, policy)
    adp = {
        **_figures(adp_run),
        "conversions": adp_run.conversions,
        "prefill_workers_min": adp_run.prefill_workers_min,
        "prefill_workers_max": adp_run.prefill_workers_max,
        "rush_periods": [[a, b] for a, b in adp_run.rush_periods],
    }
    if progress:
        wall = time.perf_counter() - started
        print(_line(f"  ADP from 1:1 ({wall:.0f} s)", adp), flush=True)
    by_p: dict[int, dict[str, object]] = {}
    # 1:1 first, then the prefill-heavier splits, then the lighter ones
    for p in (*range(instances // 2, instances), *range(instances // 2 - 1, 0, -1)):
        g = math.gcd(p, instances - p)
        ratio = (p // g, (instances - p) // g)
        started = time.perf_counter()
        r = run_policy(SimConfig(**{**base.__dict__, "pd_ratio": ratio}), workload, policy)
        by_p[p] = {"pd_ratio": f"{ratio[0]}:{ratio[1]}", **_figures(r)}
        if progress:
            wall = time.perf_counter() - started
            print(_line(f"  static {ratio[0]}:{ratio[1]} ({wall:.0f} s)", by_p[p]), flush=True)
    sweep = [by_p[p] for p in sorted(by_p)]
    static = next(e for e in sweep if e["pd_ratio"] == "1:1")
    best = min(sweep, key=lambda e: float(e["ttft_p99_ms"]))  # type: ignore[arg-type]
    p90_cut = 1 - adp["ttft_p90_ms"] / static["ttft_p90_ms"]
    targets = {
        "ttft_p90_30pct_below_static": p90_cut >= 0.30,
        "ttft_p99_not_worse_than_best_static": adp["ttft_p99_ms"] <= best["ttft_p99_ms"],
        "tpot_p50_within_20pct_of_static": adp["tpot_p50_ms"] <= 1.2 * static["tpot_p50_ms"],
    }
    return {
        "requests": len(workload),
        "static_1_1": static,
        "best_static": best,
        "adp": adp,
        "ttft_p90_cut_vs_static": p90_cut,
        "ttft_p99_vs_best_static": adp["ttft_p99_ms"] / best["ttft_p99_ms"],
        "tpot_p50_vs_static": adp["tpot_p50_ms"] / static["tpot_p50_ms"],
        "targets": targets,
        "sweep": sweep,
    }


#: ``--sensitivity``: ADP variants (config, conversion seconds) on the traces where ADP acts,
#: to tell a target missed for reaction time from one missed for the policy's aim.
VARIANTS: tuple[tuple[str, ADPConfig, float], ...] = (
    ("defaults", ADPConfig(), 10.0),
    ("2 conversions per step", ADPConfig(convert_step=2), 10.0),
    ("1 s conversions", ADPConfig(), 1.0),
    ("both", ADPConfig(convert_step=2), 1.0),
    ("TTFT target 0.5 s", ADPConfig(ttft_target_s=0.5), 10.0),
    ("cap 75%, 3 per step, 1 s", ADPConfig(max_convert_share=0.75, convert_step=3), 1.0),
)


def sensitivity(base: SimConfig) -> None:
    for name, workload in (
        ("mooncake x1", load_trace(CASES[3].path)),
        ("servegen x16", superposed(SERVEGEN_2H, 16)),
    ):
        for tag, config, conversion_s in VARIANTS:
            cfg = SimConfig(**{**base.__dict__, "adp": config, "adp_conversion_s": conversion_s})
            r = run_policy(cfg, workload, "paper")
            print(_line(f"{name}: {tag}", _figures(r)) + f"  conversions {r.conversions}")


def _line(tag: str, e: dict[str, object]) -> str:
    return (
        f"    {tag:<36} TTFT p50 {float(e['ttft_p50_ms']):9.0f}  p90 {float(e['ttft_p90_ms']):9.0f}"
        f"  p99 {float(e['ttft_p99_ms']):9.0f} ms  TPOT p50 {float(e['tpot_p50_ms']):5.1f} ms"
    )


def _print(res: dict[str, object]) -> None:
    print(f"{res['trace']} x{float(res['rate_scale']):.4g}: {res['requests']} requests")  # type: ignore[arg-type]
    print(_line("static 1:1", res["static_1_1"]))  # type: ignore[arg-type]
    best = res["best_static"]
    assert isinstance(best, dict)
    print(_line(f"best static {best['pd_ratio']}", best))
    adp = res["adp"]
    assert isinstance(adp, dict)
    print(
        _line("ADP from 1:1", adp) + f"  conversions {adp['conversions']}, prefill workers "
        f"{adp['prefill_workers_min']}-{adp['prefill_workers_max']}"
    )
    targets = res["targets"]
    assert isinstance(targets, dict)
    print(
        f"    p90 cut vs 1:1 {float(res['ttft_p90_cut_vs_static']):+.0%} "  # type: ignore[arg-type]
        f"[{'met' if targets['ttft_p90_30pct_below_static'] else 'MISSED'}]; "
        f"p99 / best static {float(res['ttft_p99_vs_best_static']):.2f} "  # type: ignore[arg-type]
        f"[{'met' if targets['ttft_p99_not_worse_than_best_static'] else 'MISSED'}]; "
        f"TPOT p50 / 1:1 {float(res['tpot_p50_vs_static']):.2f} "  # type: ignore[arg-type]
        f"[{'met' if targets['tpot_p50_within_20pct_of_static'] else 'MISSED'}]",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="first scale of each trace only")
    parser.add_argument(
        "--sensitivity", action="store_true", help="only ADP variants on Mooncake and ServeGen"
    )
    parser.add_argument(
        "--only", default=None, help="only the traces whose name contains this (e.g. servegen)"
    )
    parser.add_argument(
        "--servegen-2h",
        action="store_true",
        help="ServeGen as before the packaged day: the fixtures' 2 hours superposed x8 and x16",
    )
    args = parser.parse_args()
    base = SimConfig(model=get_model("Llama-3-70B"), cluster=load_cluster_spec("4x-dgx-h100"))
    if args.sensitivity:
        sensitivity(base)
        return
    out: list[dict[str, object]] = []
    started = time.perf_counter()
    cases = (*CASES[:-1], replace(SERVEGEN_2H, scales=(8, 16))) if args.servegen_2h else CASES
    for case in cases:
        if args.only is not None and args.only not in case.name:
            continue
        if case.day:
            scale, capacity, peak = day_scale(case, base)
            if not args.json:
                print(
                    f"{case.name}: rates x{scale:.4g} (1:1 prefill capacity {capacity:.2f} "
                    f"req/s over the day's peak {peak:.1f} req/s)",
                    flush=True,
                )
            workload = day_workload(case, base)
            res = evaluate(workload, base, progress=not args.json)
            res = {"trace": case.name, "rate_scale": scale, **res}
            res["cluster_scaling"] = {"prefill_capacity_1_1_rps": capacity, "peak_rps": peak}
            out.append(res)
            if not args.json:
                _print(res)
            continue
        loaded = load_trace(case.path, servegen=case.servegen)
        for scale in case.scales[:1] if args.quick else case.scales:
            if case.servegen is not None:
                workload = superposed(case, scale)
            else:
                workload = scale_rate(loaded, scale)
            res = evaluate(workload, base)
            res = {"trace": case.name, "rate_scale": scale, **res}
            out.append(res)
            if not args.json:
                _print(res)
    wall = time.perf_counter() - started
    if args.json:
        print(json.dumps({"cases": out, "wall_seconds": wall}))
    else:
        print(f"{len(out)} cases in {wall:.1f} s wall; all figures simulated")


if __name__ == "__main__":
    main()
