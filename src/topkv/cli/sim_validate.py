"""``topkv sim-validate``: predict a recorded ``topkv demo --json`` run with the simulator."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from topkv.jsonout import dumps


def sim_validate_command(
    demo_json: Path = typer.Option(..., "--demo-json", help="Output of topkv demo --json."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    prefill_model: str = typer.Option(
        "quadratic",
        "--prefill-model",
        help="quadratic (prefill ms vs prompt length) or contention (also vs the prefills "
        "and decodes sharing this CPU host; needs the demo's timeline fields).",
    ),
    calibrate_from: Path | None = typer.Option(
        None,
        "--calibrate-from",
        help="Another demo record (same settings) to calibrate on: a cross-run prediction.",
    ),
    decode_step_ms: float | None = typer.Option(
        None,
        "--decode-step-ms",
        help="Decode time per token; default: the record's decode_ms, else a measured 16.2 ms.",
    ),
    seed: int | None = typer.Option(
        None, "--seed", help="Old records without arrival_ms: the demo's --seed (default 0)."
    ),
    speedup: float | None = typer.Option(
        None, "--speedup", help="Old records without arrival_ms: the demo's --speedup (1.5)."
    ),
    new_tokens: int | None = typer.Option(
        None, "--new-tokens", help="The demo's --new-tokens when the record lacks options (8)."
    ),
    trace: Path | None = typer.Option(
        None, "--trace", help="Old records without arrival_ms: the demo's --trace CSV."
    ),
) -> None:
    """Configure the simulator as the demo's local cluster, calibrated from the record (or
    another run), and compare its predicted TTFT p50/p90, queueing/service split and
    per-request routes with the measured ones (exit 1 beyond 10% at p50)."""
    from topkv.harness.validate_live import (
        calibration_from,
        format_report,
        validate_against_demo,
    )
    from topkv.harness.validate_predict import ValidationOptions
    from topkv.harness.validate_record import DemoRecord

    record = DemoRecord.load(demo_json)
    options = ValidationOptions(
        seed=seed,
        speedup=speedup,
        new_tokens=new_tokens,
        trace=trace,
        decode_step_ms=decode_step_ms,
        prefill_model=prefill_model,
    )
    if calibrate_from is not None:
        options = calibration_from(DemoRecord.load(calibrate_from), options)
    report = validate_against_demo(record, options)
    if as_json:
        sys.stdout.write(dumps(report.as_dict()) + "\n")
    else:
        sys.stdout.write(format_report(report) + "\n")
    if not report.within_target:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add ``sim-validate`` to the ``topkv`` app."""
    app.command("sim-validate")(sim_validate_command)
