"""Nominal transport figures used when a pair view is built from facts alone.

These are the reference numbers of SPEC.md (one direction, GB/s; setup per chunk):
NVLink 4 450 GB/s < 1 us; NVSwitch / NVLink 5 900 GB/s ~1 us; PCIe Gen5 x16 50 GB/s ~2 us;
RDMA NDR 25 GB/s ~5 us; TCP 100 GbE 10 GB/s ~100 us.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NominalTransport:
    """A transport's nominal bandwidth (GB/s) and per-chunk setup latency (s)."""

    name: str
    bandwidth_gbps: float
    setup_latency_s: float


NOMINAL_TRANSPORTS: dict[str, NominalTransport] = {
    "nvlink": NominalTransport("nvlink", 450.0, 1e-6),
    "nvswitch": NominalTransport("nvswitch", 900.0, 1e-6),
    "pcie": NominalTransport("pcie", 50.0, 2e-6),
    "rdma": NominalTransport("rdma", 25.0, 5e-6),
    "tcp": NominalTransport("tcp", 10.0, 100e-6),
}
