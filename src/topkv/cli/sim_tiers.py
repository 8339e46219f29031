"""``topkv sim --tiers LAYOUTS``: decode memory tier layouts side by side (docs/tiers.md)."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from topkv.cli.console import stdout_console
from topkv.inputs import load_json
from topkv.jsonout import dumps
from topkv.sim.runner import SimConfig
from topkv.sim.tiers import calibrated, compare_layouts, parse_layouts
from topkv.traces import Workload

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
