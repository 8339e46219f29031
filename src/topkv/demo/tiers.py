"""KV memory tiers in the demo (``topkv demo --device-kv-capacity K``).

Each decode worker keeps at most K caches on its device tier (GPU memory where torch sees a
GPU, else host memory standing in for it, as the worker labels it) and demotes the least
soon needed ones, in the worker's order, to host DRAM, then an emulated CXL tier (the
paper's 150 ns / 64 GB/s, paced and labelled emulated, not dilated), then disk files in the
run's directory; a cache is promoted back before its decode. The lower tiers are sized to
hold a few of the demo model's caches (a 1,024-token cache is 4.7 MB), so a burst reaches
all of them. Each request then reports the tiers its KV visited, its promotion time and the
part of it decode waited for (``requests[].tiers``, ``promotion_ms``,
``exposed_promotion_ms``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from topkv.demo.measure import Percentiles
from topkv.demo.results import RequestResult
from topkv.service.tiers.config import TierConfig

#: Lower tiers of each decode worker: about two of the demo's largest caches each.
HOST_BYTES = 10 << 20
CXL_BYTES = 10 << 20
DISK_BYTES = 256 << 20


def demo_tiers(device_capacity: int, run_dir: Path) -> TierConfig:
    """The tier layout of the demo's decode workers (module docstring)."""
    return TierConfig(
        device_capacity=device_capacity,
        host_bytes=HOST_BYTES,
        cxl_bytes=CXL_BYTES,
        cxl="emulated",
        disk_bytes=DISK_BYTES,
        disk_dir=run_dir / "kv-tiers",
    )


def tiers_json(device_capacity: int, results: Sequence[RequestResult]) -> dict[str, Any]:
    """``summary.kv_tiers``: the capacity, how many requests' KV visited each tier, and
    promotion and exposed promotion percentiles (ms) over the completed requests."""
    ok = [r for r in results if r.error is None and r.tiers is not None]
    visited: Counter[str] = Counter()
    for r in ok:
        visited.update(set(r.tiers or ()))
    return {
        "device_capacity": device_capacity,
        "requests_demoted": sum(1 for r in ok if len(r.tiers or ()) > 1),
        "visited": dict(sorted(visited.items())),
        "promotion_ms": _pct([r.promotion_ms for r in ok]),
        "exposed_promotion_ms": _pct([r.exposed_promotion_ms for r in ok]),
    }


def tiers_text(kv: dict[str, Any]) -> str:
    """The tier line of the demo's text summary."""
    visited = ", ".join(f"{k} {v}" for k, v in kv["visited"].items()) or "none"
    return (
        f"KV tiers (device capacity {kv['device_capacity']} caches per decode worker): "
        f"{kv['requests_demoted']} requests demoted; visited: {visited}; promotion p50 "
        f"{kv['promotion_ms']['p50']:.2f} ms, exposed p50 {kv['exposed_promotion_ms']['p50']:.2f}"
        f" ms (p95 {kv['exposed_promotion_ms']['p95']:.2f} ms)"
    )


def _pct(values: Sequence[float | None]) -> dict[str, float]:
    return Percentiles.of([v for v in values if v is not None and math.isfinite(v)]).as_dict()
