"""What a worker tells the registry about itself, and the events registries emit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from topkv.relay.expert_stats import ExpertReport

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
