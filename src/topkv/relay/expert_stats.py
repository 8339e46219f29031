"""What a worker serving an MoE engine reports about its experts (in its registration).

The report rides in the worker's :class:`~topkv.relay.workers.WorkerInfo` (``experts``),
so it reaches every registry backend the way the record does: the worker replaces its
record at each heartbeat (``update``: same lease in memory and etcd, a re-registration
over HTTP), and an orchestrator that restarts reads it back from etcd with the record.

Every figure is bounded: a hostile or broken worker (a negative rate, NaN, a queue of a
billion) is refused with the field named (pydantic's ``loc``, e.g.
``experts.stats.3.queue_depth``) instead of steering routing.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

#: The most expert entries one worker may report (layers x experts it hosts).
MAX_EXPERT_ENTRIES = 16_384
#: The largest expert id (and layer) a report may name.
MAX_EXPERT_ID = 65_535
MAX_LAYER = 4096
#: The deepest queue a report may claim: far beyond any real engine's look-ahead.
MAX_QUEUE_DEPTH = 1_000_000


class ExpertStat(BaseModel):
    """One hosted expert of one layer, as its host measures it (EMAs): activations per
    second, compute seconds per routed token, the dispatch round trip, batches queued."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    layer: int = Field(ge=0, le=MAX_LAYER)
    expert: int = Field(ge=0, le=MAX_EXPERT_ID)
    rate: float = Field(ge=0, le=1e12, description="activations per second (EMA)")
    compute_s: float = Field(ge=0, le=3600, description="seconds per routed token (EMA)")
    network_s: float = Field(default=0.0, ge=0, le=3600, description="dispatch round trip")
    queue_depth: int = Field(default=0, ge=0, le=MAX_QUEUE_DEPTH)
    healthy: bool = True


class ExpertReport(BaseModel):
    """A worker's expert statistics at one heartbeat.

    ``sequence`` grows by one per report: a record replaced for another reason (a role
    change) carries the same report and does not make it fresher. ``experts_per_token``,
    ``moe_layers`` and ``hidden_size`` describe the model, for the dispatch estimate.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    sequence: int = Field(ge=0, lt=2**63)
    experts_per_token: int = Field(ge=1, le=1024)
    moe_layers: int = Field(ge=1, le=4096)
    hidden_size: int = Field(ge=1, le=1 << 20)
    stats: tuple[ExpertStat, ...] = Field(default=(), max_length=MAX_EXPERT_ENTRIES)
