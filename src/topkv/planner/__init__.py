"""Analytical planner: transfer cost per transport (Eq. 2), pipelined overlap (Eq. 3 and an
exact per-layer model), aggregate demand and link saturation, and ``build_plan``.

Everything here is pure (no I/O, no clock) so the selection policy, the orchestrator and
the simulator can share it.
"""

from topkv.planner.capacity import aggregate_demand_gbps, max_requests_per_s, speedup_vs
from topkv.planner.errors import PlannerInputError
from topkv.planner.pipeline import (
    PipelineResult,
    eq3_exposed_s,
    eq3_hidden_fraction,
    simulate_pipeline,
)
from topkv.planner.plan import Plan, TransportPlan, build_plan
from topkv.planner.transports import (
    DEFAULT_TRANSPORTS,
    GB,
    TransportSpec,
    transfer_time_s,
    wire_time_s,
)

__all__ = [
    "DEFAULT_TRANSPORTS",
    "GB",
    "PipelineResult",
    "Plan",
    "PlannerInputError",
    "TransportPlan",
    "TransportSpec",
    "aggregate_demand_gbps",
    "build_plan",
    "eq3_exposed_s",
    "eq3_hidden_fraction",
    "max_requests_per_s",
    "simulate_pipeline",
    "speedup_vs",
    "transfer_time_s",
    "wire_time_s",
]
