"""``topkv chaos`` over real worker processes: SIGKILL, in-worker bit flips, a paced link."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from topkv.errors import ConfigError
from topkv.harness.chaos import REPORT_KEYS
from topkv.jsonout import loads_strict
from topkv.service.worker.service import FAULTS_ENV, WorkerFaults


def test_processes_run_meets_every_condition(tmp_path: Path) -> None:
    """A small processes-mode run through the CLI, checked on every condition."""
    limit = 16
    command = [
        sys.executable,
        "-c",
        "from topkv.cli.main import app; app()",
        "chaos",
        "--transfers",
        "100",
        "--size",
        "256KiB",
        "--corrupt-rate",
        "0.1",
        "--kill-decoder-after",
        "20",
        "--limit",
        str(limit),
        "--run-dir",
        str(tmp_path / "run"),
        "--json",
    ]
    env = {k: v for k, v in os.environ.items() if k != FAULTS_ENV}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    report = loads_strict(done.stdout.strip().splitlines()[-1])
    assert list(report) == list(REPORT_KEYS)
    assert report["submitted"] == 100
    assert report["lost"] == 0
    assert report["corrupt_delivered"] == 0
    assert report["stranded_after"] == 0
    assert report["max_in_flight"] <= limit
    assert report["delivered"] + report["failed_clean"] == report["submitted"]
    assert report["corrupt_detected"] > 0  # the workers flipped bits and receivers caught them
    assert report["rerouted"] > 0  # the decode worker was killed under a running transfer
    logs = {p.name for p in (tmp_path / "run").iterdir()}
    assert {"prefill-0.log", "prefill-1.log", "decode-2.log"} <= logs  # real processes ran


def test_worker_faults_are_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    assert not WorkerFaults.from_env().active
    monkeypatch.setenv(FAULTS_ENV, "corrupt_rate=0.25,seed=7,slow_gbps=2.5")
    assert WorkerFaults.from_env() == WorkerFaults(corrupt_rate=0.25, seed=7, slow_gbps=2.5)


@pytest.mark.parametrize(
    "text", ["corrupt_rate", "flip=1", "corrupt_rate=x", "corrupt_rate=2", "slow_gbps=0"]
)
def test_bad_fault_text_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError):
        WorkerFaults.parse(text)


@given(
    rate=st.floats(0.0, 1.0, allow_nan=False),
    seed=st.integers(-(2**40), 2**40),
    slow=st.none() | st.floats(1e-6, 1e6, allow_nan=False, allow_infinity=False),
)
def test_fault_text_round_trips(rate: float, seed: int, slow: float | None) -> None:
    faults = WorkerFaults(corrupt_rate=rate, seed=seed, slow_gbps=slow)
    assert WorkerFaults.parse(faults.to_text()) == faults
