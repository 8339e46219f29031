"""A per-transport transfer plan for one model and sequence length (``topkv plan``)."""

from __future__ import annotations

import math
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict

from topkv.kv import ModelSpec
from topkv.planner.capacity import aggregate_demand_gbps, max_requests_per_s, speedup_vs
from topkv.planner.errors import PlannerInputError
from topkv.planner.pipeline import simulate_pipeline
from topkv.planner.transports import (
    DEFAULT_TRANSPORTS,
    TransportSpec,
    transfer_time_s,
    wire_time_s,
)


class TransportPlan(BaseModel):
    """Figures for one transport. ``transfer_ms`` is Eq. 2 for the whole cache in one
    chunk; ``pipelined_exposed_ms`` and ``hidden_fraction`` come from the exact per-layer
    pipeline model (one chunk and one setup per layer that holds KV)."""

    model_config = ConfigDict(frozen=True)

    bandwidth_gbps: float
    transfer_ms: float
    pipelined_exposed_ms: float
    hidden_fraction: float
    max_requests_per_s: float
    speedup_vs_rdma: float


class Plan(BaseModel):
    """Plan for one model/sequence; :meth:`to_json_dict` is the ``--json`` document."""

    model_config = ConfigDict(frozen=True)

    model: str
    seq_len: int
    dtype: str
    kv_bytes: int
    transports: dict[str, TransportPlan]
    aggregate_demand_gbps: float

    def to_json_dict(self) -> dict[str, object]:
        """The JSON object of ``topkv plan --json`` (keys as in issue #2)."""
        return self.model_dump(mode="json")


def build_plan(
    model: ModelSpec,
    seq_len: int,
    dtype: str = "fp16",
    rate_rps: float = 100.0,
    layer_compute_ms: float = 0.5,
    transports: Mapping[str, TransportSpec] = DEFAULT_TRANSPORTS,
) -> Plan:
    """Size ``model``'s KV cache and cost moving it over each transport.

    Every layer is assumed to take ``layer_compute_ms`` of prefill compute (the paper's
    0.5 ms for Llama-3-70B at batch 1). Linear-attention state (hybrid models) is not part
    of ``kv_bytes``; see :meth:`ModelSpec.linear_state_bytes`.
    """
    if "rdma" not in transports:
        raise PlannerInputError(
            f"speedups are relative to 'rdma', which is not among {sorted(transports)}"
        )
    if not (math.isfinite(layer_compute_ms) and layer_compute_ms >= 0):
        raise PlannerInputError(f"layer_compute_ms must be >= 0, got {layer_compute_ms!r}")
    per_layer_bytes = model.kv_bytes_per_layer(seq_len, dtype)
    kv_bytes = sum(per_layer_bytes)
    compute = [layer_compute_ms / 1e3] * model.num_layers
    rows: dict[str, TransportPlan] = {}
    for name, spec in transports.items():
        # one chunk per layer that holds KV; linear-attention layers send nothing
        pipeline = simulate_pipeline(
            compute,
            [wire_time_s(b, spec) + spec.setup_latency_s if b else 0.0 for b in per_layer_bytes],
        )
        rows[name] = TransportPlan(
            bandwidth_gbps=spec.bandwidth_gbps,
            transfer_ms=transfer_time_s(kv_bytes, spec) * 1e3,
            pipelined_exposed_ms=pipeline.exposed_s * 1e3,
            hidden_fraction=pipeline.hidden_fraction,
            max_requests_per_s=max_requests_per_s(spec, kv_bytes),
            speedup_vs_rdma=speedup_vs(kv_bytes, spec, transports["rdma"]),
        )
    return Plan(
        model=model.name,
        seq_len=seq_len,
        dtype=dtype.strip().lower(),
        kv_bytes=kv_bytes,
        transports=rows,
        aggregate_demand_gbps=aggregate_demand_gbps(rate_rps, kv_bytes),
    )
