"""``topkv status``: the orchestrator's workers and transfers as rich tables."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"


def workers_table(workers: list[dict[str, Any]]) -> Table:
    table = Table(title=f"Workers ({len(workers)})", title_justify="left")
    for column in ("worker", "role", "node", "host", "gpus", "slots", "transfer endpoint"):
        table.add_column(column)
    for entry in workers:
        w = entry["worker"]
        table.add_row(
            w["worker_id"],
            w["role"],
            w["node"],
            w["host_id"],
            ",".join(str(g) for g in w["gpus"]) or "-",
            f"{entry['slots_used']}/{w['capacity']}" if w["role"] == "decode" else "-",
            w["address"],
        )
    return table


def transfers_table(listing: dict[str, Any]) -> Table:
    counts = ", ".join(f"{k} {v}" for k, v in listing["counts"].items() if v)
    table = Table(
        title=f"Transfers (in flight {listing['in_flight']}, queued {listing['queued']}; "
        f"{counts or 'none yet'})",
        title_justify="left",
    )
    for column in ("request", "state", "source", "destination", "path", "medium", "size"):
        table.add_column(column)
    table.add_column("seconds", justify="right")
    table.add_column("retries/failovers/reroutes")
    table.add_column("decode check")
    for t in listing["transfers"]:
        check = t.get("decode_check")
        verdict = "-" if not check else ("ok" if check["matches_source"] else "MISMATCH")
        seconds = t["transfer_seconds"]
        medium = t["medium"] + (" (emulated)" if t["emulated"] else "")
        table.add_row(
            str(t["request_id"]),
            Text(t["state"], style=_STATE_STYLE.get(t["state"], "")),
            t["source"],
            t["destination"] or "-",
            t["transport"] or "-",
            medium or "-",
            _size(t["size_bytes"]),
            f"{seconds:.4f}" if seconds is not None else "-",
            f"{t['retries']}/{t['failovers']}/{t['reroutes']}",
            verdict if not t["reason"] else f"{verdict} ({t['reason']})",
        )
    return table


_STATE_STYLE = {"delivered": "green", "failed": "red", "cancelled": "yellow", "running": "cyan"}


def render_status(workers: list[dict[str, Any]], listing: dict[str, Any]) -> Group:
    return Group(workers_table(workers), transfers_table(listing))
