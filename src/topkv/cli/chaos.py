"""``topkv chaos``: inject faults into a local relay and prove nothing is lost or corrupted."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import typer
from rich.table import Table

from topkv.cli.console import stdout_console
from topkv.cli.options.auth import client_token, token_file_option
from topkv.cli.select import parse_byte_size
from topkv.errors import ConfigError
from topkv.harness.chaos import ChaosConfig, run_chaos
from topkv.jsonout import dumps


def chaos_command(
    mode: str = typer.Option(
        "processes",
        help="processes: worker processes (SIGKILL, faults inside the workers); "
        "inprocess: workers as objects in this process (same transports).",
    ),
    transfers: int = typer.Option(2000, help="Transfers to run."),
    size: str = typer.Option("4MiB", help="KV bytes per transfer (e.g. 4MiB)."),
    corrupt_rate: float = typer.Option(0.05, help="Fraction of transfers with a bit flipped."),
    kill_decoder_after: int = typer.Option(
        500, help="Kill a decode worker after this many deliveries (-1: never)."
    ),
    limit: int = typer.Option(100, help="Concurrency limit of the orchestrator."),
    slow_link_gbps: float = typer.Option(
        1.0, help="Pace one prefill worker's links to this many GB/s (0: no slow link)."
    ),
    seed: int = typer.Option(0, help="Seed of the fault injection."),
    run_dir: Path | None = typer.Option(
        None, help="processes mode: keep worker logs and ready files here (default: temp)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    token_file: Path | None = token_file_option(
        "the admin token the run's workers accept and its executor sends (default: "
        "$TOPKV_TOKEN_FILE, else one made for the run)"
    ),
) -> None:
    """Run transfers through a local cluster with faults; exit 1 if any condition fails."""
    if mode not in ("processes", "inprocess"):
        raise ConfigError(f"--mode must be processes or inprocess, not {mode!r}")
    config = ChaosConfig(
        mode="processes" if mode == "processes" else "inprocess",
        transfers=transfers,
        size_bytes=parse_byte_size(size),
        corrupt_rate=corrupt_rate,
        kill_decoder_after=None if kill_decoder_after < 0 else kill_decoder_after,
        limit=limit,
        slow_link_gbps=slow_link_gbps if slow_link_gbps > 0 else None,
        seed=seed,
        run_dir=run_dir,
        admin_token=client_token(token_file),
    )
    report = asyncio.run(run_chaos(config))
    problems = report.problems(limit)
    if as_json:
        print(dumps(report.to_dict()))
    else:
        table = Table(title=f"topkv chaos ({mode}): {transfers} x {size}, limit {limit}")
        table.add_column("measure")
        table.add_column("value", justify="right")
        for key, value in report.to_dict().items():
            table.add_row(key, str(value))
        table.add_row("injected bit flips", str(report.injected_corruptions))
        table.add_row("retries / failovers", f"{report.retries} / {report.failovers}")
        table.add_row("killed decode worker", report.killed or "-")
        table.add_row("delivered by medium", json.dumps(report.by_medium))
        table.add_row("stranded detail", json.dumps(report.stranded_detail))
        table.add_row("seconds", f"{report.seconds:.1f}")
        console = stdout_console()
        console.print(table)
        console.print("correct" if not problems else "NOT correct: " + "; ".join(problems))
    if problems:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("chaos")(chaos_command)
