"""``topkv sim`` accounts for every request: never-servable ones are counted as rejected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from topkv.cli.main import _typer_app
from topkv.jsonout import loads_strict
from topkv.kv.catalog import get_model
from topkv.kv.hf_config import spec_from_hf_dict
from topkv.policy.admission import KV_EXCEEDS_DECODE_MEMORY, LONGER_THAN_CONTEXT
from topkv.sim.cluster import load_cluster_spec
from topkv.sim.runner import SimConfig, run_policy
from topkv.traces import Request, Workload

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
HUGE = 99_999_999  # prompt tokens: no decode instance holds this KV

LLAMA_3_8B_CONFIG = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
}


def _trace(tmp_path: Path, rows: list[tuple[int, int]], name: str = "trace.csv") -> Path:
    lines = [
        f"2023-11-16 18:15:{46 + i:02d}.6805900,{prompt},{output}\n"
        for i, (prompt, output) in enumerate(rows)
    ]
    path = tmp_path / name
    path.write_text(HEADER + "".join(lines), encoding="utf-8")
    return path


def _sim(*args: str) -> str:
    result = CliRunner().invoke(_typer_app, ["sim", *args])
    assert result.exit_code == 0, result.output
    return result.stdout


def test_unservable_request_is_rejected_in_json(tmp_path: Path) -> None:
    trace = _trace(tmp_path, [(HUGE, 10), (500, 10), (700, 20)])
    doc = loads_strict(_sim("--trace", str(trace), "--json", "--pipelining", "both"))
    assert doc["requests"] == 3
    assert doc["rejected"] == 1
    for group in ("policies", "policies_without_pipelining"):
        assert set(doc[group]) == {"uniform-rdma", "paper", "cost"}
        for summary in doc[group].values():
            assert summary["rejected"] == 1
            assert summary["ttft_p50_ms"] > 0


def test_only_unservable_requests_give_null_percentiles(tmp_path: Path) -> None:
    trace = _trace(tmp_path, [(HUGE, 10)])
    out = _sim("--trace", str(trace), "--json", "--policy", "paper")
    assert "NaN" not in out and "Infinity" not in out
    doc = loads_strict(out)
    summary = doc["policies"]["paper"]
    assert (doc["requests"], doc["rejected"], summary["rejected"]) == (1, 1, 1)
    for key in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "transfer_ms_p50"):
        assert summary[key] is None
    assert summary["goodput_rps"] == 0.0
    assert summary["bytes_by_transport"] == {}


def test_footer_says_how_many_were_rejected_and_why(tmp_path: Path) -> None:
    trace = _trace(tmp_path, [(HUGE, 10), (500, 10)])
    out = _sim("--trace", str(trace), "--policy", "paper")
    footer = out.strip().splitlines()[-1]
    assert footer == (
        "rejected: 1 of 2 requests (never servable: 1 KV larger than any decode "
        "instance's KV memory); served: 1"
    )


def test_footer_with_nothing_rejected(tmp_path: Path) -> None:
    out = _sim("--trace", str(_trace(tmp_path, [(500, 10)])), "--policy", "cost")
    assert out.strip().splitlines()[-1] == "rejected: 0 of 1 requests; served: 1"


def test_longer_than_the_models_context_is_rejected(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_3_8B_CONFIG), encoding="utf-8")
    trace = _trace(tmp_path, [(8000, 193), (8000, 192), (100, 10)])
    args = ("--trace", str(trace), "--config", str(config), "--policy", "paper")
    doc = loads_strict(_sim(*args, "--json"))
    assert (doc["rejected"], doc["policies"]["paper"]["rejected"]) == (1, 1)
    footer = _sim(*args).strip().splitlines()[-1]
    assert "1 longer than the model's context" in footer and footer.endswith("served: 2")


def test_report_summary_json_is_strict(tmp_path: Path) -> None:
    trace = _trace(tmp_path, [(HUGE, 10)])
    out = tmp_path / "report"
    _sim("--trace", str(trace), "--policy", "paper", "--report", str(out), "--json")
    doc = loads_strict((out / "summary.json").read_text(encoding="utf-8"))
    details = doc["details"]["paper/pipe"]
    assert details["rejected"] == 1 and details["completed"] == 0
    assert details["rejected_by_reason"] == {KV_EXCEEDS_DECODE_MEMORY: 1}
    assert details["ttft_p90_ms"] is None
    assert "rejected" in (out / "index.html").read_text(encoding="utf-8")


def test_hf_config_gives_the_models_context() -> None:
    spec = spec_from_hf_dict(LLAMA_3_8B_CONFIG, name="llama", source="test")
    assert spec.max_context == 8192
    odd = spec_from_hf_dict({**LLAMA_3_8B_CONFIG, "max_position_embeddings": "big"}, "x", "t")
    assert odd.max_context is None
    assert get_model("Llama-3-70B").max_context is None  # catalog: unknown, no limit


@pytest.mark.parametrize("slots", [None, 2])
def test_every_request_is_served_or_rejected(slots: int | None) -> None:
    spec = spec_from_hf_dict(LLAMA_3_8B_CONFIG, name="llama", source="test")
    lengths = [(500, 10), (9000, 10), (HUGE, 1), (100, 1), (8000, 192), (8000, 193)]
    workload = Workload(
        "mixed", tuple(Request(i, i * 0.01, p, o) for i, (p, o) in enumerate(lengths))
    )
    config = SimConfig(model=spec, cluster=load_cluster_spec("4x-dgx-h100"), decode_slots=slots)
    result = run_policy(config, workload, "paper")
    expected = {LONGER_THAN_CONTEXT: 3}  # 9000 + 10, HUGE + 1 and 8000 + 193 tokens
    assert result.rejected_by_reason == expected
    assert (result.completed, result.rejected) == (3, 3)
    summary = result.summary()
    assert summary["rejected"] == 3
