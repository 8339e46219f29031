"""The orchestrator's limits, timeouts and retry policy (:class:`OrchestratorConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from topkv.errors import ConfigError
from topkv.policy.moe.router import STRATEGIES as MOE_STRATEGIES


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try before giving up on one request.

    ``max_retries`` retries of the same (destination, transport) after a checksum failure
    or a timeout, waiting ``backoff_s * backoff_factor**(n-1)`` before retry ``n``; then
    the next transport. ``max_reroutes`` other decode workers after a destination died (or
    every transport to it failed).
    """

    max_retries: int = 2
    backoff_s: float = 0.1
    backoff_factor: float = 2.0
    max_reroutes: int = 2

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.max_reroutes < 0:
            raise ConfigError("max_retries and max_reroutes must be >= 0")
        if self.backoff_s < 0 or self.backoff_factor < 1:
            raise ConfigError("backoff_s must be >= 0 and backoff_factor >= 1")

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1-based)."""
        return self.backoff_s * self.backoff_factor ** (retry - 1)


@dataclass(frozen=True)
class OrchestratorConfig:
    """Limits and timeouts. Every wait the orchestrator does is bounded by one of these."""

    max_in_flight: int = 100
    queue_size: int = 1000
    completion_queue_size: int = 1000
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    attempt_timeout_s: float = 30.0
    cancel_grace_s: float = 5.0
    executor_call_timeout_s: float = 10.0
    route_wait_s: float = 5.0
    submit_timeout_s: float = 30.0
    completion_put_timeout_s: float = 30.0
    on_exhausted: Literal["fail", "recompute"] = "fail"
    chunks_per_layer: int = 1
    history: int = 10_000
    #: The MoE router's strategy when decode workers report experts (docs/moe.md).
    moe_router: str = "cost"

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.queue_size < 1 or self.completion_queue_size < 1:
            raise ConfigError("queue sizes must be >= 1")
        if self.on_exhausted not in ("fail", "recompute"):
            raise ConfigError(
                f"on_exhausted must be 'fail' or 'recompute', not {self.on_exhausted!r}"
            )
        timeouts = (
            self.attempt_timeout_s,
            self.cancel_grace_s,
            self.executor_call_timeout_s,
            self.route_wait_s,
            self.submit_timeout_s,
            self.completion_put_timeout_s,
        )
        if any(not t > 0 for t in timeouts):
            raise ConfigError("every timeout must be > 0 s")
        if self.chunks_per_layer < 1:
            raise ConfigError("chunks_per_layer must be >= 1")
        if self.moe_router not in MOE_STRATEGIES:
            raise ConfigError(
                f"moe_router {self.moe_router!r}: use one of {', '.join(MOE_STRATEGIES)}"
            )
