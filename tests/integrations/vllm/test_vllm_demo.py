"""``topkv demo --engine vllm``: the demo's requests through real vLLM instances.

Runs the ``topkv`` command of the main virtualenv (``.venv``, when there is one: the path
users take) as a child process; it starts vLLM from ``.venv-vllm``. Skips when
``.venv-vllm`` is absent (``scripts/install-vllm.sh`` creates it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from topkv.demo.report import JSON_REQUEST_KEYS

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = ROOT / ".venv-vllm/bin/python"
#: float32 KV of the tiny Llama: 4 layers x (K + V) x 2 kv heads x 64 dims x 4 bytes
BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 4


def _topkv() -> list[str]:
    main = ROOT / ".venv/bin/topkv"
    here = [sys.executable, "-c", "from topkv.cli.main import app; app()"]
    return [str(main)] if main.is_file() else here


def _run(
    *args: str, timeout: float, vllm_python: Path = VLLM_PYTHON
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TOPKV_VLLM_PYTHON": str(vllm_python)}
    return subprocess.run(
        [*_topkv(), "demo", *args], capture_output=True, text=True, timeout=timeout, env=env,
        cwd=ROOT,
    )  # fmt: skip


def test_an_unknown_engine_exits_2_naming_the_choices() -> None:
    done = _run("--engine", "bogus", "--requests", "1", timeout=120)
    assert done.returncode == 2
    assert "--engine 'bogus': use hf or vllm" in done.stderr


def test_without_vllm_it_exits_2_naming_the_install_script(tmp_path: Path) -> None:
    done = _run("--engine", "vllm", timeout=120, vllm_python=tmp_path / "no-python")
    assert done.returncode == 2
    assert "scripts/install-vllm.sh" in done.stderr


@pytest.mark.timeout(900)
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="no .venv-vllm (scripts/install-vllm.sh)")
def test_demo_engine_vllm_is_token_identical_with_the_demo_keys() -> None:
    done = _run("--engine", "vllm", "--requests", "4", "--json", timeout=840)
    assert done.returncode == 0, done.stderr[-3000:]
    payload = json.loads(done.stdout)
    requests = payload["requests"]
    assert [r["id"] for r in requests] == [0, 1, 2, 3]
    for r in requests:
        assert set(JSON_REQUEST_KEYS) <= set(r), r
        assert r["tokens_identical"] is True, r
        assert r["error"] is None
        assert r["transport"] == "shm"  # one host: the policy's path, over shm
        assert r["bytes"] == r["prompt_len"] * BYTES_PER_TOKEN
        assert r["ttft_ms"] > 0 and r["decode_ms"] >= 0
        assert (r["prefill_worker"], r["decode_worker"]) == ("prefill0", "decode0")
        assert r["kv_verified"] is True  # the decode's report, from the stream's last chunk
        # what the vLLM path does not measure is null, not invented
        for key in ("prefill_ms", "transfer_ms", "exposed_ms", "modelled_exposed_ms"):
            assert r[key] is None
    summary = payload["summary"]
    assert summary["engine"] == "vllm" and summary["all_tokens_identical"] is True
    assert summary["tokens_identical"] == 4 and summary["transports"] == {"shm": 4}
    assert summary["ttft_ms"]["p50"] > 0
    assert summary["kv_verified"] == 4
    assert payload["options"]["requests"] == 4 and payload["options"]["engine"] == "vllm"
