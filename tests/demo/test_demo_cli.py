"""``topkv demo --json`` end to end: real worker processes, every request checked."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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


def _topkv() -> str:
    topkv = shutil.which("topkv", path=str(Path(sys.executable).parent))
    assert topkv is not None, "the topkv console script is not installed"
    return topkv


def _run_demo(*args: str) -> tuple[subprocess.Popen[str], str, str]:
    process = subprocess.Popen(
        [_topkv(), "demo", *args],
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
    return process, stdout, stderr


def _check_emulation(summary: dict[str, Any], *, derived: bool) -> None:
    """Issue #19's keys: the stand-in, the demo's own rate, how the dilation was set."""
    emulation = summary["emulation"]
    assert emulation["stand_in"]["model"] == "Llama-3-70B"
    assert emulation["stand_in"]["cluster"] == "4x-dgx-h100"
    assert isinstance(emulation["stand_in"]["kv_bytes_per_prefill_s"], int)
    assert emulation["stand_in"]["kv_bytes_per_prefill_s"] > 1e9  # GB/s on 4 H100s
    assert isinstance(emulation["demo_kv_bytes_per_prefill_s"], int)
    assert 0 < emulation["demo_kv_bytes_per_prefill_s"] < 1e9  # MB/s on a CPU
    assert emulation["dilation_derived"] is derived
    ratios = emulation["derivation"]["link_to_compute"]["cross_node"]
    if derived:
        assert "derived for Llama-3-70B on 4x-dgx-h100" in emulation["dilation_note"]
        assert ratios["demo"] == pytest.approx(ratios["stand_in"], rel=0.01)
    else:
        assert "no longer represents any deployment" in emulation["dilation_note"]
    check = summary["sim_check"]
    for side in ("topology_aware", "uniform_rdma"):
        assert isinstance(check[side]["exposed_ms_p50"], float)
        assert isinstance(check[side]["ttft_ms_p50"], float)
    assert isinstance(check["agree"], bool)


def test_small_demo_run_reports_every_request_identical() -> None:
    before = _segments()
    process, stdout, stderr = _run_demo(
        "--requests", "4", "--json", "--dilation", "1000", "--speedup", "4"
    )
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
    assert summary["emulation"]["compute"] == {  # --compute real, the default
        "mode": "real",
        "label": "real: every worker computes on this host's shared cores",
    }
    _check_emulation(summary, derived=False)
    # every worker process is gone (same session as the demo) and no segment leaked
    deadline = time.monotonic() + 10
    while _session_members(process.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _session_members(process.pid) == []
    leaked = {
        name for name in _segments() - before if not Path(f"/proc/{name.split('-')[2]}").exists()
    }
    assert leaked == set()


def test_derived_dilation_without_pipelining() -> None:
    process, stdout, stderr = _run_demo("--requests", "3", "--json", "--pipelining", "off")
    assert process.returncode == 0, stderr[-2000:]
    report = loads_strict(stdout)
    summary = report["summary"]
    assert summary["all_tokens_identical"] is True
    assert summary["pipelining"]["pipelined"] is False
    assert summary["sim_check"]["pipelining"] is False
    _check_emulation(summary, derived=True)
    dilation = summary["emulation"]["dilation"]
    assert report["options"]["dilation"] == dilation
    assert dilation == pytest.approx(
        summary["emulation"]["derivation"]["derived_dilation"], rel=0.01
    )
    # not pipelined: the send starts once prefill ended, so all of it is exposed (and the
    # wait for the whole KV before it)
    for row in report["requests"]:
        assert row["transfer_ms"] > 0 and row["exposed_ms"] >= row["transfer_ms"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pipelining", "sometimes"], "--pipelining 'sometimes': use on or off"),
        (["--stand-in", "GPT-9@4x-dgx-h100"], "unknown model 'GPT-9'"),
        (["--stand-in", "Llama-3-70B@moon"], "unknown cluster 'moon'"),
        (["--dilation", "0.5"], "--dilation must be >= 1"),
        (["--compute", "fast"], "--compute 'fast': use real or paced"),
    ],
)
def test_bad_options_are_named_before_any_worker_starts(args: list[str], message: str) -> None:
    process, _stdout, stderr = _run_demo(*args)
    assert process.returncode == 2
    assert message in stderr
