"""``topkv plan`` and ``topkv models``: in-process with CliRunner and once as a real process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from topkv.cli.main import _typer_app
from topkv.errors import ConfigError
from topkv.jsonout import loads_strict
from topkv.kv import UnknownModelError

runner = CliRunner()
TOPKV = Path(sys.executable).parent / "topkv"

LLAMA_3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


def _json(args: list[str]) -> dict[str, object]:
    result = runner.invoke(_typer_app, args)
    assert result.exit_code == 0, result.output
    doc = loads_strict(result.stdout)
    assert isinstance(doc, dict)
    return doc


def test_plan_json_for_llama_70b() -> None:
    doc = _json(["plan", "--model", "llama-3-70b", "--seq-len", "4096", "--json"])
    assert doc["kv_bytes"] == 1_342_177_280
    transports = doc["transports"]
    assert isinstance(transports, dict)
    assert transports["rdma"]["transfer_ms"] == pytest.approx(53.7, abs=0.05)
    assert transports["nvlink"]["transfer_ms"] == pytest.approx(2.98, abs=0.01)
    assert doc["aggregate_demand_gbps"] == pytest.approx(134.2, abs=0.1)


def test_plan_options_change_the_numbers() -> None:
    doc = _json(
        [
            "plan",
            "-m",
            "llama-3-70b",
            "--seq-len",
            "1024",
            "--dtype",
            "fp8",
            "--rate",
            "10",
            "--layer-compute-ms",
            "0",
            "--json",
        ]
    )
    assert doc["kv_bytes"] == 1_342_177_280 // 8
    assert doc["dtype"] == "fp8"
    assert doc["aggregate_demand_gbps"] == pytest.approx(10 * 1_342_177_280 / 8 / 1e9)
    transports = doc["transports"]
    assert isinstance(transports, dict)
    assert transports["pcie"]["hidden_fraction"] == pytest.approx(0.0, abs=1e-9)


def test_plan_from_config_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_8B_CONFIG))
    doc = _json(["plan", "--config", str(tmp_path), "--json"])
    assert doc["kv_bytes"] == 2 * 32 * 8 * 128 * 4096 * 2


def test_plan_table_output() -> None:
    result = runner.invoke(_typer_app, ["plan", "--model", "gpt-oss-120b"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "155,713,536 bytes" in result.stdout
    for name in ("nvlink", "nvswitch", "pcie", "rdma", "tcp"):
        assert name in result.stdout


def test_plan_errors_are_topkv_errors() -> None:
    result = runner.invoke(_typer_app, ["plan", "--model", "no-such-model"])
    assert isinstance(result.exception, UnknownModelError)
    result = runner.invoke(_typer_app, ["plan"])
    assert isinstance(result.exception, ConfigError)


def test_models_json_lists_catalog() -> None:
    result = runner.invoke(_typer_app, ["models", "--json"])
    assert result.exit_code == 0, result.output
    rows = loads_strict(result.stdout)
    by_name = {row["name"]: row for row in rows}
    assert by_name["Llama-3-70B"]["kv_bytes_per_token"] == 327_680
    assert by_name["DeepSeek-V3"]["kv_bytes_4k"] == 287_834_112
    assert by_name["Qwen3.5-397B"]["linear_state_bytes"] > 0
    assert all(row["source"] for row in rows)


def test_models_table() -> None:
    result = runner.invoke(_typer_app, ["models"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "Kimi-K2" in result.stdout and "327,680" in result.stdout


@pytest.mark.skipif(not TOPKV.exists(), reason="console script not installed next to python")
def test_console_script_end_to_end(tmp_path: Path) -> None:
    ok = subprocess.run(
        [str(TOPKV), "plan", "--model", "llama-3-70b", "--seq-len", "4096", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    doc = loads_strict(ok.stdout)
    assert doc["kv_bytes"] == 1_342_177_280
    assert doc["transports"]["rdma"]["transfer_ms"] == pytest.approx(53.7, abs=0.05)
    assert doc["transports"]["nvlink"]["transfer_ms"] == pytest.approx(2.98, abs=0.01)

    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", ')
    failed = subprocess.run(
        [str(TOPKV), "plan", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert failed.returncode == 2
    lines = failed.stderr.strip().splitlines()
    assert len(lines) == 1 and "invalid JSON" in lines[0], failed.stderr
    assert "Traceback" not in failed.stderr
