"""A worker's KV tier configuration, checked against this host and turned into tier stores.

``topkv worker --device-kv-capacity K`` turns the tiers on: at most K KV caches stay in the
device tier; the rest are demoted to host DRAM, CXL (a CPU-less NUMA node, or an emulated
one) and the disk directory, each bounded by its configured bytes. At start the sizes are
checked against what :func:`topkv.topology.tiers.discover_tier_inventory` found: a tier
that asks for more than exists is refused with both numbers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from topkv.errors import ConfigError
from topkv.policy.tiers import PAPER_TIERS, TierSpec
from topkv.service.tiers.arena import Arena
from topkv.service.tiers.stores import DiskTierStore, MemoryTierStore, TierStore, check_directory
from topkv.topology.tiers import TierInventory

#: Measured host memcpy of a modest server; the host tier's nominal figure until measured.
HOST_GBPS = 10.0
#: A disk tier's nominal figure until measured (a SATA SSD; NVMe is faster).
DISK_GBPS = 1.0


@dataclass(frozen=True)
class TierConfig:
    """What a worker asks of its KV tiers (bytes; 0 turns a tier off).

    ``cxl``: ``"auto"`` uses the first CPU-less NUMA node if the host has one, else an
    emulated tier (the paper's 150 ns / 64 GB/s, paced, labelled emulated); ``"emulated"``
    always emulates; ``"off"`` has none. ``cxl_dilation`` stretches the emulated tier's
    time like the emulated links' dilation. ``device_tier``: ``"auto"`` holds the K device
    caches in GPU memory where torch sees a GPU (an arena of ``device_bytes``), else in host
    memory standing in for it; ``"gpu"`` requires the GPU; ``"host-stand-in"`` never uses
    it (:mod:`topkv.service.tiers.device`).
    """

    device_capacity: int
    host_bytes: int = 256 << 20
    cxl_bytes: int = 0
    cxl: str = "auto"
    cxl_dilation: float = 1.0
    disk_bytes: int = 0
    disk_dir: Path | None = None
    lookahead_s: float = 0.05
    device_tier: str = "auto"
    device_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if self.device_capacity < 1:
            raise ConfigError(
                f"--device-kv-capacity must be at least 1 KV cache, got {self.device_capacity}"
            )
        for name in ("host_bytes", "cxl_bytes", "disk_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"KV tiers: {name} must be >= 0, got {getattr(self, name)}")
        if self.cxl not in ("auto", "emulated", "off"):
            raise ConfigError(f"KV tiers: cxl must be auto, emulated or off, got {self.cxl!r}")
        if self.device_tier not in ("auto", "gpu", "host-stand-in"):
            raise ConfigError(
                f"--device-tier must be auto, gpu or host-stand-in, not {self.device_tier!r}"
            )
        if self.device_bytes < 1:
            raise ConfigError(f"KV tiers: device_bytes must be >= 1, got {self.device_bytes}")
        if not self.cxl_dilation >= 1.0:
            raise ConfigError(f"KV tiers: cxl dilation must be >= 1, got {self.cxl_dilation}")
        if self.disk_bytes and self.disk_dir is None:
            raise ConfigError("KV tiers: a disk tier of bytes needs a directory (--kv-tier-dir)")
        if self.host_bytes + self.cxl_bytes + self.disk_bytes == 0:
            raise ConfigError(
                "KV tiers: every tier below the device is 0 bytes; give --kv-host-bytes, "
                "--kv-cxl-bytes or --kv-disk-bytes"
            )

    def cli_args(self) -> list[str]:
        """The ``topkv worker`` flags that give this configuration."""
        args = [
            "--device-kv-capacity", str(self.device_capacity),
            "--kv-host-bytes", str(self.host_bytes),
            "--kv-cxl-bytes", str(self.cxl_bytes),
            "--kv-cxl", self.cxl,
            "--kv-cxl-dilation", repr(self.cxl_dilation),
            "--kv-disk-bytes", str(self.disk_bytes),
            "--device-tier", self.device_tier,
            "--kv-device-bytes", str(self.device_bytes),
        ]  # fmt: skip
        return args + (["--kv-tier-dir", str(self.disk_dir)] if self.disk_dir else [])


def _gib(n: int) -> str:
    if n < 1 << 30:
        return f"{n / (1 << 20):.1f} MiB ({n:,} bytes)"
    return f"{n / (1 << 30):.2f} GiB ({n:,} bytes)"


def build_tier_stores(config: TierConfig, inventory: TierInventory) -> list[TierStore]:
    """The lower tiers, fastest first; refuses sizes the host cannot give, with numbers."""
    stores: list[TierStore] = []
    cxl_nodes = inventory.cxl_nodes
    node = cxl_nodes[0] if cxl_nodes and config.cxl == "auto" else None
    emulated_cxl = config.cxl_bytes if node is None and config.cxl != "off" else 0
    host_need = config.host_bytes + emulated_cxl
    if host_need > inventory.host_available_bytes:
        raise ConfigError(
            f"KV tiers ask for {_gib(host_need)} of host memory (host tier"
            f"{' + emulated CXL' if emulated_cxl else ''}); "
            f"this host has {_gib(inventory.host_available_bytes)} available of "
            f"{_gib(inventory.host_total_bytes)}"
        )
    if node is not None and config.cxl_bytes > (node.free_bytes or node.total_bytes):
        raise ConfigError(
            f"KV tiers ask for {_gib(config.cxl_bytes)} of CXL; NUMA node "
            f"{node.node_id} has {_gib(node.free_bytes or node.total_bytes)} free"
        )
    if config.disk_bytes:  # checked before any arena is made
        assert config.disk_dir is not None
        check_directory(config.disk_dir)
        stat = os.statvfs(config.disk_dir)
        if config.disk_bytes > stat.f_bavail * stat.f_frsize:
            raise ConfigError(
                f"KV tiers ask for {_gib(config.disk_bytes)} of disk in {config.disk_dir}; "
                f"its filesystem has {_gib(stat.f_bavail * stat.f_frsize)} free"
            )
    if config.host_bytes:
        spec = TierSpec("host", "host", config.host_bytes, 100e-9, HOST_GBPS, backing="host DRAM")
        stores.append(MemoryTierStore(spec, Arena(config.host_bytes)))
    if config.cxl_bytes and config.cxl != "off":
        numa = None if node is None else node.node_id
        arena = Arena(config.cxl_bytes, numa_node=numa)
        emulated = f"emulated: host memory paced to 150 ns, 64 GB/s x{config.cxl_dilation:g}"
        spec = replace(
            PAPER_TIERS["cxl"],
            capacity_bytes=config.cxl_bytes,
            emulated=node is None,
            backing=emulated if node is None else arena.placement,
            numa=numa,
        )
        stores.append(MemoryTierStore(spec, arena, dilation=config.cxl_dilation))
    if config.disk_bytes:
        assert config.disk_dir is not None
        spec = TierSpec("disk", "disk", config.disk_bytes, 20e-6, DISK_GBPS)
        disk = DiskTierStore(spec, config.disk_dir)
        stores.append(disk)
    return stores
