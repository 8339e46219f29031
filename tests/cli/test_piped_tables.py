"""Tables printed to a pipe or a file come out whole: full width, no cell cut to ``…``."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

from rich.table import Table
from typer.testing import CliRunner

from topkv.cli.console import PIPED_WIDTH, stdout_console
from topkv.cli.main import _typer_app
from topkv.cli.status import render_status

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
H100_TOPO = FIXTURES / "nvidia-smi-topo" / "sglang-30401-h100-8gpu-nv18-8nic.txt"
ELLIPSIS = "\u2026"
SIM_COLUMNS = ("policy", "pipelining", "exposed xfer p50", "KV share of TTFT", "transports")


def _trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,3840,120\n"
        "2023-11-16 18:15:47.1805900,384,12\n",
        encoding="utf-8",
    )
    return path


def _invoke(args: list[str]) -> str:
    result = CliRunner().invoke(_typer_app, args, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    return result.stdout


def _whole(out: str, *cells: str) -> None:
    assert ELLIPSIS not in out
    for cell in cells:
        assert cell in out, cell


def test_sim_table_piped_through_a_real_process(tmp_path: Path) -> None:
    env = {**os.environ, "COLUMNS": "80"}
    command = ["sim", "--trace", str(_trace(tmp_path))]
    done = subprocess.run(
        [sys.executable, "-c", "from topkv.cli.main import app; app()", *command],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    _whole(done.stdout, "uniform-rdma", "paper", "cost", *SIM_COLUMNS, "rdma:2", " ms ")
    assert max(len(line) for line in done.stdout.splitlines()) > 80
    assert "rejected: 0 of 2 requests; served: 2" in done.stdout


def test_sim_table_under_cli_runner(tmp_path: Path) -> None:
    out = _invoke(["sim", "--trace", str(_trace(tmp_path)), "--pipelining", "both"])
    _whole(out, "uniform-rdma", *SIM_COLUMNS)
    assert out.count("uniform-rdma") == 2


def test_plan_and_models_tables() -> None:
    out = _invoke(["plan", "--model", "llama-3-70b", "--seq-len", "4096"])
    _whole(out, "nvlink", "rdma", "analytical: xfer = Eq. 2")
    _whole(_invoke(["models"]), "Llama-3.1-405B", "Qwen3.5-397B")


def test_select_table(tmp_path: Path) -> None:
    topo = _invoke(["discover", "--nvidia-smi-topo", str(H100_TOPO), "--name", "n0", "--json"])
    topology = tmp_path / "topology.json"
    topology.write_text(topo, encoding="utf-8")
    pair = ["--src", "n0:0", "--dst", "n0:1", "--bytes", "1.34GB"]
    out = _invoke(["select", "--topology", str(topology), *pair])
    _whole(out, "n0/GPU0:nvlink, n0/GPU1:nvlink", "(nominal)", "choice: nvlink")


def test_status_tables_on_a_non_terminal() -> None:
    worker = {
        "worker_id": "decode-with-a-rather-long-name-0",
        "role": "decode",
        "node": "node-with-a-long-name",
        "host_id": "host-0123456789abcdef",
        "gpus": [0, 1, 2, 3],
        "capacity": 8,
        "address": "tcp://10.0.0.1:50051?transport=emulated-rdma",
    }
    transfer = {
        "request_id": 1,
        "state": "delivered",
        "source": "prefill-with-a-rather-long-name-0",
        "destination": "decode-with-a-rather-long-name-0",
        "transport": "rdma",
        "medium": "emulated-rdma",
        "emulated": True,
        "size_bytes": 1 << 30,
        "transfer_seconds": 0.5,
        "retries": 0,
        "failovers": 0,
        "reroutes": 0,
        "decode_check": {"matches_source": True},
        "reason": "",
    }
    listing = {"counts": {"delivered": 1}, "in_flight": 0, "queued": 0, "transfers": [transfer]}
    buffer = io.StringIO()
    console = stdout_console(file=buffer)
    assert console.width == PIPED_WIDTH
    console.print(render_status([{"worker": worker, "slots_used": 1}], listing))
    _whole(buffer.getvalue(), *(str(v) for v in worker.values() if isinstance(v, str)))
    _whole(buffer.getvalue(), "retries/failovers/reroutes", "rdma (emulated)", "1.0 GiB")


def test_wide_table_is_whole_and_not_padded() -> None:
    buffer = io.StringIO()
    console = stdout_console(file=buffer)
    table = Table(title="t")
    for i in range(12):
        table.add_column(f"column number {i}")
    table.add_row(*[json.dumps({"cell": i, "text": "x" * 40}) for i in range(12)])
    console.print(table)
    console.print("a footer line")
    out = buffer.getvalue()
    _whole(out, '"text": "' + "x" * 40, "column number 11")
    lines = out.splitlines()
    assert lines[-1] == "a footer line"
    assert max(len(line) for line in lines) < 1000  # as wide as the table, not the console


def test_terminal_keeps_its_width() -> None:
    console = stdout_console(file=io.StringIO(), force_terminal=True, width=100)
    assert console.is_terminal and console.width == 100
