"""``topkv demo``: the end-to-end disaggregated run (what ``make demo`` runs)."""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import typer
from rich.console import Console
from rich.live import Live

from topkv.cli.console import stdout_console
from topkv.demo.errors import DemoError
from topkv.harness.stand_in import DEFAULT_STAND_IN
from topkv.jsonout import dumps

if TYPE_CHECKING:
    from topkv.demo.adp import PairedRun
    from topkv.demo.results import RequestResult
    from topkv.demo.runner import DemoOptions, DemoRun
    from topkv.harness.stand_in import Deployment


def demo_command(
    requests: int = typer.Option(50, "--requests", "-n", min=1, help="Requests to replay."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    model_path: Path | None = typer.Option(
        None, "--model-path", help="Local Hugging Face Llama-family model directory."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the demo model's weights and prompts."),
    new_tokens: int = typer.Option(8, "--new-tokens", min=1, help="Tokens generated each."),
    dilation: float | None = typer.Option(
        None,
        "--dilation",
        help="Emulated links run this many times slower than modelled (default: derived from "
        "--stand-in; given, the comparison represents no deployment).",
        show_default=False,
    ),
    stand_in: str = typer.Option(
        DEFAULT_STAND_IN,
        "--stand-in",
        help="MODEL or MODEL@CLUSTER the demo stands for (a catalog model, a topkv sim "
        "cluster, default 4x-dgx-h100): its link-to-compute ratio sets the dilation, and "
        "topkv sim checks the result on it.",
    ),
    pipelining: str = typer.Option(
        "on", "--pipelining", help="on (stream layer by layer) or off (send after prefill)."
    ),
    speedup: float = typer.Option(
        1.5, "--speedup", help="Replay the trace's arrivals this many times faster."
    ),
    trace: Path | None = typer.Option(None, "--trace", help="Azure LLM trace 2023 CSV."),
    trace_start: int = typer.Option(
        0, "--trace-start", min=0, help="Replay from the trace's Nth request (0-based)."
    ),
    decode_capacity: int = typer.Option(
        2, "--decode-capacity", min=1, help="Concurrent decode sequences per decode worker."
    ),
    device_kv_capacity: int | None = typer.Option(
        None,
        "--device-kv-capacity",
        min=1,
        help="KV caches each decode worker keeps on its device tier; the rest are demoted to "
        "host DRAM, emulated CXL and disk, and promoted back for decode (default: no tiers).",
        show_default=False,
    ),
    adp: str = typer.Option(
        "off",
        "--adp",
        help="Adaptive Decoder Pool: off, on, or both (the same requests without, then with "
        "it; the run shown is the one with it).",
    ),
    repeats: int = typer.Option(
        1,
        "--repeats",
        min=1,
        help="With --adp both: this many pairs, alternating their order (off-on, on-off, "
        "...; 2 is ABBA); every run keeps the first run's dilation, and the medians are "
        "reported.",
    ),
    warmup_run: bool = typer.Option(
        False,
        "--warmup-run",
        help="With --adp both: one untimed run without the pool first, left out of the "
        "comparison (it sets the dilation every run keeps).",
    ),
    compute: str = typer.Option(
        "real",
        "--compute",
        help="real (the workers share this host's cores) or paced (emulated: each worker paced "
        "as its own device, every engine turn held to C x its CPU time, C = workers x torch "
        "threads / host cores, at least 1; docs/demo.md).",
    ),
    engine: str = typer.Option(
        "hf",
        "--engine",
        help="hf (TopKV's own workers) or vllm (the same requests through real vLLM "
        "instances with TopKVConnector; needs scripts/install-vllm.sh).",
    ),
) -> None:
    """Prefill and decode in separate processes with layer-by-layer KV streaming."""
    if engine not in ("hf", "vllm"):
        raise DemoError(f"--engine {engine!r}: use hf or vllm")
    if compute not in ("real", "paced"):
        raise DemoError(f"--compute {compute!r}: use real or paced")
    if engine == "vllm" and compute != "real":
        raise DemoError("--compute paced paces TopKV's own workers: give --engine hf")
    if engine == "vllm":
        _run_vllm(requests, as_json, seed, new_tokens, speedup, trace, trace_start)
        return
    from topkv.demo.adp import adp_json, adp_text, pairs_json, pairs_text
    from topkv.demo.compute import ComputeEmulation, compute_json
    from topkv.demo.report import (
        options_json,
        request_json,
        results_table,
        summarize,
        summary_text,
    )
    from topkv.demo.runner import DemoOptions, DemoRun
    from topkv.demo.tiers import tiers_json, tiers_text
    from topkv.demo.topology import DEFAULT_PLACEMENTS
    from topkv.engine import model_extra_available
    from topkv.engine.deps import INSTALL_HINT
    from topkv.harness.sim_check import sim_check
    from topkv.harness.stand_in import Deployment

    if pipelining not in ("on", "off"):
        raise DemoError(f"--pipelining {pipelining!r}: use on or off")
    if adp not in ("off", "on", "both"):
        raise DemoError(f"--adp {adp!r}: use off, on or both")
    if adp != "both" and (repeats > 1 or warmup_run):
        raise DemoError("--repeats and --warmup-run compare the pool: give --adp both")
    deployment = Deployment.parse(stand_in)
    options = DemoOptions(
        requests=requests,
        seed=seed,
        model_path=str(model_path) if model_path is not None else None,
        new_tokens=new_tokens,
        dilation=dilation,
        speedup=speedup,
        trace=trace,
        trace_start=trace_start,
        device_kv_capacity=device_kv_capacity,
        decode_capacity=decode_capacity,
        pipelining=pipelining == "on",
        adp=adp != "off",
        # derived once: every run of an --adp both comparison keeps the same pace
        compute=ComputeEmulation.choose(compute, workers=len(DEFAULT_PLACEMENTS)),
    )
    started = time.perf_counter()
    # reads the trace and the topology: a bad file fails here, before any model or worker
    run = DemoRun(options, stand_in=deployment.stand_in)
    if not model_extra_available():
        raise DemoError(f"the demo runs a real model: {INSTALL_HINT}")
    _interrupt_on_signals()
    without_adp = None
    pairs = None
    if adp == "both":
        compared = _run_pairs(options, deployment, repeats, warmup_run)
        run, results, without_adp, pairs = (
            compared.run,
            compared.results,
            compared.off,
            compared.runs,
        )
        wall_s = compared.wall_s
    else:
        results = _run_live(run, "")
        wall_s = time.perf_counter() - started
    assert run.dilation is not None  # set by the warm-up of a run that finished
    summary = summarize(results, options, wall_s, run.model_id, run.dilation)
    summary["emulation"]["compute"] = compute_json(options.compute, run.paced_turns)
    summary["sim_check"] = sim_check(
        deployment,
        results,
        summary,
        pipelining=options.pipelining,
        decode_slots=options.decode_capacity,
        new_tokens=options.new_tokens,
    )
    if device_kv_capacity is not None:
        summary["kv_tiers"] = tiers_json(device_kv_capacity, results)
    pool = adp_json(run.adp_report, results, without_adp) if run.adp_report is not None else None
    if pool is not None and pairs is not None:
        pool.update(pairs_json(pairs))
    if as_json:
        payload = {
            "requests": [request_json(r) for r in results],
            "summary": summary,
            "options": options_json(options, run.dilation.factor),
        }
        if pool is not None:
            payload["adp"] = pool
        sys.stdout.write(dumps(payload) + "\n")
    else:
        out = stdout_console()
        out.print(results_table(results, run.dilation.factor))
        out.print(summary_text(summary))
        if pool is not None:
            out.print(adp_text(pool))
            if "pairs" in pool:
                out.print(pairs_text(pool))
        if "kv_tiers" in summary:
            out.print(tiers_text(summary["kv_tiers"]))
    if not summary["all_tokens_identical"]:
        raise typer.Exit(1)


def _run_vllm(
    requests: int,
    as_json: bool,
    seed: int,
    new_tokens: int,
    speedup: float,
    trace: Path | None,
    trace_start: int,
) -> None:
    """``--engine vllm`` (docs/vllm.md): exit 1 when any request's tokens differ."""
    from topkv.integrations.vllm.stack.demo_run import VllmDemoOptions, run_vllm_demo

    options = VllmDemoOptions(requests, seed, new_tokens, speedup, trace, trace_start)
    payload = run_vllm_demo(options)
    summary = payload["summary"]
    if as_json:
        sys.stdout.write(dumps(payload) + "\n")
    else:
        for r in payload["requests"]:
            typer.echo(
                f"request {r['id']:3d}  prompt {r['prompt_len']:5d}  {r['transport'] or '-':4s}  "
                f"{r['bytes'] or 0:9d} B  TTFT {r['ttft_ms'] or 0:8.1f} ms  "
                f"identical {r['tokens_identical']}" + (f"  {r['error']}" if r["error"] else "")
            )
        ttft = summary["ttft_ms"] or {}
        typer.echo(
            f"vLLM: {summary['tokens_identical']}/{summary['requests']} token-identical, "
            f"TTFT p50 {ttft.get('p50')} ms, p95 {ttft.get('p95')} ms"
        )
    if not summary["all_tokens_identical"]:
        raise typer.Exit(1)


class _Compared(NamedTuple):
    run: DemoRun  #: the run shown: the first with the pool
    results: list[RequestResult]
    off: list[RequestResult]  #: the run without the pool in the shown run's pair
    runs: list[PairedRun]  #: every timed run
    wall_s: float  #: the shown run's


def _run_pairs(
    options: DemoOptions, deployment: Deployment, repeats: int, warmup_run: bool
) -> _Compared:
    """``--adp both``: ``repeats`` pairs in alternating order (docs/adp.md, "Live burst"),
    after an optional untimed run; every run keeps the dilation of the first."""
    from topkv.demo.adp import PairedRun, pair_orders
    from topkv.demo.compute import compute_json
    from topkv.demo.runner import DemoRun

    shared = None
    if warmup_run:
        first = DemoRun(replace(options, adp=False), stand_in=deployment.stand_in)
        _run_live(first, "warm-up run: ")
        shared = first.dilation
    runs: list[PairedRun] = []
    shown: tuple[DemoRun, list[RequestResult], float] | None = None
    off: list[RequestResult] = []
    for pair, order in enumerate(pair_orders(repeats)):
        for with_adp in order:
            run = DemoRun(replace(options, adp=with_adp), stand_in=deployment.stand_in)
            run.reuse_dilation = shared
            load, started = os.getloadavg()[0], time.perf_counter()
            label = f"pair {pair + 1}/{repeats}, {'with' if with_adp else 'without'} the ADP: "
            results = _run_live(run, label)
            assert run.dilation is not None and run.warmup is not None
            shared = run.dilation
            runs.append(
                PairedRun(pair, with_adp, results, run.adp_report, run.dilation.factor,
                          run.warmup.kv_bytes_per_prefill_s, (load, os.getloadavg()[0]),
                          compute_json(run.options.compute, run.paced_turns))
            )  # fmt: skip
            if with_adp and shown is None:
                shown = (run, results, time.perf_counter() - started)
            elif not with_adp and pair == 0:
                off = results
    assert shown is not None
    return _Compared(shown[0], shown[1], off, runs, shown[2])


def _run_live(run: DemoRun, label: str) -> list[RequestResult]:
    """Run ``run`` with its progress on stderr; Ctrl-C stops every worker it started."""
    from topkv.demo.report import progress_view
    from topkv.demo.results import Progress

    err = Console(stderr=True)
    with Live(console=err, refresh_per_second=8, transient=False) as live:

        def show(progress: Progress) -> None:
            live.update(progress_view(progress))

        run.on_progress = show
        try:
            results = run.run()
        except KeyboardInterrupt:
            live.stop()
            err.print(f"topkv demo: {label}interrupted; every worker process was stopped")
            raise typer.Exit(130) from None
    return results


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
