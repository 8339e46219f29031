"""The ``topkv worker`` flags of the KV memory tiers (``--device-kv-capacity K`` and the
sizes of the tiers below it); see ``docs/tiers.md``."""

from __future__ import annotations

from pathlib import Path

import typer

from topkv.cli.select import parse_byte_size
from topkv.service.tiers.config import TierConfig

CAPACITY_HELP = (
    "KV caches kept on the device tier; beyond it idle ones are demoted to host / CXL / "
    "disk and prefetched back (0: no tiers)"
)
DEVICE_TIER_HELP = (
    "where the K device caches are: auto (GPU memory when torch sees a GPU, else host "
    "memory standing in for it, labelled so) | gpu (required) | host-stand-in"
)
CXL_HELP = (
    "auto: a CPU-less NUMA node if there is one, else emulated (150 ns, 64 GB/s, paced and "
    "labelled) | emulated | off"
)


def device_kv_capacity_option() -> int:
    return typer.Option(0, "--device-kv-capacity", help=CAPACITY_HELP)  # type: ignore[no-any-return]


def kv_host_bytes_option() -> str:
    return typer.Option("256MiB", "--kv-host-bytes", help="host DRAM tier size")  # type: ignore[no-any-return]


def kv_cxl_bytes_option() -> str:
    return typer.Option("0", "--kv-cxl-bytes", help="CXL tier size (0: none)")  # type: ignore[no-any-return]


def kv_cxl_option() -> str:
    return typer.Option("auto", "--kv-cxl", help=CXL_HELP)  # type: ignore[no-any-return]


def kv_cxl_dilation_option() -> float:
    return typer.Option(1.0, "--kv-cxl-dilation", help="emulated CXL time dilation")  # type: ignore[no-any-return]


def kv_disk_bytes_option() -> str:
    return typer.Option("0", "--kv-disk-bytes", help="disk tier size (0: none)")  # type: ignore[no-any-return]


def device_tier_option() -> str:
    return typer.Option("auto", "--device-tier", help=DEVICE_TIER_HELP)  # type: ignore[no-any-return]


def kv_device_bytes_option() -> str:
    return typer.Option("256MiB", "--kv-device-bytes", help="GPU device tier arena size")  # type: ignore[no-any-return]


def kv_tier_dir_option() -> Path | None:
    return typer.Option(None, "--kv-tier-dir", help="the disk tier's directory")  # type: ignore[no-any-return]


def tier_config(
    device_kv_capacity: int,
    host: str,
    cxl_bytes: str,
    cxl: str,
    cxl_dilation: float,
    disk_bytes: str,
    tier_dir: Path | None,
    device_tier: str = "auto",
    device_bytes: str = "256MiB",
) -> TierConfig | None:
    """The worker's :class:`TierConfig` from its flags (None without --device-kv-capacity)."""
    if device_kv_capacity == 0:
        return None
    return TierConfig(
        device_capacity=device_kv_capacity,
        host_bytes=parse_byte_size(host),
        cxl_bytes=parse_byte_size(cxl_bytes),
        cxl=cxl,
        cxl_dilation=cxl_dilation,
        disk_bytes=parse_byte_size(disk_bytes),
        disk_dir=tier_dir,
        device_tier=device_tier,
        device_bytes=parse_byte_size(device_bytes),
    )
