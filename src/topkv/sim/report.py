"""Outputs of a simulation: the ``--json`` document, a summary table, PNG plots and HTML."""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from rich.table import Table

from topkv.jsonout import dumps
from topkv.policy.admission import KV_EXCEEDS_DECODE_MEMORY, LONGER_THAN_CONTEXT
from topkv.sim.runner import PolicyResult

_REASON_TEXT = {
    LONGER_THAN_CONTEXT: "longer than the model's context",
    KV_EXCEEDS_DECODE_MEMORY: "KV larger than any decode instance's KV memory",
}


@dataclass
class SimReport:
    """All policy results of one ``topkv sim`` run."""

    trace: str
    cluster: str
    model: str
    requests: int
    results: list[PolicyResult]
    wall_seconds: float
    #: ``--pd-ratio sweep``: one :func:`sweep_entry` per static split, else None.
    sweep: list[dict[str, object]] | None = None

    @property
    def sim_seconds(self) -> float:
        return max((r.sim_seconds for r in self.results), default=0.0)

    @property
    def speed_x_realtime(self) -> float:
        """Simulated seconds per wall-clock second, over all policy runs."""
        simulated = sum(r.sim_seconds for r in self.results)
        return simulated / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def rejected(self) -> int:
        """Requests that can never be served (the same in every run: admission is static)."""
        return max((r.rejected for r in self.results), default=0)

    @property
    def rejected_by_reason(self) -> dict[str, int]:
        worst = max(self.results, key=lambda r: r.rejected, default=None)
        return dict(sorted(worst.rejected_by_reason.items())) if worst is not None else {}

    def footer(self) -> str:
        """The lines after the table: request accounting, simulated span and speed."""
        served = min((r.completed for r in self.results), default=0)
        reasons = ", ".join(
            f"{n} {_REASON_TEXT.get(k, k)}" for k, n in self.rejected_by_reason.items() if n
        )
        why = f" (never servable: {reasons})" if reasons else ""
        return (
            f"{self.requests} requests, {self.sim_seconds:.0f} simulated s in "
            f"{self.wall_seconds:.2f} s wall ({self.speed_x_realtime:.0f}x real time); "
            "figures are simulated.\n"
            f"rejected: {self.rejected} of {self.requests} requests{why}; served: {served}"
        )

    def to_json(self) -> dict[str, object]:
        main = {r.label: r.summary() for r in self.results if r.pipelining}
        doc: dict[str, object] = {
            "requests": self.requests,
            "rejected": self.rejected,
            "sim_seconds": self.sim_seconds,
            "wall_seconds": self.wall_seconds,
            "speed_x_realtime": self.speed_x_realtime,
            "policies": main,
        }
        unpiped = {r.label: r.summary() for r in self.results if not r.pipelining}
        if unpiped and main:
            doc["policies_without_pipelining"] = unpiped
        elif unpiped:
            doc["policies"] = unpiped
        if self.sweep is not None:
            doc["sweep"] = self.sweep
            doc["best_static"] = best_static(self.sweep)
        return doc

    def sweep_text(self) -> str:
        """``--pd-ratio sweep`` in the table output: one line per static split."""
        lines = ["static splits (P:D instances):"]
        best = best_static(self.sweep or [])
        for e in self.sweep or []:
            mark = "  <- best static (lowest TTFT p99)" if e is best else ""
            lines.append(
                f"  {e['pd_ratio']:>6}  TTFT p50 {_ms(e['ttft_p50_ms'])}  p90 "
                f"{_ms(e['ttft_p90_ms'])}  p99 {_ms(e['ttft_p99_ms'])}  TPOT p50 "
                f"{_ms(e['tpot_p50_ms'])}{mark}"
            )
        return "\n".join(lines)

    def table(self) -> Table:
        table = Table(title=f"{self.model} on {self.cluster}: {self.trace}")
        for col in (*_COLUMNS, "goodput", "exposed xfer p50", "KV share of TTFT", "transports"):
            table.add_column(col, justify="left" if col in ("policy", "transports") else "right")
        for r in self.results:
            d = r.details()
            counts = d["count_by_transport"]
            assert isinstance(counts, dict)
            table.add_row(*_figures(r, d, " rps"), " ".join(f"{k}:{v}" for k, v in counts.items()))
        return table

    def write(self, directory: Path, top_links: int = 8) -> list[Path]:
        """Write ``ttft_cdf.png``, ``link_utilization.png``, ``summary.json``, ``index.html``,
        and ``adp_pools.png`` when a run had the Adaptive Decoder Pool on."""
        directory.mkdir(parents=True, exist_ok=True)
        written = [
            self._ttft_cdf(directory / "ttft_cdf.png"),
            self._utilization(directory / "link_utilization.png", top_links),
        ]
        adaptive = [r for r in self.results if r.adp]
        if adaptive:
            written.append(self._pools(directory / "adp_pools.png", adaptive))
        summary = directory / "summary.json"
        doc = self.to_json()
        doc["details"] = {
            f"{r.label}/{'pipe' if r.pipelining else 'nopipe'}": r.details() for r in self.results
        }
        summary.write_text(dumps(doc, indent=2), encoding="utf-8")
        written.append(summary)
        page = directory / "index.html"
        page.write_text(self._html(doc), encoding="utf-8")
        written.append(page)
        return written

    def _label(self, r: PolicyResult) -> str:
        return f"{r.label} ({'pipelined' if r.pipelining else 'not pipelined'})"

    def _ttft_cdf(self, path: Path) -> Path:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in self.results:
            values = np.sort(r.ttft_s) * 1e3
            if values.size:
                ax.plot(values, np.arange(1, values.size + 1) / values.size, label=self._label(r))
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"TTFT CDF: {self.model} on {self.cluster}")
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def _utilization(self, path: Path, top: int) -> Path:
        n = len(self.results)
        fig, axes = plt.subplots(n, 1, figsize=(8, 2.6 * n), squeeze=False, sharex=True)
        for ax, r in zip(axes[:, 0], self.results, strict=True):
            busiest = sorted(r.utilization, key=lambda s: -sum(s.utilization))[:top]
            for series in busiest:
                if not any(series.utilization):
                    continue
                t = np.arange(len(series.utilization)) * series.bin_s
                ax.plot(t, series.utilization, label=f"{series.link} ({series.kind})", lw=0.8)
            ax.set_ylim(0, 1.05)
            ax.set_ylabel("utilization")
            ax.set_title(f"busiest links: {self._label(r)}", fontsize=9)
            if ax.lines:
                ax.legend(fontsize=6, loc="upper right")
        axes[-1, 0].set_xlabel("simulated time (s)")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def _pools(self, path: Path, runs: list[PolicyResult]) -> Path:
        """Per ADP run: prefill workers and prefill queue depth over time, rushes shaded."""
        fig, axes = plt.subplots(len(runs), 1, figsize=(8, 2.8 * len(runs)), squeeze=False)
        for ax, r in zip(axes[:, 0], runs, strict=True):
            series = pool_series(r)
            ax.step(series["t"], series["prefill_workers"], where="post", color="C0")
            ax.set_ylabel("prefill workers", color="C0")
            depth = ax.twinx()
            depth.plot(series["t"], series["queue_depth"], color="C1", lw=0.8)
            depth.set_ylabel("prefill queue depth", color="C1")
            for start, end in rush_spans(r):
                ax.axvspan(start, end, color="C3", alpha=0.15, lw=0)
            ax.set_title(f"pools: {self._label(r)} (shaded: rush)", fontsize=9)
        axes[-1, 0].set_xlabel("simulated time (s)")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def _html(self, doc: dict[str, object]) -> str:
        rows = []
        for r in self.results:
            d = r.details()
            rows.append(
                "<tr>"
                + "".join(
                    f"<td>{html.escape(str(v))}</td>"
                    for v in (*_figures(r, d, ""), d["count_by_transport"])
                )
                + "</tr>"
            )
        head = "".join(
            f"<th>{h}</th>"
            for h in (
                *_COLUMNS,
                "goodput (rps)",
                "exposed transfer p50",
                "KV share of TTFT",
                "transfers",
            )
        )
        title = html.escape(f"TopKV simulation: {self.model} on {self.cluster}")
        return (
            f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>"
            "<style>body{font-family:sans-serif;margin:2em}td,th{padding:4px 8px;"
            "border-bottom:1px solid #ddd;text-align:right}</style></head><body>"
            f"<h1>{title}</h1><p>trace: {html.escape(self.trace)}; {self.requests} requests "
            f"({self.rejected} rejected: never servable); "
            f"{self.sim_seconds:.0f} simulated s in {self.wall_seconds:.2f} wall s "
            f"({self.speed_x_realtime:.0f}x real time). Simulated (emulated) figures, "
            "not measurements.</p>"
            f"<table><tr>{head}</tr>{''.join(rows)}</table>"
            "<h2>TTFT CDF</h2><img src='ttft_cdf.png'>"
            "<h2>Link utilization</h2><img src='link_utilization.png'>"
            + (
                "<h2>Adaptive Decoder Pool</h2><img src='adp_pools.png'>"
                if any(r.adp for r in self.results)
                else ""
            )
            + f"<h2>JSON</h2><pre>{html.escape(dumps(doc, indent=2))}</pre>"
            "</body></html>"
        )


def pool_series(r: PolicyResult) -> dict[str, list[float]]:
    """The pool plot's lines: time, prefill workers and prefill queue depth per ADP tick."""
    return {
        "t": [t for t, _, _ in r.pool_series],
        "prefill_workers": [float(n) for _, n, _ in r.pool_series],
        "queue_depth": [float(q) for _, _, q in r.pool_series],
    }


def rush_spans(r: PolicyResult) -> list[tuple[float, float]]:
    """The shaded rush periods, simulated seconds; a rush still on at the end of the
    run is shaded to its end."""
    return [(start, r.sim_seconds if end is None else end) for start, end in r.rush_periods]


def sweep_entry(pd_ratio: tuple[int, int], r: PolicyResult) -> dict[str, object]:
    """One static split of ``--pd-ratio sweep``: its ratio (as ``P:D`` instances) and
    TTFT/TPOT percentiles, plus the policy it ran under."""
    return {
        "pd_ratio": f"{pd_ratio[0]}:{pd_ratio[1]}",
        "policy": r.policy,
        "ttft_p50_ms": r.pct_ms(r.ttft_s, 50),
        "ttft_p90_ms": r.pct_ms(r.ttft_s, 90),
        "ttft_p99_ms": r.pct_ms(r.ttft_s, 99),
        "tpot_p50_ms": r.pct_ms(r.tpot_s, 50),
    }


def best_static(sweep: list[dict[str, object]]) -> dict[str, object] | None:
    """The sweep entry with the lowest ``ttft_p99_ms`` (the best split in hindsight);
    the first such entry on a tie, None when no entry has a TTFT."""
    scored = [e for e in sweep if isinstance(e.get("ttft_p99_ms"), float)]
    return min(scored, key=lambda e: float(e["ttft_p99_ms"]), default=None)  # type: ignore[arg-type]


_COLUMNS = ("policy", "pipelining", "TTFT p50", "TTFT p90", "TTFT p99", "TPOT p50", "E2E p50")


def _figures(r: PolicyResult, d: dict[str, object], rps: str) -> tuple[str, ...]:
    """One policy's row in the summary table and the HTML report (less the transports)."""
    return (
        r.label,
        "on" if r.pipelining else "off",
        _ms(d["ttft_p50_ms"]),
        _ms(d["ttft_p90_ms"]),
        _ms(d["ttft_p99_ms"]),
        _ms(d["tpot_p50_ms"]),
        _ms(d["e2e_p50_ms"]),
        f"{r.goodput_rps:.2f}{rps}",
        _ms(d["exposed_transfer_p50_ms"]),
        f"{r.kv_share_of_ttft:.1%}",
    )


def _ms(value: object) -> str:
    if not isinstance(value, float) or value != value:
        return "-"
    return f"{value:.1f} ms" if value >= 1 else f"{value * 1e3:.0f} us"
