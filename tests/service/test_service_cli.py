"""The service commands as a user runs them: `topkv cluster up`, `topkv status`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from topkv.jsonout import loads_strict
from topkv.service.cluster.local import LocalCluster, SmokeLayout, run_smoke
from topkv.service.orchestrator.client import OrchestratorClient

ClusterFactory = Callable[..., LocalCluster]
TOPKV = [sys.executable, "-c", "from topkv.cli.main import app; app()"]


def _children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_cluster_up_smoke_json(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            *TOPKV,
            "cluster",
            "up",
            "--prefill",
            "1",
            "--decode",
            "2",
            "--port",
            "0",
            "--smoke",
            "4",
            "--smoke-layers",
            "2",
            "--smoke-tokens",
            "16",
            "--json",
            "--run-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = loads_strict(done.stdout)
    smoke = report["smoke"]
    assert smoke["submitted"] == smoke["delivered"] == smoke["verified"] == 4
    assert {r["medium"] for r in smoke["results"]} == {"shm"}
    assert smoke["bytes_each"] == 2 * 16 * 8 * 128 * 2 * 2
    roles = sorted(w["role"] for w in report["cluster"]["workers"])
    assert roles == ["decode", "decode", "prefill"]
    for worker in report["cluster"]["workers"]:
        assert not _alive(worker["pid"]), "cluster up left a worker running"
    assert not _alive(report["cluster"]["orchestrator"]["pid"])


def test_cluster_up_stops_every_process_on_sigterm(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            *TOPKV,
            "cluster",
            "up",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--port",
            "0",
            "--json",
            "--run-dir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.ready.json"))) < 3:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "cluster did not come up"
            time.sleep(0.1)
        url = json.loads((tmp_path / "orchestrator.ready.json").read_text())["url"]
        token = (tmp_path / "token").read_text().strip()  # written before anything started
        OrchestratorClient(url, token=token).wait_workers(1, 1, 30)
        children = _children_of(proc.pid)
        assert len(children) == 3
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        for child in children:
            assert not _alive(child), f"child {child} outlived cluster up"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_status_tables_and_json(make_cluster: ClusterFactory) -> None:
    cluster = make_cluster(prefill=1, decode=1)
    run_smoke(cluster.client(), 2, SmokeLayout(layers=2, tokens=16))
    env = {**os.environ, "COLUMNS": "80"}  # piped: tables keep their full width anyway
    assert cluster.token_files is not None
    token = ["--token-file", str(cluster.token_files.admin)]
    table = subprocess.run(
        [*TOPKV, "status", "--orchestrator", cluster.orchestrator_url, *token],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert table.returncode == 0, table.stderr
    assert "Workers (2)" in table.stdout and "delivered 2" in table.stdout
    assert "shm" in table.stdout and "ok" in table.stdout
    assert "\u2026" not in table.stdout and "transfer endpoint" in table.stdout
    as_json = subprocess.run(
        [*TOPKV, "status", "--orchestrator", cluster.orchestrator_url, "--json", *token],
        capture_output=True,
        text=True,
        timeout=60,
    )
    status = loads_strict(as_json.stdout)
    assert len(status["workers"]) == 2
    assert status["transfers"]["counts"]["delivered"] == 2


def test_status_against_nothing_is_one_clear_line() -> None:
    done = subprocess.run(
        [*TOPKV, "status", "--orchestrator", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("topkv: error:") and "unreachable" in done.stderr
    assert "Traceback" not in done.stderr


def test_worker_without_secret_or_registry_says_what_to_do() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TOPKV_SECRET"}
    done = subprocess.run(
        [*TOPKV, "worker", "--role", "decode", "--orchestrator", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2 and "TOPKV_SECRET" in done.stderr
    bad_role = subprocess.run(
        [*TOPKV, "worker", "--role", "verify"], capture_output=True, text=True, timeout=60
    )
    assert bad_role.returncode == 2 and "prefill or decode" in bad_role.stderr
