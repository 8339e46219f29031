"""The Adaptive Decoder Pool in the demo (``topkv demo --adp on|both``).

:class:`DemoPool` runs the live pool of :mod:`topkv.relay.adp` on the demo's orchestrator.
The replay runs ``speedup`` times faster than the trace, so :func:`demo_adp_config` divides
the policy's windows, hold and least time between conversions by it (and multiplies the
queue-growth rate by it), as the tick (:data:`TRACE_TICK_S`). :class:`PairedRun` and
:func:`pair_orders` run ``--adp both --repeats R`` as alternating pairs; the ``adp_*`` and
``pairs_*`` functions report them. Why: docs/demo.md ("The Adaptive Decoder Pool in the demo").
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from topkv.demo.measure import quantile
from topkv.demo.results import RequestResult
from topkv.policy.adp.pool import DEFAULT_ADP, ADPConfig
from topkv.policy.clock import Clock
from topkv.relay.adp import LiveAdaptivePool, RoleSwitcher
from topkv.relay.orchestrator import Orchestrator

#: The simulator's ADP tick (``adp_tick_s``), in trace time.
TRACE_TICK_S = 1.0


def demo_adp_config(speedup: float, base: ADPConfig = DEFAULT_ADP) -> ADPConfig:
    """``base`` with its time constants in the demo's time (module docstring)."""
    return replace(
        base,
        velocity_window_s=base.velocity_window_s / speedup,
        baseline_window_s=base.baseline_window_s / speedup,
        queue_window_s=base.queue_window_s / speedup,
        queue_growth_per_s=base.queue_growth_per_s * speedup,
        ttft_window_s=base.ttft_window_s / speedup,
        hold_s=base.hold_s / speedup,
        convert_interval_s=base.convert_interval_s / speedup,
    )


class DemoPool:
    """The live pool on the demo's orchestrator, ticked from the demo's replay loop."""

    def __init__(
        self, orchestrator: Orchestrator, switcher: RoleSwitcher, speedup: float, clock: Clock
    ) -> None:
        self.clock = clock
        self.tick_s = TRACE_TICK_S / speedup
        self.live = LiveAdaptivePool(
            orchestrator,
            switcher,
            config=demo_adp_config(speedup),
            clock=clock,
            origin_s=clock.now(),
        )
        self._next_tick = clock.now()

    async def maybe_tick(self, queue_depth: int) -> None:
        """One pool update once a tick has passed since the last (plans start at once)."""
        now = self.clock.now()
        if now >= self._next_tick:
            self._next_tick = now + self.tick_s
            await self.live.tick(queue_depth)

    def prefill_workers(self) -> list[str]:
        """The workers that take new prefill work now, by id."""
        return sorted(w.worker_id for w in self.live.prefill_workers())

    def observe_arrival(self, prompt_tokens: int) -> None:
        self.live.observe_arrival(prompt_tokens)

    def observe_ttft(self, seconds: float) -> None:
        self.live.observe_ttft(seconds)

    async def close(self) -> dict[str, object]:
        """Stop, let conversions in progress finish, and give the ``"adp"`` JSON key:
        ``{"conversions": [{worker, from, to, at_ms, duration_ms}], "rush_periods":
        [[start_ms, end_ms], ...], "failed_conversions": [... "detail"]}`` (ms since the
        replay began; a failed conversion's ``duration_ms`` is null)."""
        await self.live.close()
        report = self.live.report()
        report["failed_conversions"] = [
            {**c.to_json(), "detail": c.detail} for c in self.live.conversions if not c.ok
        ]
        return report


def ttft_p90_ms(results: Sequence[RequestResult]) -> float | None:
    """TTFT p90 over the run's completed requests (ms), None without any."""
    ttfts = sorted(r.ttft_ms for r in results if r.error is None and math.isfinite(r.ttft_ms))
    return round(quantile(ttfts, 0.9), 3) if ttfts else None


def adp_json(
    report: dict[str, object],
    with_adp: Sequence[RequestResult],
    without: Sequence[RequestResult] | None = None,
) -> dict[str, Any]:
    """The ``"adp"`` key of ``topkv demo --adp on|both --json``: the pool's report plus the
    run's TTFT p90; with ``--adp both`` also the ADP-off run's p90 over the same requests
    and whether the ADP lowered it."""
    out: dict[str, Any] = {**report, "ttft_p90_ms": ttft_p90_ms(with_adp)}
    if without is not None:
        off, on = ttft_p90_ms(without), out["ttft_p90_ms"]
        out["without_adp"] = {"ttft_p90_ms": off}
        out["ttft_p90_lower_with_adp"] = off is not None and on is not None and on < off
    return out


def adp_text(adp: dict[str, Any]) -> str:
    """The ADP lines of the demo's text summary."""
    conversions = adp["conversions"]
    lines = [f"adaptive decoder pool: {len(conversions)} conversion(s)"]
    for c in conversions:
        lines.append(
            f"  {c['worker']}: {c['from']} -> {c['to']} at {c['at_ms']:.0f} ms, took "
            f"{c['duration_ms']:.1f} ms"
        )
    spans = ", ".join(f"{a:.0f}-{b:.0f} ms" for a, b in adp["rush_periods"]) or "none"
    lines.append(f"  rush periods: {spans}")
    p90 = adp["ttft_p90_ms"]
    line = f"  TTFT p90 with ADP: {p90:.0f} ms" if p90 is not None else "  TTFT p90: -"
    if "without_adp" in adp:
        off = adp["without_adp"]["ttft_p90_ms"]
        line += f"; without (same requests): {off:.0f} ms" if off is not None else ""
    lines.append(line)
    return "\n".join(lines)


@dataclass(frozen=True)
class PairedRun:
    """One timed run of an ADP comparison (``--adp both``): its place, pool and host."""

    pair: int  #: 0-based pair index
    adp: bool
    results: Sequence[RequestResult]
    report: dict[str, object] | None  #: the pool's report (ADP on), else None
    dilation: float
    kv_bytes_per_prefill_s: float  #: its warm-up's KV production rate (host speed)
    load: tuple[float, float]  #: 1-minute load average at its start and end
    #: ``summary.emulation.compute`` of the run (--compute paced: its turns and overruns)
    compute: dict[str, Any] | None = None


def pair_orders(repeats: int) -> list[tuple[bool, bool]]:
    """The ADP flag of each pair's two runs: off-on, on-off, off-on, ... (ABBA for 2)."""
    return [(False, True) if i % 2 == 0 else (True, False) for i in range(repeats)]


def _median(values: Sequence[float | None]) -> float | None:
    known = sorted(v for v in values if v is not None)
    return round(statistics.median(known), 3) if known else None


def pairs_json(runs: Sequence[PairedRun]) -> dict[str, Any]:
    """Every run of the comparison, the p90 medians over all pairs and by order, and
    whether the median with the pool is lower (the ``"pairs"`` part of ``"adp"``)."""

    def run_json(r: PairedRun) -> dict[str, Any]:
        out: dict[str, Any] = {
            "adp": r.adp,
            "ttft_p90_ms": ttft_p90_ms(r.results),
            "dilation": r.dilation,
            "kv_bytes_per_prefill_s": round(r.kv_bytes_per_prefill_s, 1),
            "load": list(r.load),
        }
        if r.report is not None:
            out["conversions"] = r.report["conversions"]
            out["rush_periods"] = r.report["rush_periods"]
        if r.compute is not None and r.compute.get("mode") == "paced":
            kept = ("pace", "turns", "overruns", "overrun_s", "busy_s", "overrun_share")
            out["compute"] = {k: r.compute[k] for k in kept}
        return out

    pairs = sorted({r.pair for r in runs})
    listed = []
    by_order: dict[str, dict[str, list[float | None]]] = {}
    for pair in pairs:
        these = [r for r in runs if r.pair == pair]
        order = "-".join("on" if r.adp else "off" for r in these)
        listed.append({"order": order, "runs": [run_json(r) for r in these]})
        side = by_order.setdefault(order, {"off": [], "on": []})
        for r in these:
            side["on" if r.adp else "off"].append(ttft_p90_ms(r.results))
    off = _median([ttft_p90_ms(r.results) for r in runs if not r.adp])
    on = _median([ttft_p90_ms(r.results) for r in runs if r.adp])
    return {
        "pairs": listed,
        "by_order": {
            order: {f"{k}_ttft_p90_ms": _median(v) for k, v in sides.items()}
            for order, sides in by_order.items()
        },
        "median": {"off_ttft_p90_ms": off, "on_ttft_p90_ms": on},
        "median_lower_with_adp": off is not None and on is not None and on < off,
    }


def pairs_text(pairs: dict[str, Any]) -> str:
    """The comparison's lines of the text summary (one per run, then the medians)."""

    def ms(v: float | None) -> str:
        return f"{v:.0f} ms" if v is not None else "-"

    lines = ["ADP off/on pairs (TTFT p90):"]
    for i, p in enumerate(pairs["pairs"]):
        cells = []
        for r in p["runs"]:
            conv = f", {len(r['conversions'])} conversion(s)" if "conversions" in r else ""
            if "compute" in r:
                conv += f", {r['compute']['overruns']}/{r['compute']['turns']} turns overran"
            cells.append(f"{'on' if r['adp'] else 'off'} {ms(r['ttft_p90_ms'])}{conv}")
        lines.append(f"  pair {i} ({p['order']}): " + "; ".join(cells))
    for order, m in pairs["by_order"].items():
        lines.append(
            f"  {order} median: off {ms(m['off_ttft_p90_ms'])}, on {ms(m['on_ttft_p90_ms'])}"
        )
    med = pairs["median"]
    lines.append(f"  median: off {ms(med['off_ttft_p90_ms'])}, on {ms(med['on_ttft_p90_ms'])}")
    return "\n".join(lines)
