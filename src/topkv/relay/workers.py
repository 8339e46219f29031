"""What a worker tells the registry about itself (its record, with the expert report of a
worker serving an MoE engine), and the events registries emit.

The expert report rides in the record (``experts``), so it reaches every registry backend the
way the record does. Every figure is bounded: a hostile or broken worker is refused with the
field named (pydantic's ``loc``, e.g. ``experts.stats.3.queue_depth``) instead of steering
routing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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


Role = Literal["prefill", "decode"]


class WorkerCapabilities(BaseModel):
    """Transfer media a worker can use (the selection policy reads these)."""

    model_config = ConfigDict(frozen=True)

    nvlink: bool = False
    nvswitch: bool = False
    rdma: bool = False
    tcp: bool = True
    shm: bool = True
    media: tuple[str, ...] = Field(
        default=(),
        description="real media the worker serves (tcp, shm, nixl, mooncake, cuda); empty: "
        "tcp and, with shm, shm",
    )


class WorkerInfo(BaseModel):
    """A worker's registration record, serialised as JSON in every registry backend."""

    model_config = ConfigDict(frozen=True)

    worker_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    role: Role
    node: str = Field(min_length=1)
    host_id: str = Field(
        default="",
        description="Identity of the OS host/namespace; equal host_id means shm is possible.",
    )
    gpus: tuple[int, ...] = ()
    nvlink_domain: str | None = None
    capabilities: WorkerCapabilities = WorkerCapabilities()
    capacity: int = Field(default=8, ge=0, description="KV caches the worker can hold at once")
    address: str = Field(default="", description="host:port of the worker's transfer endpoint")
    control_url: str = Field(default="", description="HTTP base URL of the worker's control API")
    sink_addresses: tuple[str, ...] = Field(
        default=(),
        description="addresses of the worker's other standing sinks, one per medium, named "
        "by their scheme (a vLLM decode's nixl://host:port); empty: none",
    )
    experts: ExpertReport | None = Field(
        default=None, description="an MoE engine's expert statistics, renewed each heartbeat"
    )

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerInfo:
        return cls.model_validate_json(text)


@dataclass(frozen=True)
class RegistryEvent:
    """A worker joined, updated its record, or left (deregistered or its lease expired)."""

    kind: Literal["join", "update", "leave"]
    worker_id: str
    info: WorkerInfo | None
