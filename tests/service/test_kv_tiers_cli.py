"""``topkv worker`` KV tier flags: refused at start with the numbers, and the flags a
cluster placement hands its worker parse back to the same configuration."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from topkv.cli.options.tiers import tier_config
from topkv.service.tiers.config import TierConfig

TOPKV = [sys.executable, "-c", "from topkv.cli.main import app; app()"]
BASE = ["worker", "--role", "decode", "--insecure-no-auth", "--orchestrator",
        "http://127.0.0.1:9"]  # fmt: skip


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TOPKV_SECRET": "tiers-cli-secret"}
    return subprocess.run(
        [*TOPKV, *BASE, *args], capture_output=True, text=True, timeout=120, env=env, check=False
    )


def test_more_memory_than_exists_is_refused_with_the_numbers() -> None:
    got = _run("--device-kv-capacity", "2", "--kv-host-bytes", "64TiB")
    assert got.returncode == 2, got.stderr
    assert "KV tiers ask for 65536.00 GiB" in got.stderr and "available of" in got.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv-disk-bytes", "1MiB", "--kv-tier-dir", "/proc/self"], "cannot write in /proc/self"),
        (["--kv-disk-bytes", "1MiB"], "needs a directory"),
        (["--kv-host-bytes", "lots"], "is not a byte count"),
        (["--kv-cxl", "maybe"], "auto, emulated or off"),
        (["--device-tier", "tpu"], "auto, gpu or host-stand-in, not 'tpu'"),
        (["--kv-device-bytes", "lots"], "is not a byte count"),
    ],
)
def test_bad_tier_flags_are_named(args: list[str], message: str) -> None:
    got = _run("--device-kv-capacity", "1", *args)
    assert got.returncode != 0 and message in got.stderr, got.stderr


def test_cli_args_round_trip(tmp_path: Path) -> None:
    config = TierConfig(3, host_bytes=1 << 20, cxl_bytes=2 << 20, cxl="emulated",
                        cxl_dilation=50.0, disk_bytes=3 << 20, disk_dir=tmp_path,
                        device_tier="host-stand-in", device_bytes=5 << 20)  # fmt: skip
    args = config.cli_args()
    values = dict(zip(args[::2], args[1::2], strict=True))
    parsed = tier_config(
        int(values["--device-kv-capacity"]),
        values["--kv-host-bytes"],
        values["--kv-cxl-bytes"],
        values["--kv-cxl"],
        float(values["--kv-cxl-dilation"]),
        values["--kv-disk-bytes"],
        Path(values["--kv-tier-dir"]),
        values["--device-tier"],
        values["--kv-device-bytes"],
    )
    assert parsed == config
    assert tier_config(0, "1MiB", "0", "auto", 1.0, "0", None) is None


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.skipif(_cuda(), reason="torch sees a GPU here: --device-tier gpu is accepted")
def test_device_tier_gpu_without_one_is_refused_at_start() -> None:
    got = _run("--device-kv-capacity", "1", "--device-tier", "gpu")
    assert got.returncode == 2, got.stderr
    assert "--device-tier gpu: torch" in got.stderr or "not installed" in got.stderr
