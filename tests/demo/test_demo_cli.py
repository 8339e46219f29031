"""``topkv demo --json`` end to end: real worker processes, every request checked."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from topkv.jsonout import loads_strict

pytest.importorskip("torch")
pytest.importorskip("transformers")

KEYS = {
    "id",
    "transport",
    "bytes",
    "prefill_ms",
    "transfer_ms",
    "exposed_ms",
    "modelled_exposed_ms",
    "ttft_ms",
    "tokens_identical",
    "emulated",
    "arrival_ms",
    "prompt_len",
    "prefill_worker",
    "decode_worker",
    "queue_ms",
    "decode_ms",
}
REPO = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")


def _session_members(sid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # fields after the name: state ppid pgrp session ...
            members.append(int(stat.parent.name))
    return members


def _segments() -> set[str]:
    return {p.name for p in SHM.glob("topkv-shm-*")} if SHM.is_dir() else set()


def test_small_demo_run_reports_every_request_identical() -> None:
    topkv = shutil.which("topkv", path=str(Path(sys.executable).parent))
    assert topkv is not None, "the topkv console script is not installed"
    before = _segments()
    process = subprocess.Popen(
        [topkv, "demo", "--requests", "4", "--json", "--dilation", "1000", "--speedup", "4"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=os.environ | {"COLUMNS": "120"},
    )
    try:
        stdout, stderr = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, stderr[-2000:]
    report = loads_strict(stdout)
    assert set(report) == {"requests", "summary", "options"}
    assert report["options"] == {
        "requests": 4, "seed": 0, "speedup": 4.0, "dilation": 1000.0, "new_tokens": 8,
    }  # fmt: skip
    requests = report["requests"]
    assert [r["id"] for r in requests] == [0, 1, 2, 3]
    for row in requests:
        assert set(row) == KEYS
        assert row["tokens_identical"] is True
        assert row["emulated"] is True
        assert row["transport"] in {"nvlink", "rdma"}
        assert row["bytes"] > 0 and row["prefill_ms"] > 0 and row["ttft_ms"] > 0
        assert row["exposed_ms"] >= 0 and row["modelled_exposed_ms"] >= 0
        assert row["transfer_ms"] >= row["exposed_ms"]
        # routed by the relay orchestrator: a prefill worker to a decode worker
        assert row["prefill_worker"] in {"prefill0", "prefill1"}
        assert row["decode_worker"] in {"decode0", "decode1"}
        assert row["prompt_len"] >= 128 and row["arrival_ms"] >= 0
        assert row["queue_ms"] >= 0 and row["decode_ms"] > 0
        assert row["ttft_ms"] >= row["queue_ms"] + row["prefill_ms"]
    arrivals = [r["arrival_ms"] for r in requests]
    assert arrivals == sorted(arrivals)
    summary = report["summary"]
    assert summary["all_tokens_identical"] is True
    assert summary["tokens_identical"] == 4
    assert summary["emulation"]["dilation"] == 1000.0
    # every worker process is gone (same session as the demo) and no segment leaked
    deadline = time.monotonic() + 10
    while _session_members(process.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _session_members(process.pid) == []
    leaked = {
        name for name in _segments() - before if not Path(f"/proc/{name.split('-')[2]}").exists()
    }
    assert leaked == set()
