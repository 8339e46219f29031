"""``topkv plan`` (per-transport transfer plan) and ``topkv models`` (the model catalog)."""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.table import Table

from topkv.cli.console import stdout_console
from topkv.errors import ConfigError
from topkv.jsonout import dumps
from topkv.kv import ModelSpec, catalog, get_model, load_hf_config
from topkv.kv.dtypes import dtype_bytes
from topkv.planner import build_plan
from topkv.planner.plan import Plan


def _resolve_model(model: str | None, config: Path | None) -> ModelSpec:
    if (model is None) == (config is None):
        raise ConfigError("give exactly one of --model NAME or --config PATH")
    if config is not None:
        return load_hf_config(config)
    return get_model(str(model))


def plan_command(
    model: str | None = typer.Option(None, "--model", "-m", help="Catalog model name."),
    config: Path | None = typer.Option(
        None, "--config", "-c", help="Hugging Face config.json (or its directory)."
    ),
    seq_len: int = typer.Option(4096, "--seq-len", "-s", min=0, help="Tokens per request."),
    dtype: str = typer.Option("fp16", "--dtype", help="KV dtype: fp32, bf16, fp16, fp8."),
    rate: float = typer.Option(100.0, "--rate", min=0.0, help="Requests per second."),
    layer_compute_ms: float = typer.Option(
        0.5, "--layer-compute-ms", min=0.0, help="Prefill compute per layer (ms)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Size the KV cache and cost its transfer over every transport (analytical model)."""
    spec = _resolve_model(model, config)
    dtype_bytes(dtype)  # reject unknown dtypes before any work
    plan = build_plan(spec, seq_len, dtype, rate, layer_compute_ms)
    if as_json:
        typer.echo(dumps(plan.to_json_dict()))
        return
    _print_plan(plan, spec, rate, layer_compute_ms)


def _print_plan(plan: Plan, spec: ModelSpec, rate: float, layer_compute_ms: float) -> None:
    console = stdout_console()
    title = (
        f"{plan.model}: {plan.seq_len} tokens, {plan.dtype}, KV {plan.kv_bytes:,} bytes "
        f"({plan.kv_bytes / 1e9:.3f} GB)"
    )
    table = Table(
        title=title,
        caption="analytical: xfer = Eq. 2; exposed/hidden = exact per-layer pipeline; "
        "max req/s = one link saturated",
    )
    for header in (
        "transport",
        "GB/s",
        "xfer ms",
        "exposed ms",
        "hidden",
        "max req/s",
        "vs RDMA",
    ):
        table.add_column(header, justify="left" if header == "transport" else "right")
    for name, row in plan.transports.items():
        table.add_row(
            name,
            f"{row.bandwidth_gbps:g}",
            f"{row.transfer_ms:.3f}",
            f"{row.pipelined_exposed_ms:.3f}",
            f"{row.hidden_fraction:.1%}",
            _fmt_rate(row.max_requests_per_s),
            f"{row.speedup_vs_rdma:.2f}x",
        )
    console.print(table)
    console.print(
        f"{spec.num_layers} layers at {layer_compute_ms:g} ms each; aggregate demand at "
        f"{rate:g} req/s: {plan.aggregate_demand_gbps:.1f} GB/s"
    )
    state = spec.linear_state_bytes(plan.dtype)
    if state:
        console.print(f"plus {state:,} bytes of fixed linear-attention state (not in KV bytes)")


def _fmt_rate(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.1f}"


def models_command(
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list."),
) -> None:
    """List the model catalog with KV bytes per token (fp16) and at 4K tokens."""
    rows = [_model_row(spec) for spec in catalog()]
    if as_json:
        typer.echo(dumps(rows))
        return
    table = Table(title="Model catalog (fp16 KV)")
    for header in (
        "model",
        "attn",
        "full/slide/lin",
        "B/token",
        "KV @4K",
        "lin. state B",
        "params",
    ):
        table.add_column(
            header, justify="left" if header == "model" else "right", no_wrap=header == "model"
        )
    for spec in catalog():
        table.add_row(
            spec.name,
            spec.attention,
            "/".join(str(spec.layer_types.count(t)) for t in ("full", "sliding", "linear")),
            f"{spec.kv_bytes_per_token():,}",
            f"{spec.kv_bytes(4096) / 1e9:.3f} GB",
            f"{spec.linear_state_bytes():,}" if spec.linear_state_bytes() else "-",
            _fmt_params(spec),
        )
    stdout_console().print(table)


def _model_row(spec: ModelSpec) -> dict[str, object]:
    return {
        "name": spec.name,
        "attention": spec.attention,
        "num_layers": spec.num_layers,
        "kv_bytes_per_token": spec.kv_bytes_per_token(),
        "kv_bytes_4k": spec.kv_bytes(4096),
        "linear_state_bytes": spec.linear_state_bytes(),
        "num_params": spec.num_params,
        "active_params": spec.active_params,
        "source": spec.source,
    }


def _fmt_params(spec: ModelSpec) -> str:
    if spec.num_params is None:
        return "?"
    total = f"{spec.num_params / 1e9:.0f}B"
    if spec.active_params is not None and spec.active_params != spec.num_params:
        return f"{total} ({spec.active_params / 1e9:.0f}B)"
    return total


def register(app: typer.Typer) -> None:
    """Add ``plan`` and ``models`` to the ``topkv`` app."""
    app.command("plan")(plan_command)
    app.command("models")(models_command)
