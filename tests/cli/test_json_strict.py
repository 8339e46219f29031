"""Every ``--json`` output parses as strict JSON: each number finite or ``null``.

The commands that need a running cluster or a model (``status``, ``cluster up``,
``chaos``, ``demo``) are parsed strictly where their own tests run them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from topkv.cli.main import _typer_app
from topkv.jsonout import dumps, finite, loads_strict

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
H100_TOPO = FIXTURES / "nvidia-smi-topo" / "sglang-30401-h100-8gpu-nv18-8nic.txt"
IBSTAT = FIXTURES / "rdma" / "nccl-tests-128-cx6-hdr-ib-ibstat-partial.txt"
DEMO_RECORD = Path(__file__).resolve().parents[1] / "sim" / "data" / "demo_record_50.json"
RUNNER = CliRunner()


def _strict(args: list[str]) -> Any:
    result = RUNNER.invoke(_typer_app, args)
    assert result.exit_code in (0, 1), result.output  # sim-validate: 1 = over its target
    return loads_strict(result.stdout)


# -- the helper ----------------------------------------------------------------------------


def test_finite_replaces_every_non_finite_number() -> None:
    doc = {
        "nan": math.nan,
        "inf": [math.inf, -math.inf, 1.5],
        "nested": {"t": (np.float64("nan"), np.float32(2.0), np.int64(3))},
        "array": np.array([1.0, np.nan]),
        "keep": [True, None, 0, "NaN"],
    }
    assert finite(doc) == {
        "nan": None,
        "inf": [None, None, 1.5],
        "nested": {"t": [None, 2.0, 3]},
        "array": [1.0, None],
        "keep": [True, None, 0, "NaN"],
    }
    assert loads_strict(dumps(doc, indent=2))["inf"] == [None, None, 1.5]


def test_loads_strict_refuses_nan_and_infinity() -> None:
    for text in ('{"a": NaN}', "[Infinity]", "[-Infinity]"):
        with pytest.raises(ValueError, match="non-finite"):
            loads_strict(text)
    assert json.loads('{"a": NaN}')["a"] != 0  # what the plain parser lets through


# -- the commands ----------------------------------------------------------------------------


def test_plan_and_models() -> None:
    plan = _strict(["plan", "--model", "llama-3-70b", "--seq-len", "4096", "--json"])
    assert plan["kv_bytes"] == 1_342_177_280
    assert len(_strict(["models", "--json"])) > 3


def test_discover_select_and_nic_map(tmp_path: Path) -> None:
    topo = _strict(["discover", "--nvidia-smi-topo", str(H100_TOPO), "--name", "n0", "--json"])
    topology = tmp_path / "topology.json"
    topology.write_text(json.dumps(topo), encoding="utf-8")
    common = ["select", "--topology", str(topology), "--bytes", "1GB", "--json"]
    assert _strict([*common, "--src", "n0:0", "--dst", "n0:1"])["choice"] == "nvlink"
    (tmp_path / "nvidia-smi-topo.txt").write_bytes(H100_TOPO.read_bytes())
    (tmp_path / "ibstat.txt").write_bytes(IBSTAT.read_bytes())
    assert _strict(["discover", "--from", str(tmp_path), "--json"])["nodes"]
    for fmt in ("mooncake", "sglang"):
        assert _strict(["nic-map", "--format", fmt, "--from", str(tmp_path)])


def test_sim_with_an_unservable_request(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,99999999,10\n",
        encoding="utf-8",
    )
    doc = _strict(["sim", "--trace", str(trace), "--json", "--pipelining", "both"])
    assert doc["rejected"] == 1
    assert doc["policies"]["cost"]["ttft_p50_ms"] is None


def test_sim_validate() -> None:
    doc = _strict(["sim-validate", "--demo-json", str(DEMO_RECORD), "--json"])
    assert doc


def test_bench_transfer() -> None:
    args = ["bench", "transfer", "--transport", "tcp", "--size", "256KiB", "--repeat", "1"]
    done = subprocess.run(
        [sys.executable, "-c", "from topkv.cli.main import app; app()", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert loads_strict(done.stdout)["size_bytes"] == 256 << 10
