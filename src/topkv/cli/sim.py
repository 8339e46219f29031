"""``topkv sim``: simulate a cluster on a request trace under several transport policies."""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from topkv.cli.console import stdout_console
from topkv.errors import ConfigError
from topkv.jsonout import dumps
from topkv.kv import get_model, load_hf_config
from topkv.packaged import SAMPLE_TRACE
from topkv.sim.cluster import SimCluster, load_cluster_spec
from topkv.sim.errors import ClusterSpecError, SimError
from topkv.sim.report import SimReport
from topkv.sim.runner import POLICIES, SimConfig, run_policy
from topkv.traces import ServeGenOptions, head, load_trace, scale_rate


def _parse_ratio(text: str) -> tuple[int, int]:
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ConfigError(f"--pd-ratio {text!r} is not P:D (for example 1:1 or 2:3)")
    return int(parts[0]), int(parts[1])


def _check_runnable(config: SimConfig, cluster: str) -> None:
    """Build the simulated cluster once, before any progress bar: a cluster that cannot run
    this model (TP does not divide a node, a pool without GPUs) fails here, naming its file."""
    try:
        tp = config.resolved_tp()
        config.compute_model(tp)
        SimCluster.build(config.cluster, tp, config.pd_ratio)
    except (SimError, ConfigError) as exc:
        where = f"{cluster}: " if Path(cluster).is_file() else ""
        raise ClusterSpecError(f"{where}{exc}") from None


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
    pd_ratio: str = typer.Option("1:1", "--pd-ratio", help="Prefill:decode instances."),
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
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    report: Path | None = typer.Option(None, "--report", help="Write PNG plots and HTML."),
) -> None:
    """Simulate prefill -> KV transfer -> decode on a cluster, side by side per policy."""
    if rate_scale <= 0:
        raise ConfigError("--rate-scale must be > 0")
    policies = list(POLICIES) if policy == "all" else [policy]
    modes = {"on": [True], "off": [False], "both": [True, False]}.get(pipelining)
    if modes is None:
        raise ConfigError(f"--pipelining {pipelining!r}: use on, off or both")
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
        pd_ratio=_parse_ratio(pd_ratio),
        slo_ttft_s=slo_ttft_ms / 1e3,
        slo_tpot_s=slo_tpot_ms / 1e3,
    )
    _check_runnable(base, cluster)
    err = Console(stderr=True)
    results = []
    started = time.perf_counter()
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} requests"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as bar:
        for pipelined in modes:
            for name in policies:
                label = f"{name} ({'pipelined' if pipelined else 'not pipelined'})"
                task = bar.add_task(label, total=len(workload))
                cfg = SimConfig(**{**base.__dict__, "pipelining": pipelined})

                def advance(done: int, task_id: TaskID = task) -> None:
                    bar.update(task_id, completed=done)

                results.append(run_policy(cfg, workload, name, advance))
    wall = time.perf_counter() - started
    sim_report = SimReport(
        trace=str(trace),
        cluster=cluster_spec.name,
        model=spec.name,
        requests=len(workload),
        results=results,
        wall_seconds=wall,
    )
    if report is not None:
        for path in sim_report.write(report):
            err.print(f"wrote {path}")
    if as_json:
        typer.echo(dumps(sim_report.to_json()))
        return
    stdout_console().print(sim_report.table())
    typer.echo(sim_report.footer())


def register(app: typer.Typer) -> None:
    app.command("sim")(sim_command)
