"""``topkv sim``: simulate a cluster on a request trace under several transport policies."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from topkv.cli.console import stdout_console
from topkv.errors import ConfigError
from topkv.inputs import load_json
from topkv.jsonout import dumps
from topkv.kv import get_model, load_hf_config
from topkv.packaged import SAMPLE_TRACE
from topkv.policy.adp.pool import DEFAULT_ADP
from topkv.sim.cluster import SimCluster, load_cluster_spec
from topkv.sim.errors import ClusterSpecError, SimError
from topkv.sim.moe import MoESimOptions, moe_config, run_moe_policy
from topkv.sim.moe_report import moe_documents, moe_router_names, moe_table
from topkv.sim.report import SimReport, sweep_entry
from topkv.sim.runner import POLICIES, SimConfig, run_policy
from topkv.sim.tiers import calibrated, compare_layouts, parse_layouts
from topkv.traces import ServeGenOptions, Workload, head, load_trace, scale_rate

TIERS_HELP = (
    "Compare decode memory tier layouts: hbm, hbm+cxl, hbm+cxl+nvme (comma-separated) or "
    "all (JSON: tiers)."
)
CALIBRATION_HELP = "With --tiers: benchmarks/tiers.py --json output to calibrate the tiers."


def print_tier_comparison(
    config: SimConfig, workload: Workload, layouts: str, calibration: Path | None, as_json: bool
) -> None:
    paper = (
        None
        if calibration is None
        else calibrated(load_json(calibration, what="a benchmarks/tiers.py --json output"))
    )
    report = compare_layouts(config, workload, parse_layouts(layouts), paper=paper)
    if as_json:
        print(dumps({"tiers": report}))
        return
    table = Table(title=f"decode memory tiers: {report['model']}, {report['decode_instances']} "
                  f"decode instances of TP{report['tp']} ({report['tier_figures']})")  # fmt: skip
    for column in ("layout", "concurrency", "goodput req/s", "TPOT p50 ms", "TPOT p99 ms",
                   "decode wait p99 s", "GB moved"):  # fmt: skip
        table.add_column(column, justify="right")
    for run in report["layouts"]:
        table.add_row(
            run["layout"],
            f"{run['concurrency_mean']:.1f}",
            f"{run['goodput_rps']:.2f}",
            f"{run['tpot_p50_ms'] or 0:.1f}",
            f"{run['tpot_p99_ms'] or 0:.1f}",
            f"{run['decode_wait_p99_s'] or 0:.2f}",
            f"{sum(run['bytes_moved'].values()) / 1e9:.1f}",
        )
    stdout_console().print(table)


def _parse_ratio(text: str) -> tuple[int, int]:
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ConfigError(f"--pd-ratio {text!r} is not P:D (for example 1:1 or 2:3)")
    return int(parts[0]), int(parts[1])


def _check_runnable(config: SimConfig, cluster: str) -> int:
    """Build the simulated cluster once, before any progress bar: a cluster that cannot run
    this model (TP does not divide a node, a pool without GPUs) fails here, naming its file.
    Returns the number of instances (prefill + decode)."""
    try:
        tp = config.resolved_tp()
        config.compute_model(tp)
        built = SimCluster.build(config.cluster, tp, config.pd_ratio)
    except (SimError, ConfigError) as exc:
        where = f"{cluster}: " if Path(cluster).is_file() else ""
        raise ClusterSpecError(f"{where}{exc}") from None
    return len(built.prefill) + len(built.decode)


def _reduced(p: int, d: int) -> tuple[int, int]:
    """``p:d`` in lowest terms (6:2 -> 3:1), so a split places its instances as the same
    ratio given to ``--pd-ratio`` does (4:4 is 1:1, alternating prefill and decode)."""
    g = math.gcd(p, d)
    return p // g, d // g


#: ``--adp`` values: which runs have the Adaptive Decoder Pool on.
_ADP_MODES = {"off": [False], "on": [True], "both": [False, True]}
#: The policy a ``--pd-ratio sweep`` runs its static splits under with ``--policy all``:
#: the paper's Algorithm 1, the system's default transport selection.
SWEEP_POLICY = "paper"


def sim_command(
    trace: Path = typer.Option(
        SAMPLE_TRACE,
        "--trace",
        "-t",
        help="Azure CSV, Mooncake JSONL or ServeGen; default: the packaged Azure 2023 "
        "conversation sample (first 4,000 requests).",
        show_default=False,
    ),
    cluster: str = typer.Option(
        "4x-dgx-h100",
        "--cluster",
        help="4x-dgx-h100, 2x-gb200-nvl72, 8x-l40s-pcie, dgx-h100:<gpus>, or a YAML file.",
    ),
    model: str = typer.Option("Llama-3-70B", "--model", "-m", help="Catalog model name."),
    config: Path | None = typer.Option(None, "--config", help="HF config.json instead."),
    policy: str = typer.Option("all", "--policy", help="all, uniform-rdma, paper or cost."),
    rate_scale: float = typer.Option(1.0, "--rate-scale", help="Multiply the request rate."),
    pipelining: str = typer.Option("on", "--pipelining", help="on, off or both."),
    tp: int | None = typer.Option(None, "--tp", help="Tensor parallelism per instance."),
    pd_ratio: str = typer.Option(
        "1:1",
        "--pd-ratio",
        help="Prefill:decode instances, or sweep: also every static split P:(N-P) of the N "
        "instances, in lowest terms (JSON: sweep, best_static); the policies run at 1:1.",
    ),
    adp: str = typer.Option(
        "off",
        "--adp",
        help="Adaptive Decoder Pool: off, on or both (JSON keys P and P+adp).",
    ),
    limit: int | None = typer.Option(None, "--limit", help="Use only the first N requests."),
    slo_ttft_ms: float = typer.Option(2000.0, "--slo-ttft-ms", help="Goodput TTFT SLO."),
    slo_tpot_ms: float = typer.Option(100.0, "--slo-tpot-ms", help="Goodput TPOT SLO."),
    jitter_s: float = typer.Option(3.0, "--jitter-s", help="Mooncake timestamp jitter."),
    seed: int = typer.Option(0, "--seed", help="Random seed (jitter, ServeGen)."),
    servegen_start_s: float | None = typer.Option(
        None,
        "--servegen-start-s",
        help="ServeGen: window start in the rate files (default: first active window).",
    ),
    servegen_duration_s: float = typer.Option(
        600.0, "--servegen-duration-s", help="ServeGen: seconds of the rate files to replay."
    ),
    moe_router: str | None = typer.Option(
        None,
        "--moe-router",
        help="MoE model with expert parallelism: cache-affinity, expert-locality, "
        "load-balance, cost or all (JSON: moe_routers, and moe_baseline: least-loaded).",
    ),
    stragglers: int = typer.Option(
        0, "--stragglers", help="With --moe-router: straggling expert hosts (5x slower)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    report: Path | None = typer.Option(None, "--report", help="Write PNG plots and HTML."),
    tiers: str | None = typer.Option(None, "--tiers", help=TIERS_HELP),
    tier_calibration: Path | None = typer.Option(None, "--tier-calibration", help=CALIBRATION_HELP),
) -> None:
    """Simulate prefill -> KV transfer -> decode on a cluster, side by side per policy."""
    if rate_scale <= 0:
        raise ConfigError("--rate-scale must be > 0")
    policies = list(POLICIES) if policy == "all" else [policy]
    modes = {"on": [True], "off": [False], "both": [True, False]}.get(pipelining)
    if modes is None:
        raise ConfigError(f"--pipelining {pipelining!r}: use on, off or both")
    adp_modes = _ADP_MODES.get(adp)
    if adp_modes is None:
        raise ConfigError(f"--adp {adp!r}: use off, on or both")
    sweep = pd_ratio.strip() == "sweep"
    spec = load_hf_config(config) if config is not None else get_model(model)
    cluster_spec = load_cluster_spec(cluster)
    workload = load_trace(
        trace,
        jitter_s=jitter_s,
        seed=seed,
        servegen=ServeGenOptions(
            start_s=servegen_start_s, duration_s=servegen_duration_s, seed=seed
        ),
    )
    if limit is not None:
        workload = head(workload, limit)
    workload = scale_rate(workload, rate_scale)
    base = SimConfig(
        model=spec,
        cluster=cluster_spec,
        tp=tp,
        pd_ratio=(1, 1) if sweep else _parse_ratio(pd_ratio),
        slo_ttft_s=slo_ttft_ms / 1e3,
        slo_tpot_s=slo_tpot_ms / 1e3,
    )
    routers = moe_router_names(moe_router, stragglers)
    moe = MoESimOptions(stragglers=stragglers, seed=seed) if routers else None
    if moe is not None:
        base = moe_config(base)[0]
    instances = _check_runnable(base, cluster)
    if tiers is not None:  # decode memory tier layouts side by side (sim/tiers.py)
        print_tier_comparison(base, workload, tiers, tier_calibration, as_json)
        return
    splits = [_reduced(p, instances - p) for p in range(1, instances)] if sweep else []
    sweep_policy = policy if policy != "all" else SWEEP_POLICY
    err = Console(stderr=True)
    results = []
    sweep_entries: list[dict[str, object]] = []
    started = time.perf_counter()
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} requests"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as bar:

        def advance_on(task_id: TaskID) -> Callable[[int], None]:
            return lambda done: bar.update(task_id, completed=done)

        for pipelined in modes:
            for name in policies:
                for with_adp in adp_modes:
                    tag = f"{name}+adp" if with_adp else name
                    label = f"{tag} ({'pipelined' if pipelined else 'not pipelined'})"
                    task = bar.add_task(label, total=len(workload))
                    cfg = SimConfig(
                        **{
                            **base.__dict__,
                            "pipelining": pipelined,
                            "adp": DEFAULT_ADP if with_adp else None,
                        }
                    )
                    if moe is not None:
                        results.append(run_moe_policy(cfg, workload, name, moe, advance_on(task)))
                    else:
                        results.append(run_policy(cfg, workload, name, advance_on(task)))
        for split in splits:
            task = bar.add_task(f"{sweep_policy} static {split[0]}:{split[1]}", total=len(workload))
            cfg = SimConfig(**{**base.__dict__, "pd_ratio": split})
            result = run_policy(cfg, workload, sweep_policy, advance_on(task))
            sweep_entries.append(sweep_entry(split, result))
        moe_docs = (
            moe_documents(
                base,
                workload,
                policy,
                routers,
                moe,
                lambda name: advance_on(bar.add_task(f"MoE {name}", total=len(workload))),
            )
            if moe is not None
            else {}
        )
    wall = time.perf_counter() - started
    sim_report = SimReport(
        trace=str(trace),
        cluster=cluster_spec.name,
        model=spec.name,
        requests=len(workload),
        results=results,
        wall_seconds=wall,
        sweep=sweep_entries if sweep else None,
    )
    if report is not None:
        for path in sim_report.write(report):
            err.print(f"wrote {path}")
    if as_json:
        typer.echo(dumps({**sim_report.to_json(), **moe_docs}))
        return
    stdout_console().print(sim_report.table())
    typer.echo(sim_report.footer())
    if sweep:
        typer.echo(sim_report.sweep_text())
    if moe_docs:
        stdout_console().print(moe_table(moe_docs))


def register(app: typer.Typer) -> None:
    app.command("sim")(sim_command)
