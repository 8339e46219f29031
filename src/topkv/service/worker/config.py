"""How a worker is configured: identity, registry, engine, media, and injected faults."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from topkv.errors import ConfigError
from topkv.relay.workers import Role, WorkerCapabilities
from topkv.service.compute.engines import EngineSpec
from topkv.service.http.auth import REQUIRED, Required, ServerAuth, chosen_auth
from topkv.service.http.tls import TLSConfig
from topkv.service.tiers.config import TierConfig

SECRET_ENV = "TOPKV_SECRET"
FAULTS_ENV = "TOPKV_FAULTS"


@dataclass(frozen=True)
class WorkerFaults:
    """Faults a worker injects into its own sends (``topkv chaos``); all off by default.

    ``corrupt_rate``: fraction of outgoing transfers that get one bit flipped in one frame
    after the frame's CRC-64 was computed, so the frame leaves with its original CRC.
    ``seed``: seeds which transfers, frames and bits. ``slow_gbps``: pace every send of this
    worker to a link of that many GB/s (a slowed link). Written as
    ``corrupt_rate=0.05,seed=3,slow_gbps=1.0`` in ``$TOPKV_FAULTS``.
    """

    corrupt_rate: float = 0.0
    seed: int = 0
    slow_gbps: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.corrupt_rate <= 1.0:
            raise ConfigError(f"fault corrupt_rate must be in [0, 1], got {self.corrupt_rate}")
        if self.slow_gbps is not None and not self.slow_gbps > 0:
            raise ConfigError(f"fault slow_gbps must be > 0, got {self.slow_gbps}")

    @property
    def active(self) -> bool:
        return self.corrupt_rate > 0 or self.slow_gbps is not None

    def to_text(self) -> str:
        parts = [f"corrupt_rate={self.corrupt_rate!r}", f"seed={self.seed}"]
        if self.slow_gbps is not None:
            parts.append(f"slow_gbps={self.slow_gbps!r}")
        return ",".join(parts)

    @classmethod
    def parse(cls, text: str) -> WorkerFaults:
        """Read ``key=value,...`` (keys: corrupt_rate, seed, slow_gbps); empty means none."""
        values: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key not in ("corrupt_rate", "seed", "slow_gbps"):
                raise ConfigError(
                    f"{FAULTS_ENV}: {item!r} is not one of corrupt_rate=P, seed=N, slow_gbps=X"
                )
            values[key] = value.strip()
        try:
            return cls(
                corrupt_rate=float(values.get("corrupt_rate", "0")),
                seed=int(values.get("seed", "0")),
                slow_gbps=float(values["slow_gbps"]) if "slow_gbps" in values else None,
            )
        except ValueError as exc:
            raise ConfigError(f"{FAULTS_ENV}={text!r}: {exc}") from None

    @classmethod
    def from_env(cls) -> WorkerFaults:
        return cls.parse(os.environ.get(FAULTS_ENV, ""))


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker process needs to start."""

    role: Role
    node: str
    secret: bytes
    gpus: tuple[int, ...] = (0,)
    worker_id: str = ""
    host_id: str = ""
    orchestrator_url: str = ""
    registry_url: str = ""
    bind_host: str = "127.0.0.1"
    advertise_host: str = ""
    control_port: int = 0
    capacity: int = 8
    ttl_s: float = 10.0
    nvlink_domain: str | None = None
    capabilities: WorkerCapabilities = field(default_factory=WorkerCapabilities)
    ready_file: Path | None = None
    faults: WorkerFaults = field(default_factory=WorkerFaults.from_env)
    #: The engine it hosts, with its compute pace (``--compute-pace C``: every engine turn
    #: held to C x its CPU time, :mod:`topkv.service.compute.pace`; None: real compute).
    engine: EngineSpec = field(default_factory=EngineSpec)
    #: Real media to offer (see :mod:`topkv.service.worker.media`); None: every one
    #: installed here (shm only when ``capabilities.shm``).
    media: tuple[str, ...] | None = None
    #: The tokens its control API accepts (the orchestrator's admin token, or its digest)
    #: and its own worker token (to register over HTTP); None: no authentication, on
    #: purpose (``--insecure-no-auth``). No default: nothing runs open by omission.
    auth: ServerAuth | Required | None = REQUIRED
    #: HTTPS for its control API (``--tls-cert``/``--tls-key``) and the CA it verifies the
    #: orchestrator with (``--tls-ca``); None: plain HTTP, the system's trust store.
    tls: TLSConfig | None = None
    #: KV memory tiers (``--device-kv-capacity K``): at most K caches on the device, the
    #: rest demoted to host / CXL / disk and prefetched back; None: no tiers.
    tiers: TierConfig | None = None

    def __post_init__(self) -> None:
        chosen_auth(
            self.auth,
            "a worker needs auth=ServerAuth(...) (the control token it accepts, its worker token)",
        )

    @property
    def server_auth(self) -> ServerAuth | None:
        assert not isinstance(self.auth, Required)
        return self.auth

    def resolved_worker_id(self) -> str:
        gpus = "-".join(str(g) for g in self.gpus) or "cpu"
        return self.worker_id or f"{self.role}-{self.node}-gpu{gpus}"

    def resolved_host_id(self) -> str:
        return self.host_id or socket.gethostname()

    def resolved_advertise_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        if self.bind_host in ("0.0.0.0", "::", ""):
            return socket.gethostname()
        return self.bind_host
