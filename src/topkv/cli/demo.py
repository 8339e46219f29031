"""``topkv demo``: the end-to-end disaggregated run (what ``make demo`` runs)."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.live import Live

from topkv.cli.console import stdout_console
from topkv.demo.errors import DemoError
from topkv.jsonout import dumps


def demo_command(
    requests: int = typer.Option(50, "--requests", "-n", min=1, help="Requests to replay."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    model_path: Path | None = typer.Option(
        None, "--model-path", help="Local Hugging Face Llama-family model directory."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the demo model's weights and prompts."),
    new_tokens: int = typer.Option(8, "--new-tokens", min=1, help="Tokens generated each."),
    dilation: float = typer.Option(
        3000.0, "--dilation", help="Emulated links run this many times slower than modelled."
    ),
    speedup: float = typer.Option(
        1.5, "--speedup", help="Replay the trace's arrivals this many times faster."
    ),
    trace: Path | None = typer.Option(None, "--trace", help="Azure LLM trace 2023 CSV."),
) -> None:
    """Prefill and decode in separate processes with layer-by-layer KV streaming."""
    from topkv.demo.report import (
        options_json,
        request_json,
        results_table,
        summarize,
        summary_text,
    )
    from topkv.demo.results import Progress
    from topkv.demo.runner import DemoOptions, DemoRun
    from topkv.engine import model_extra_available
    from topkv.engine.deps import INSTALL_HINT

    options = DemoOptions(
        requests=requests,
        seed=seed,
        model_path=str(model_path) if model_path is not None else None,
        new_tokens=new_tokens,
        dilation=dilation,
        speedup=speedup,
        trace=trace,
    )
    started = time.perf_counter()
    # reads the trace and the topology: a bad file fails here, before any model or worker
    run = DemoRun(options)
    if not model_extra_available():
        raise DemoError(f"the demo runs a real model: {INSTALL_HINT}")
    _interrupt_on_signals()
    err = Console(stderr=True)
    with Live(console=err, refresh_per_second=8, transient=False) as live:

        def show(progress: Progress) -> None:
            from topkv.demo.report import progress_view

            live.update(progress_view(progress))

        run.on_progress = show
        try:
            results = run.run()
        except KeyboardInterrupt:
            live.stop()
            err.print("topkv demo: interrupted; every worker process was stopped")
            raise typer.Exit(130) from None
    summary = summarize(results, options, time.perf_counter() - started, run.model_id)
    if as_json:
        payload = {
            "requests": [request_json(r) for r in results],
            "summary": summary,
            "options": options_json(options),
        }
        sys.stdout.write(dumps(payload) + "\n")
    else:
        out = stdout_console()
        out.print(results_table(results, options.dilation))
        out.print(summary_text(summary))
    if not summary["all_tokens_identical"]:
        raise typer.Exit(1)


def _interrupt_on_signals() -> None:
    """Ctrl-C and SIGTERM unwind the run, so the cluster stops every worker it started.

    (A shell starts background jobs with SIGINT ignored; the demo still wants it.)
    """

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def register(app: typer.Typer) -> None:
    """Add ``demo`` to the ``topkv`` app."""
    app.command("demo")(demo_command)
