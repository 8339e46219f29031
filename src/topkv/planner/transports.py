"""Transport cost model (paper Eq. 2) and the reference bandwidths from SPEC.md.

Bandwidths are one-direction, in decimal GB/s (1 GB = 1e9 bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from topkv.planner.errors import PlannerInputError

GB: Final = 1_000_000_000


@dataclass(frozen=True)
class TransportSpec:
    """A transport's achievable one-direction bandwidth and its per-transfer setup latency."""

    name: str
    bandwidth_gbps: float
    setup_latency_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth_gbps) and self.bandwidth_gbps > 0):
            raise PlannerInputError(
                f"transport {self.name!r}: bandwidth_gbps must be positive, "
                f"got {self.bandwidth_gbps!r}"
            )
        if not (math.isfinite(self.setup_latency_s) and self.setup_latency_s >= 0):
            raise PlannerInputError(
                f"transport {self.name!r}: setup_latency_s must be >= 0, "
                f"got {self.setup_latency_s!r}"
            )

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """Bandwidth in bytes per second."""
        return self.bandwidth_gbps * GB


#: SPEC.md defaults, fastest first: NVLink 4 (H100, 18 links), NVSwitch / NVLink 5 (NVL72),
#: PCIe Gen5 x16 practical, RDMA 400 Gb/s NDR with overhead, TCP 100 GbE with framing.
DEFAULT_TRANSPORTS: Final = MappingProxyType(
    {
        "nvlink": TransportSpec("nvlink", 450.0, 1e-6),
        "nvswitch": TransportSpec("nvswitch", 900.0, 1e-6),
        "pcie": TransportSpec("pcie", 50.0, 2e-6),
        "rdma": TransportSpec("rdma", 25.0, 5e-6),
        "tcp": TransportSpec("tcp", 10.0, 100e-6),
    }
)


def wire_time_s(nbytes: float, spec: TransportSpec) -> float:
    """Time the bytes themselves occupy the link, without setup latency."""
    _check_non_negative("nbytes", nbytes)
    return nbytes / spec.bandwidth_bytes_per_s


def transfer_time_s(nbytes: float, spec: TransportSpec, chunks: int = 1) -> float:
    """Paper Eq. 2 generalised to chunks: ``S / B_m + chunks * L_m``.

    The setup latency is paid once per chunk (connection use, registration, doorbell), so
    splitting a transfer into many small pieces makes slow-setup transports worse.
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise PlannerInputError(f"chunks must be a positive integer, got {chunks!r}")
    return wire_time_s(nbytes, spec) + chunks * spec.setup_latency_s


def _check_non_negative(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise PlannerInputError(f"{name} must be a finite number >= 0, got {value!r}")
