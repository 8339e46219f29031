"""Aggregate bandwidth demand and link saturation (paper §5.4)."""

from __future__ import annotations

import math

from topkv.planner.errors import PlannerInputError
from topkv.planner.transports import GB, TransportSpec, transfer_time_s


def aggregate_demand_gbps(rate_rps: float, nbytes: float) -> float:
    """Aggregate transfer demand ``R * S`` in GB/s for ``rate_rps`` requests of ``nbytes``."""
    _check("rate_rps", rate_rps)
    _check("nbytes", nbytes)
    return rate_rps * nbytes / GB


def max_requests_per_s(spec: TransportSpec, nbytes: float) -> float:
    """Request rate at which one link of ``spec`` saturates: ``B / S`` (setup ignored,
    as setups of concurrent transfers overlap). ``inf`` for an empty cache."""
    _check("nbytes", nbytes)
    if nbytes == 0:
        return math.inf
    return spec.bandwidth_bytes_per_s / nbytes


def speedup_vs(
    nbytes: float, spec: TransportSpec, baseline: TransportSpec, chunks: int = 1
) -> float:
    """How many times faster ``spec`` moves ``nbytes`` than ``baseline`` (Eq. 2 times)."""
    mine = transfer_time_s(nbytes, spec, chunks)
    theirs = transfer_time_s(nbytes, baseline, chunks)
    if mine == 0:
        return 1.0 if theirs == 0 else math.inf
    return theirs / mine


def _check(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise PlannerInputError(f"{name} must be a finite number >= 0, got {value!r}")
