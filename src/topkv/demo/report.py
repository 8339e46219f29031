"""The demo's outputs: the per-request table, the summary, the JSON, the live view."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from topkv.demo.compute import compute_text
from topkv.demo.emulation import Dilation
from topkv.demo.measure import Percentiles, quantile
from topkv.demo.results import Progress, RequestResult
from topkv.demo.runner import DemoOptions
from topkv.transport.media import MEDIUM_FOR_MODE

#: The keys of each request in ``--json`` (issue #6), in order.
JSON_REQUEST_KEYS = (
    "id",
    "transport",
    "bytes",
    "prefill_ms",
    "transfer_ms",
    "exposed_ms",
    "modelled_exposed_ms",
    "ttft_ms",
    "tokens_identical",
    "emulated",
    # added after issue #6's list: what a replay of the run needs (topkv sim-validate)
    "arrival_ms",
    "prompt_len",
    "prefill_worker",
    "decode_worker",
    "queue_ms",
    "decode_ms",
)
#: Added to each request with --device-kv-capacity (issue #16).
TIER_REQUEST_KEYS = ("tiers", "promotion_ms", "exposed_promotion_ms")
MODEL_TOLERANCE = 0.15
#: Below this the model check's medians are the same (ms): stamps of different processes,
#: HTTP answers and thread wake-ups on a shared host do not resolve less. A derived
#: dilation often leaves the pipelined transfer all but hidden (medians near 0 ms), where a
#: relative gap says nothing.
MODEL_FLOOR_MS = 0.5


def _finite(value: float, digits: int = 3) -> float | None:
    return round(value, digits) if math.isfinite(value) else None


def request_json(result: RequestResult) -> dict[str, Any]:
    out: dict[str, Any] = {}
    keys = JSON_REQUEST_KEYS + (TIER_REQUEST_KEYS if result.tiers is not None else ())
    for key in keys:
        value = getattr(result, key)
        out[key] = _finite(value) if isinstance(value, float) else value
    return out


def options_json(options: DemoOptions, dilation: float) -> dict[str, Any]:
    """The settings that reproduce the run's requests (top-level ``options`` of --json);
    ``dilation``: the factor the run used (given or derived)."""
    return {
        "requests": options.requests,
        "seed": options.seed,
        "speedup": options.speedup,
        "dilation": dilation,
        "new_tokens": options.new_tokens,
    }


def _pct(values: Sequence[float]) -> dict[str, float]:
    return Percentiles.of([v for v in values if math.isfinite(v)]).as_dict()


def summarize(
    results: Sequence[RequestResult],
    options: DemoOptions,
    wall_s: float,
    model_id: str,
    dilation: Dilation,
) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    identical = sum(r.tokens_identical for r in results)
    transports: dict[str, int] = {}
    for r in results:
        transports[r.transport or "none"] = transports.get(r.transport or "none", 0) + 1
    measured = sorted(r.exposed_ms for r in ok)
    modelled = sorted(r.modelled_exposed_ms for r in ok)
    med_measured, med_modelled = quantile(measured, 0.5), quantile(modelled, 0.5)
    gap = (
        abs(med_measured - med_modelled) / med_modelled
        if med_modelled > 0
        else (0.0 if med_measured == 0 else math.inf)
    )
    errors = sorted(abs(r.exposed_ms - r.modelled_exposed_ms) for r in ok)
    serial_total = sum(r.serial_ms for r in ok)
    exposed_total = sum(r.exposed_ms for r in ok)
    rdma_exposed_total = sum(r.uniform_rdma_exposed_ms for r in ok)
    topo_ttft = [r.ttft_ms for r in ok]
    rdma_ttft = [r.uniform_rdma_ttft_ms for r in ok]
    return {
        "model": model_id,
        "requests": len(results),
        "completed": len(ok),
        "tokens_identical": identical,
        "all_tokens_identical": identical == len(results) and len(results) > 0,
        "failed": [{"id": r.id, "error": r.error} for r in results if r.error is not None],
        "transports": transports,
        "emulation": emulation_json(dilation, ok),
        "pipelining": {
            "pipelined": options.pipelining,
            "exposed_ms": _pct([r.exposed_ms for r in ok]),
            "serial_ms": _pct([r.serial_ms for r in ok]),
            "hidden_fraction": round(1 - exposed_total / serial_total, 4) if serial_total else None,
        },
        "model_check": {
            "median_exposed_ms": _finite(med_measured),
            "median_modelled_exposed_ms": _finite(med_modelled),
            "median_gap": _finite(gap, 4),
            "median_abs_error_ms": _finite(quantile(errors, 0.5)),
            "within_15pct": gap <= MODEL_TOLERANCE,
            "within_tolerance": gap <= MODEL_TOLERANCE
            or abs(med_measured - med_modelled) <= MODEL_FLOOR_MS,
            "inputs": (
                "planner.simulate_pipeline with each request's measured per-layer compute "
                "(prefill worker's layer-ready stamps) and per-layer link times measured on a "
                "separate send of the whole cache after prefill (decode worker's landing stamps)"
            ),
        },
        "topology_vs_uniform_rdma": {
            "how": (
                "measured: every request whose path was not RDMA was sent again over emulated "
                "RDMA between the same workers, replaying its recorded layer-ready schedule, "
                "and once more the same way over its own path (the control); uniform-RDMA "
                "exposed = exposed + (exposed of the RDMA copy - exposed of the control), at "
                "least 0; uniform-RDMA TTFT = TTFT - exposed + uniform-RDMA exposed"
            ),
            "topology_aware": {
                "exposed_ms": _pct([r.exposed_ms for r in ok]),
                "ttft_ms": _pct(topo_ttft),
            },
            "uniform_rdma": {
                "exposed_ms": _pct([r.uniform_rdma_exposed_ms for r in ok]),
                "ttft_ms": _pct(rdma_ttft),
            },
            "exposed_ms_saved_total": _finite(rdma_exposed_total - exposed_total),
        },
        "relay": {
            "how": (
                "each request submitted to the relay Orchestrator as its prefill starts "
                "(deferred source digest): RoutingPolicy picks the decode worker, CostPolicy "
                "the transport, RemoteExecutor has the topkv worker processes stream the "
                "layers as prefill publishes them; digest verified at the end"
            ),
            "transfers": sum(1 for r in results if r.attempts > 0),
            "attempts": sum(r.attempts for r in results),
        },
        "wall_s": round(wall_s, 2),
    }


def emulation_json(dilation: Dilation, ok: Sequence[RequestResult]) -> dict[str, Any]:
    """``summary.emulation``: what is emulated, the dilation and how it was set."""
    factor = dilation.factor
    stand_in = dilation.stand_in
    prefill_s = sum(r.prefill_ms for r in ok) * 1e-3
    in_run = sum(r.bytes for r in ok) / prefill_s if prefill_s > 0 else math.nan
    return {
        "emulated": True,
        "dilation": factor,
        "media": {mode: medium for mode, medium in MEDIUM_FOR_MODE.items()} | {"rdma": "tcp"},
        "note": (
            "every link is emulated: bytes really move (shared memory for same-node paths, "
            "TCP for cross-node ones) and are CRC-verified, paced to the path's modelled "
            f"bandwidth and per-layer setup latency slowed {factor:g}x, so that link time over "
            "prefill time is the stand-in deployment's; all times are wall-clock ms on this "
            "host (divide link times by the dilation for the modelled hardware figure)"
        ),
        # issue #19: where the factor comes from
        "stand_in": stand_in.as_json() if stand_in is not None else None,
        "demo_kv_bytes_per_prefill_s": round(dilation.demo_kv_bytes_per_prefill_s),
        "dilation_derived": dilation.derived,
        "dilation_note": dilation.note(),
        "derivation": {
            "formula": (
                "dilation = (stand-in KV bytes per prefill second / TP / its cross-node "
                "bandwidth per GPU) / (demo KV bytes per prefill second / demo RDMA bandwidth)"
            ),
            "derived_dilation": (
                _finite(dilation.derived_factor, 4) if dilation.derived_factor else None
            ),
            "stand_in_tp": stand_in.tp if stand_in is not None else None,
            "link_to_compute": dilation.link_to_compute(),
            "demo_kv_bytes_per_prefill_s_in_run": _finite(in_run, 0),
        },
    }


def _ms(value: float) -> str:
    return f"{value:,.1f}" if math.isfinite(value) else "-"


def results_table(results: Sequence[RequestResult], dilation: float) -> Table:
    table = Table(
        title="TopKV demo: disaggregated prefill -> layer-by-layer KV stream -> decode",
        caption=(
            f"links emulated (paced {dilation:g}x slower than the modelled hardware, real bytes "
            "over shm/tcp); times are wall-clock ms on this host"
        ),
    )
    for name, justify in (
        ("id", "right"), ("route", "left"), ("transport", "left"), ("prompt", "right"),
        ("KV bytes", "right"), ("prefill", "right"), ("transfer", "right"),
        ("exposed", "right"), ("model", "right"), ("serial", "right"), ("TTFT", "right"),
        ("tokens", "center"),
    ):  # fmt: skip
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in results:
        identical = "[green]identical[/]" if r.tokens_identical else "[red]DIFFER[/]"
        if r.error is not None:
            identical = f"[red]failed[/]: {r.error}"
        table.add_row(
            str(r.id),
            f"{r.prefill_worker}->{r.decode_worker}",
            f"{r.transport} (emulated)" if r.emulated else r.transport,
            str(r.prompt_len),
            f"{r.bytes:,}",
            _ms(r.prefill_ms),
            _ms(r.transfer_ms),
            _ms(r.exposed_ms),
            _ms(r.modelled_exposed_ms),
            _ms(r.serial_ms),
            _ms(r.ttft_ms),
            identical,
        )
    return table


def summary_text(summary: dict[str, Any]) -> Text:
    model = summary["model_check"]
    pipe = summary["pipelining"]
    emulation = summary["emulation"]
    cmp_ = summary["topology_vs_uniform_rdma"]
    topo, rdma = cmp_["topology_aware"], cmp_["uniform_rdma"]
    transports = ", ".join(f"{k} {v}" for k, v in sorted(summary["transports"].items()))
    ok = summary["all_tokens_identical"]
    lines = [
        f"model {summary['model']}; {summary['requests']} requests; transports: {transports}",
        f"tokens identical to the single-process run: {summary['tokens_identical']}/"
        f"{summary['requests']}" + ("" if ok else "  <-- MISMATCH OR FAILURE"),
        f"{'pipelined' if pipe['pipelined'] else 'not pipelined (--pipelining off):'} "
        f"exposed p50 {pipe['exposed_ms']['p50']:.1f} ms vs whole cache after "
        f"prefill p50 {pipe['serial_ms']['p50']:.1f} ms; "
        f"hidden {100 * (pipe['hidden_fraction'] or 0):.1f}%",
        f"exposed vs exact pipeline model (median): measured {model['median_exposed_ms']} ms, "
        f"modelled {model['median_modelled_exposed_ms']} ms, gap "
        f"{100 * (model['median_gap'] if model['median_gap'] is not None else math.inf):.1f}% "
        f"({'within' if model['within_tolerance'] else 'NOT within'} 15% or "
        f"{MODEL_FLOOR_MS:g} ms)",
        f"topology-aware vs uniform RDMA (measured): exposed p50 {topo['exposed_ms']['p50']:.1f}"
        f" vs {rdma['exposed_ms']['p50']:.1f} ms, mean {topo['exposed_ms']['mean']:.1f} vs "
        f"{rdma['exposed_ms']['mean']:.1f} ms; TTFT p50 {topo['ttft_ms']['p50']:.1f} vs "
        f"{rdma['ttft_ms']['p50']:.1f} ms, p95 {topo['ttft_ms']['p95']:.1f} vs "
        f"{rdma['ttft_ms']['p95']:.1f} ms",
        f"relay orchestrator: {summary['relay']['transfers']} transfers routed and verified, "
        f"{summary['relay']['attempts']} attempts",
        f"emulated links: time dilation {emulation['dilation']:g}x; wall time "
        f"{summary['wall_s']:.1f} s",
        f"  {emulation['dilation_note']}",
        *_drift_lines(emulation),
        *compute_text(emulation.get("compute", {})),
        *_sim_check_lines(summary.get("sim_check")),
    ]
    return Text("\n".join(lines))


def _drift_lines(emulation: dict[str, Any]) -> list[str]:
    """A host whose prefill ran at another speed in the run than in the warm-up (other
    load) had another link-to-compute ratio than the one the dilation was set for."""
    warm = emulation["demo_kv_bytes_per_prefill_s"]
    in_run = emulation["derivation"]["demo_kv_bytes_per_prefill_s_in_run"]
    if not (in_run and warm) or abs(math.log(in_run / warm)) <= math.log(1.25):
        return []
    return [
        f"  prefill made {in_run / 1e6:.1f} MB of KV per second in the run, "
        f"{warm / 1e6:.1f} in the warm-up: link time over prefill time was "
        f"{warm / in_run:.2g}x the one the dilation was set for"
    ]


def _sim_check_lines(check: dict[str, Any] | None) -> list[str]:
    """The sim check (added above the demo, by ``topkv demo``), when there is one."""
    if check is None:
        return []
    if "error" in check:
        return [f"sim check: {check['error']}"]
    topo, rdma = check["topology_aware"], check["uniform_rdma"]
    demo_fx, sim_fx = check["demo_effect"], check["sim_effect"]

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:+.1f}%"

    return [
        f"sim check ({check['cluster']}, stand-in ms): topology-aware vs uniform RDMA exposed "
        f"p50 {topo['exposed_ms_p50']} vs {rdma['exposed_ms_p50']} ms, TTFT p50 "
        f"{topo['ttft_ms_p50']} vs {rdma['ttft_ms_p50']} ms",
        f"  uniform RDMA's cost as a share of TTFT p50, demo vs sim: exposed "
        f"{pct(demo_fx['exposed'])} vs {pct(sim_fx['exposed'])}, TTFT {pct(demo_fx['ttft'])} "
        f"vs {pct(sim_fx['ttft'])}: {'AGREE' if check['agree'] else 'DISAGREE'}",
    ]


_STAGE_ORDER = ("waiting", "queued", "prefill", "transfer", "decode", "baselines",
                "transferred", "reference", "done", "failed")  # fmt: skip


def progress_view(progress: Progress) -> RenderableType:
    header = Text(
        f"topkv demo - {progress.phase} - {progress.elapsed_s:5.1f} s - "
        f"{progress.total} requests (links emulated)",
        style="bold",
    )
    stages = Table(box=None, show_header=True, pad_edge=False)
    for stage in _STAGE_ORDER:
        stages.add_column(stage, justify="right")
    stages.add_row(*(str(progress.stages.get(s, 0)) for s in _STAGE_ORDER))
    routes = ", ".join(f"{m}: {n}" for m, n in sorted(progress.by_transport.items())) or "-"
    recent = Table(box=None, pad_edge=False, title="latest finished", title_justify="left")
    for name in ("id", "transport", "prompt", "prefill", "exposed", "model", "TTFT"):
        recent.add_column(name, justify="right")
    for r in progress.finished[-5:]:
        recent.add_row(
            str(r.id), r.transport, str(r.prompt_len), _ms(r.prefill_ms), _ms(r.exposed_ms),
            _ms(r.modelled_exposed_ms), _ms(r.ttft_ms),
        )  # fmt: skip
    return Group(header, stages, Text(f"routed: {routes}"), recent)
