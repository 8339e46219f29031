"""The outcome of one simulated run: per-request metrics, pool sizes, JSON summaries."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from topkv.sim.links import UtilizationSeries


@dataclass
class PolicyResult:
    """Outcome of one policy's run."""

    policy: str
    pipelining: bool
    completed: int
    rejected: int
    sim_seconds: float
    wall_seconds: float
    events: int
    ttft_s: np.ndarray
    tpot_s: np.ndarray
    e2e_s: np.ndarray
    exposed_transfer_s: np.ndarray
    transfer_s: np.ndarray
    prefill_wait_s: np.ndarray
    prefill_s: np.ndarray
    good: int
    bytes_by_transport: dict[str, int]
    count_by_transport: dict[str, int]
    utilization: list[UtilizationSeries] = field(default_factory=list)
    #: Rejected requests by reason code (:data:`topkv.policy.admission.REJECTION_REASONS`).
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    #: Whether the Adaptive Decoder Pool ran (the JSON key is then ``policy+adp``).
    adp: bool = False
    #: Role changes of decode workers (to prefill and back, each counted once).
    conversions: int = 0
    #: Fewest and most workers serving prefill at any time of the run.
    prefill_workers_min: int = 0
    prefill_workers_max: int = 0
    #: ``(t, prefill workers, prefill queue depth)`` at each ADP update (empty without).
    pool_series: list[tuple[float, int, int]] = field(default_factory=list)
    #: ``(start, end)`` of each rush the ADP detected, simulated seconds.
    rush_periods: list[tuple[float, float | None]] = field(default_factory=list)

    @property
    def label(self) -> str:
        """The key of this run in ``policies``: the policy, ``+adp`` with the ADP on."""
        return f"{self.policy}+adp" if self.adp else self.policy

    def pct(self, values: np.ndarray, q: float) -> float:
        """The ``q``-th percentile; NaN over no values (the JSON outputs use :meth:`pct_ms`)."""
        return float(np.percentile(values, q)) if values.size else math.nan

    def pct_ms(self, values: np.ndarray, q: float) -> float | None:
        """The ``q``-th percentile in ms; None (JSON ``null``) over no values."""
        return float(np.percentile(values, q)) * 1e3 if values.size else None

    @property
    def goodput_rps(self) -> float:
        return self.good / self.sim_seconds if self.sim_seconds > 0 else 0.0

    @property
    def kv_share_of_ttft(self) -> float:
        """Mean exposed transfer time over mean TTFT."""
        if not self.ttft_s.size or self.ttft_s.mean() <= 0:
            return 0.0
        return float(self.exposed_transfer_s.mean() / self.ttft_s.mean())

    def summary(self) -> dict[str, object]:
        """The per-policy keys of ``topkv sim --json``."""
        return {
            "ttft_p50_ms": self.pct_ms(self.ttft_s, 50),
            "ttft_p99_ms": self.pct_ms(self.ttft_s, 99),
            "tpot_p50_ms": self.pct_ms(self.tpot_s, 50),
            "goodput_rps": self.goodput_rps,
            "transfer_ms_p50": self.pct_ms(self.exposed_transfer_s, 50),
            "bytes_by_transport": dict(sorted(self.bytes_by_transport.items())),
            "rejected": self.rejected,
            "ttft_p90_ms": self.pct_ms(self.ttft_s, 90),
            "conversions": self.conversions,
            "prefill_workers_max": self.prefill_workers_max,
            "prefill_workers_min": self.prefill_workers_min,
        }

    def details(self) -> dict[str, object]:
        """Everything else a report shows (p90s, E2E, counts, KV share of TTFT)."""
        out: dict[str, object] = {}
        for name, arr in (
            ("ttft", self.ttft_s),
            ("tpot", self.tpot_s),
            ("e2e", self.e2e_s),
            ("exposed_transfer", self.exposed_transfer_s),
            ("transfer", self.transfer_s),
            ("prefill_queue", self.prefill_wait_s),
        ):
            for q in (50, 90, 99):
                out[f"{name}_p{q}_ms"] = self.pct_ms(arr, q)
        out["kv_share_of_ttft"] = self.kv_share_of_ttft
        out["count_by_transport"] = dict(sorted(self.count_by_transport.items()))
        out["completed"] = self.completed
        out["rejected"] = self.rejected
        out["rejected_by_reason"] = dict(sorted(self.rejected_by_reason.items()))
        out["events"] = self.events
        return out
