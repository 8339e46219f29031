"""A local prefill/decode stack: a ``topkv orchestrator`` (:func:`start_orchestrator`, the
registry) and N prefill and M decode vLLM instances running TopKVConnector
(:func:`start_pd_instances`), which register with it; the front door reads them from it.
``topkv vllm up``, the demo, the end-to-end tests and the benchmark start theirs here."""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from topkv.errors import TopKVError
from topkv.integrations.vllm.stack.launch import (
    VllmInstance,
    kv_transfer_config,
    start_vllm,
    wait_healthy,
)
from topkv.relay.registry.base import WorkerRegistry
from topkv.service.cluster.local import ManagedProcess, ProcessSpec, Supervisor, topkv_command
from topkv.service.http.auth import Credentials, ServerAuth, new_token, write_token_file


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class StackFiles:
    """The run directory's secrets (all 0600): the client token (OpenAI applications'
    api_key: the front door's inference endpoints only), the admin token (the operators';
    the front door reads the orchestrator's registry with it), the worker token (the
    instances register with it) and the transports' shared secret."""

    run_dir: Path
    admin_token: str
    worker_token: str
    client_token: str

    @property
    def admin_file(self) -> Path:
        return self.run_dir / "admin-token"

    @property
    def client_file(self) -> Path:
        return self.run_dir / "client-token"

    @property
    def worker_file(self) -> Path:
        return self.run_dir / "worker-token"

    @property
    def secret_file(self) -> Path:
        return self.run_dir / "kv-secret"

    @classmethod
    def create(cls, run_dir: Path) -> StackFiles:
        files = cls(run_dir, new_token("admin"), new_token("worker"), new_token("client"))
        write_token_file(files.admin_file, files.admin_token)
        write_token_file(files.worker_file, files.worker_token)
        write_token_file(files.client_file, files.client_token)
        write_token_file(files.secret_file, os.urandom(32).hex())
        return files

    def api_key_note(self) -> str:
        """What ``vllm up`` prints about its tokens: where the applications' api_key is, and
        the operators' admin token (the files, never the tokens themselves)."""
        return f"api_key in {self.client_file}; operators' admin token in {self.admin_file}"

    def front_door_auth(self) -> ServerAuth:
        """What the stack's front door accepts: the client token on the inference
        endpoints, the admin token everywhere, the worker token on /v1/workers."""
        return ServerAuth(
            Credentials.of(
                admin=[self.admin_token], worker=[self.worker_token], client=[self.client_token]
            )
        )


def start_orchestrator(
    supervisor: Supervisor, files: StackFiles, port: int = 0, timeout_s: float = 120.0
) -> tuple[ManagedProcess, str]:
    """A ``topkv orchestrator`` process (embedded registry; the stack's admin token, and
    its worker token for the instances' registrations); returns it and its URL once it
    serves."""
    ready = files.run_dir / "orchestrator.ready.json"
    argv = topkv_command(
        "orchestrator", "--host", "127.0.0.1", "--port", str(port), "--ready-file", str(ready),
        "--token-file", str(files.admin_file), "--worker-token-file", str(files.worker_file),
    )  # fmt: skip
    process = supervisor.start(ProcessSpec("orchestrator", argv, ready))
    waited = supervisor.ready_timeout_s
    supervisor.ready_timeout_s = timeout_s
    try:
        url = str(supervisor.wait_ready(process)["url"])
    finally:
        supervisor.ready_timeout_s = waited
    return process, url


def start_pd_instances(
    supervisor: Supervisor,
    model_dir: Path,
    files: StackFiles,
    registry_url: str,
    *,
    prefill: int = 1,
    decode: int = 1,
    both: int = 0,
    python: str | None = None,
    max_model_len: int = 1024,
    load_timeout_s: float = 30.0,
) -> list[VllmInstance]:
    """Start the instances (prefill0.., decode0.., both0..; OpenMP bound round-robin to the
    cores) and return at once; :func:`wait_up` waits for them. ``both``: instances started
    ``kv_both``, registered as decode (with their sinks) and able to prefill too: the front
    door's ADP moves them between the pools (:mod:`.pools`)."""
    cores = os.cpu_count() or 1
    roles = (
        [("prefill", "kv_producer")] * prefill
        + [("decode", "kv_consumer")] * decode
        + [("both", "kv_both")] * both
    )
    instances = []
    counts = {"prefill": 0, "decode": 0, "both": 0}
    for index, (role, kv_role) in enumerate(roles):
        name = f"{role}{counts[role]}"
        counts[role] += 1
        port = free_port()
        extra = {
            "secret_file": str(files.secret_file),
            "shm_dir": str(files.run_dir),
            "worker_id": name,
            "registry_url": registry_url,
            "token_file": str(files.worker_file),
            "api_url": f"http://127.0.0.1:{port}",
            "tcp_port": free_port(),
            "load_timeout_s": load_timeout_s,
        }
        if kv_role == "kv_both":
            extra["role"] = "decode"
        instances.append(
            start_vllm(
                supervisor, name, model_dir, port, cpu=str(index % cores),
                kv_config=kv_transfer_config(kv_role, extra), max_model_len=max_model_len,
                python=python or sys.executable,
            )
        )  # fmt: skip
    return instances


def wait_up(
    instances: list[VllmInstance], registry: WorkerRegistry, timeout_s: float = 600.0
) -> None:
    """Until every instance answers /health and is registered."""
    started = time.monotonic()
    wait_healthy(instances, timeout_s)
    names = {instance.name for instance in instances}
    while names - {w.worker_id for w in registry.workers()}:
        if time.monotonic() - started > timeout_s:
            missing = ", ".join(sorted(names - {w.worker_id for w in registry.workers()}))
            raise TopKVError(f"vLLM instances {missing} are up but never registered")
        time.sleep(0.2)
