"""What a chaos run is told to do (:class:`ChaosConfig`), where its workers run
(:func:`placements`) and what it found (:class:`ChaosReport`).

The scenario itself is :func:`topkv.harness.chaos.run_chaos`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from topkv.errors import ConfigError
from topkv.relay.orchestrator_config import OrchestratorConfig, RetryPolicy
from topkv.service.cluster.local import WorkerPlacement
from topkv.service.worker.config import WorkerFaults
from topkv.transport.base import KVLayout

REPORT_KEYS = (
    "submitted",
    "delivered",
    "failed_clean",
    "lost",
    "corrupt_detected",
    "corrupt_delivered",
    "max_in_flight",
    "stranded_after",
    "rerouted",
)


@dataclass(frozen=True)
class ChaosConfig:
    """What to run and which faults to inject."""

    transfers: int = 2000
    mode: Literal["processes", "inprocess"] = "processes"
    size_bytes: int = 4 << 20
    corrupt_rate: float = 0.05
    kill_decoder_after: int | None = 500
    limit: int = 100
    prefill_workers: int = 2
    decode_workers: int = 3
    decode_capacity: int = 64
    layers: int = 8
    slow_link_gbps: float | None = 1.0
    seed: int = 0
    attempt_timeout_s: float = 30.0
    backoff_s: float = 0.01
    run_timeout_s: float = 600.0
    run_dir: Path | None = None  # processes: worker logs and ready files (default: temp)
    #: the admin token the cluster's workers accept and the run's executor sends (None:
    #: minted for the run; ``topkv chaos --token-file``)
    admin_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in ("processes", "inprocess"):
            raise ConfigError(f"--mode must be processes or inprocess, not {self.mode!r}")
        if self.transfers < 1:
            raise ConfigError("--transfers must be >= 1")
        if not 0.0 <= self.corrupt_rate <= 1.0:
            raise ConfigError(f"--corrupt-rate must be in [0, 1], got {self.corrupt_rate}")
        if self.limit < 1:
            raise ConfigError("--limit must be >= 1")
        if self.prefill_workers < 1 or self.decode_workers < 2:
            raise ConfigError("chaos needs >= 1 prefill and >= 2 decode workers")
        if self.layers < 1 or self.size_bytes < self.layers * 2:
            raise ConfigError(f"--size {self.size_bytes} is too small for {self.layers} layers")
        if self.kill_decoder_after is not None and self.kill_decoder_after < 0:
            raise ConfigError("--kill-decoder-after must be >= 0")

    def orchestrator_config(self) -> OrchestratorConfig:
        """The orchestrator's limits for this run (both modes)."""
        return OrchestratorConfig(
            max_in_flight=self.limit,
            queue_size=self.limit,
            retry=RetryPolicy(max_retries=2, backoff_s=self.backoff_s, max_reroutes=2),
            attempt_timeout_s=self.attempt_timeout_s,
            route_wait_s=30.0,
        )

    def worker_capacity(self) -> int:
        """KV caches each worker may hold (and decode slots each decode worker offers): the
        driver keeps up to twice the limit outstanding, all of them possibly on one worker."""
        return max(2 * self.limit, self.decode_capacity)

    def layout(self) -> KVLayout:
        """A KV layout of about ``size_bytes`` (K and V per layer, fp16, 8 heads x 128)."""
        per_token = 2 * 8 * 128 * 2  # K+V, 8 heads, head_dim 128, fp16
        seq_len = max(1, self.size_bytes // (self.layers * per_token))
        return KVLayout(self.layers, seq_len, 8, 128, "fp16")


def placements(config: ChaosConfig) -> list[WorkerPlacement]:
    """The chaos cluster (both modes): two nodes on one host, so same-node pairs use shm and
    cross-node pairs TCP. Every prefill worker flips bits at ``corrupt_rate`` (its own seed);
    the last one also paces every send to ``slow_link_gbps``."""
    found = []
    for i in range(config.prefill_workers):
        slowed = config.slow_link_gbps is not None and i == config.prefill_workers - 1
        faults = WorkerFaults(
            corrupt_rate=config.corrupt_rate,
            seed=config.seed * 1000 + i,
            slow_gbps=config.slow_link_gbps if slowed else None,
        )
        found.append(
            WorkerPlacement("prefill", f"chaos{i % 2}", i // 2, host_id="chaos", faults=faults)
        )
    for i in range(config.decode_workers):
        found.append(WorkerPlacement("decode", f"chaos{i % 2}", 4 + i // 2, host_id="chaos"))
    return found


@dataclass
class ChaosReport:
    """The accounting of one chaos run (``to_dict`` holds exactly :data:`REPORT_KEYS`)."""

    submitted: int = 0
    delivered: int = 0
    failed_clean: int = 0
    lost: int = 0
    corrupt_detected: int = 0
    corrupt_delivered: int = 0
    max_in_flight: int = 0
    stranded_after: int = 0
    rerouted: int = 0
    injected_corruptions: int = 0
    killed: str | None = None
    seconds: float = 0.0
    bytes_delivered: int = 0
    retries: int = 0
    failovers: int = 0
    by_medium: dict[str, int] = field(default_factory=dict)
    stranded_detail: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, int]:
        return {key: int(getattr(self, key)) for key in REPORT_KEYS}

    def problems(self, limit: int) -> list[str]:
        """Every correctness condition that does not hold (empty when the run is correct)."""
        found = []
        if self.lost:
            found.append(f"lost == {self.lost}")
        if self.corrupt_delivered:
            found.append(f"corrupt_delivered == {self.corrupt_delivered}")
        if self.stranded_after:
            found.append(f"stranded_after == {self.stranded_after} ({self.stranded_detail})")
        if self.max_in_flight > limit:
            found.append(f"max_in_flight {self.max_in_flight} > limit {limit}")
        if self.delivered + self.failed_clean != self.submitted:
            found.append(
                f"delivered + failed_clean = {self.delivered + self.failed_clean} "
                f"!= submitted {self.submitted}"
            )
        return found
