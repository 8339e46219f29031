"""A local cluster of real processes: one orchestrator plus prefill and decode workers.

:class:`Supervisor` starts processes and always stops them: each child gets
``PR_SET_PDEATHSIG`` (it is sent SIGTERM if the supervisor dies, even by SIGKILL), and
:meth:`Supervisor.stop_all` sends SIGTERM, waits, then SIGKILLs stragglers. Each child
writes a *ready file* (JSON with its URLs) once it serves, so the supervisor never guesses
ports: every process binds port 0 unless told otherwise.

A process may run in a network namespace (``ip netns exec NS ...``), which is how the
multi-host test puts workers on different "hosts" of one machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from topkv.errors import ConfigError
from topkv.relay.registry.etcd_access import is_etcd_url
from topkv.service.cluster.tokens import ClusterTokens, TokenFiles
from topkv.service.compute.engines import EngineSpec
from topkv.service.errors import ClusterError, ServiceError
from topkv.service.http.auth import ServerAuth
from topkv.service.http.tls import ClientTLS, ThrowawayPKI, make_throwaway_pki
from topkv.service.orchestrator.client import OrchestratorClient
from topkv.service.tiers.config import TierConfig
from topkv.service.worker.media import (
    check_medium_name,
    sink_medium,
    unavailable_error,
    why_unavailable,
)
from topkv.service.worker.service import FAULTS_ENV, SECRET_ENV, WorkerFaults

_PR_SET_PDEATHSIG = 1
_TLS_FLAGS = ("--tls-cert", "--tls-key", "--tls-ca")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def topkv_command(*args: str) -> list[str]:
    """argv running ``topkv ARGS`` with this interpreter (no reliance on PATH)."""
    return [sys.executable, "-c", "from topkv.cli.services import main; main()", *args]


@dataclass(frozen=True)
class ProcessSpec:
    name: str
    argv: list[str]
    ready_file: Path
    netns: str | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class ManagedProcess:
    spec: ProcessSpec
    popen: subprocess.Popen[bytes]
    log_path: Path
    ready: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class Supervisor:
    """Starts processes, waits for them to be ready, and stops every one of them."""

    def __init__(self, run_dir: Path, *, ready_timeout_s: float = 30.0, grace_s: float = 5.0):
        self.run_dir = run_dir
        self.ready_timeout_s = ready_timeout_s
        self.grace_s = grace_s
        self.processes: list[ManagedProcess] = []
        run_dir.mkdir(parents=True, exist_ok=True)

    def start(self, spec: ProcessSpec) -> ManagedProcess:
        """Launch ``spec`` (without waiting; see :meth:`wait_ready`)."""
        argv = list(spec.argv)
        if spec.netns is not None:
            argv = ["ip", "netns", "exec", spec.netns, *argv]
        log_path = self.run_dir / f"{spec.name}.log"
        with contextlib.suppress(FileNotFoundError):
            spec.ready_file.unlink()
        with open(log_path, "wb") as log:
            try:
                popen = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **spec.env},
                    preexec_fn=_die_with_parent,
                )
            except OSError as exc:
                raise ClusterError(f"cannot start {spec.name} ({argv[0]}): {exc}") from None
        process = ManagedProcess(spec, popen, log_path)
        self.processes.append(process)
        return process

    def wait_ready(self, process: ManagedProcess) -> dict[str, Any]:
        """Block until the process wrote its ready file; raise with its log if it died."""
        deadline = time.monotonic() + self.ready_timeout_s
        path = process.spec.ready_file
        while True:
            if path.exists():
                with contextlib.suppress(json.JSONDecodeError, OSError):
                    process.ready = json.loads(path.read_text(encoding="utf-8"))
                    return process.ready
            if not process.alive():
                raise ClusterError(
                    f"{process.spec.name} exited with status {process.popen.returncode} "
                    f"before it was ready; its log ends:\n{process.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"{process.spec.name} not ready after {self.ready_timeout_s} s; "
                    f"its log ends:\n{process.log_tail()}"
                )
            time.sleep(0.02)

    def stop(self, process: ManagedProcess, sig: int = signal.SIGTERM) -> int:
        """Stop one process (``sig`` first, SIGKILL after the grace period); its status."""
        if process.alive():
            with contextlib.suppress(ProcessLookupError):
                process.popen.send_signal(sig)
            try:
                process.popen.wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    process.popen.kill()
                process.popen.wait(timeout=self.grace_s)
        return int(process.popen.returncode)

    #: How long a SIGKILLed process may take to be reaped. It cannot refuse the signal, but
    #: the kernel's teardown of a large process (a vLLM server's threads and mappings) on a
    #: saturated host took over 20 s once, and once over 120 s: its exiting thread waited
    #: on a file's mapping lock that the kernel's DAMON thread (kdamond) held while starved
    #: of CPU (dmesg: "task ZMQbg/Reaper blocked for more than 120 seconds ... blocked on
    #: an rw-semaphore likely owned by task kdamond.0"). The wait ends as soon as it exits.
    reap_s = 300.0

    def kill(self, process: ManagedProcess) -> None:
        """SIGKILL (a crash, for fault tests) and reap."""
        with contextlib.suppress(ProcessLookupError):
            process.popen.kill()
        process.popen.wait(timeout=max(self.grace_s, self.reap_s))

    def stop_all(self) -> None:
        """Stop every process, newest first (workers before the orchestrator)."""
        for process in reversed(self.processes):
            if process.alive():
                with contextlib.suppress(ProcessLookupError):
                    process.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for process in reversed(self.processes):
            remaining = max(deadline - time.monotonic(), 0.01)
            try:
                process.popen.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    process.popen.kill()
                process.popen.wait(timeout=self.grace_s)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


@dataclass(frozen=True)
class WorkerPlacement:
    """Where one worker runs: its role, node name, GPU, and optionally a namespace."""

    role: str
    node: str
    gpu: int
    netns: str | None = None
    host_id: str | None = None
    bind_host: str = "127.0.0.1"
    faults: WorkerFaults | None = None  # injected faults (``topkv chaos``); None: none
    engine: EngineSpec | None = None  # None: the cluster's engine
    worker_id: str = ""  # "": ROLE-NODE-gpuI
    capacity: int | None = None  # None: the cluster's
    nvlink_domain: str | None = None  # what the worker advertises about its GPU
    nvlink: bool = False
    rdma: bool = False
    tiers: TierConfig | None = None  # KV memory tiers (--device-kv-capacity ...); None: none


@dataclass
class ClusterConfig:
    prefill: int = 1
    decode: int = 1
    registry: str = "memory"
    topology: Path | None = None
    host: str = "127.0.0.1"
    port: int = 0
    ttl_s: float = 5.0
    capacity: int = 8
    node: str = ""
    placements: Sequence[WorkerPlacement] | None = None
    orchestrator_netns: str | None = None
    attempt_timeout_s: float = 30.0
    extra_orchestrator_args: Sequence[str] = ()
    media: tuple[str, ...] | None = None  # what every worker offers; None: all installed
    engine: EngineSpec = field(default_factory=EngineSpec)
    insecure: bool = False  # no authentication anywhere (--insecure-no-auth), on purpose
    #: The --etcd-* flags every process gets (user names and file paths, never a password).
    etcd_args: Sequence[str] = ()
    tls: bool = False  # HTTPS everywhere, with a throwaway CA made in RUN_DIR/tls (--tls)

    def worker_placements(self) -> list[WorkerPlacement]:
        if self.placements is not None:
            return list(self.placements)
        node = self.node or os.uname().nodename
        roles = ["prefill"] * self.prefill + ["decode"] * self.decode
        return [WorkerPlacement(role, node, gpu) for gpu, role in enumerate(roles)]


class LocalCluster:
    """Orchestrator + workers as real processes under one :class:`Supervisor`."""

    def __init__(self, config: ClusterConfig, run_dir: Path | None = None) -> None:
        if config.prefill < 0 or config.decode < 0:
            raise ClusterError("--prefill and --decode must be >= 0")
        self.config = config
        self._tmp = None if run_dir is not None else tempfile.TemporaryDirectory(prefix="topkv-")
        self.run_dir = run_dir if run_dir is not None else Path(self._tmp.name)  # type: ignore[union-attr]
        self.supervisor = Supervisor(self.run_dir)
        self.secret = secrets.token_hex(32)
        self.tokens = ClusterTokens()
        self.token_files: TokenFiles | None = None
        self.pki: ThrowawayPKI | None = None
        self.orchestrator_url = ""
        self.orchestrator: ManagedProcess | None = None
        self.workers: dict[str, ManagedProcess] = {}

    def worker_names(self) -> list[str]:
        """The process names of the configured workers (each has its own worker token)."""
        return [f"{p.role}-{i}" for i, p in enumerate(self.config.worker_placements())]

    def server_auth(self) -> ServerAuth | None:
        """What an orchestrator (or registration server) of this cluster accepts."""
        if self.config.insecure:
            return None
        return self.tokens.orchestrator_auth(self.worker_names())

    def admin_token(self) -> str | None:
        return None if self.config.insecure else self.tokens.admin

    def _token_files(self) -> TokenFiles | None:
        """The cluster's token files, written once (mode 0600) before any process starts."""
        if self.config.insecure:
            return None
        if self.token_files is None:
            self.token_files = self.tokens.write(self.run_dir, self.worker_names())
        return self.token_files

    def _orchestrator_auth_args(self) -> list[str]:
        files = self._token_files()
        if files is None:
            return ["--insecure-no-auth"]
        return [
            "--token-file",
            str(files.admin),
            "--worker-token-file",
            str(files.accepted_workers),
        ]

    def _worker_auth_args(self, name: str) -> list[str]:
        files = self._token_files()
        if files is None:
            return ["--insecure-no-auth"]
        token = files.of_worker(name)
        if not token.exists():  # a worker beyond the configured ones: the shared token
            token = files.worker
        return ["--token-file", str(token), "--control-token-file", str(files.control)]

    def _tls_args(self) -> list[str]:
        """``--tls-*`` for every process (the certificates made once, before any starts)."""
        if not self.config.tls:
            return []
        if self.pki is None:
            hosts = [self.config.host, *(p.bind_host for p in self.config.worker_placements())]
            self.pki = make_throwaway_pki(self.run_dir / "tls", hosts)
        files = (self.pki.cert_file, self.pki.key_file, self.pki.ca_file)
        return [
            arg for flag, path in zip(_TLS_FLAGS, files, strict=True) for arg in (flag, str(path))
        ]

    def start(self, wait_s: float = 60.0) -> None:
        cfg = self.config
        try:
            ready = self.run_dir / "orchestrator.ready.json"
            args = [
                "orchestrator",
                "--host",
                cfg.host,
                "--port",
                str(cfg.port),
                "--registry",
                cfg.registry,
                "--ready-file",
                str(ready),
                "--attempt-timeout",
                str(cfg.attempt_timeout_s),
                *self._orchestrator_auth_args(),
                *self._tls_args(),
                *cfg.etcd_args,
                *cfg.extra_orchestrator_args,
            ]
            if cfg.topology is not None:
                args += ["--topology", str(cfg.topology)]
            self.orchestrator = self.supervisor.start(
                ProcessSpec("orchestrator", topkv_command(*args), ready, cfg.orchestrator_netns)
            )
            self.orchestrator_url = str(self.supervisor.wait_ready(self.orchestrator)["url"])
            placements = cfg.worker_placements()
            for index, placement in enumerate(placements):
                self.start_worker(placement, index)
            for process in self.workers.values():
                self.supervisor.wait_ready(process)
            roles = [p.role for p in placements]
            self.client().wait_workers(roles.count("prefill"), roles.count("decode"), wait_s)
        except BaseException:
            self.stop()
            raise

    def start_worker(self, placement: WorkerPlacement, index: int) -> ManagedProcess:
        cfg = self.config
        name = f"{placement.role}-{index}"
        ready = self.run_dir / f"{name}.ready.json"
        args = [
            "worker",
            "--role",
            placement.role,
            "--node",
            placement.node,
            "--gpu",
            str(placement.gpu),
            "--worker-id",
            placement.worker_id or f"{placement.role}-{placement.node}-gpu{placement.gpu}",
            "--host",
            placement.bind_host,
            "--ttl",
            str(cfg.ttl_s),
            "--capacity",
            str(cfg.capacity if placement.capacity is None else placement.capacity),
            "--ready-file",
            str(ready),
        ]
        if placement.host_id:
            args += ["--host-id", placement.host_id]
        if placement.nvlink_domain:
            args += ["--nvlink-domain", placement.nvlink_domain]
        args += [
            flag for flag, on in (("--nvlink", placement.nvlink), ("--rdma", placement.rdma)) if on
        ]
        engine = placement.engine or cfg.engine
        if engine.kind != "synthetic":
            args += engine.cli_args()
        if cfg.media is not None:
            args += ["--media", ",".join(cfg.media)]
        if placement.tiers is not None:
            args += placement.tiers.cli_args()
        args += self._worker_auth_args(name) + self._tls_args()
        if is_etcd_url(cfg.registry):
            args += ["--registry", cfg.registry, *cfg.etcd_args]
        else:
            args += ["--orchestrator", self.orchestrator_url]
        env = {SECRET_ENV: self.secret, FAULTS_ENV: ""}
        if placement.faults is not None:
            env[FAULTS_ENV] = placement.faults.to_text()
        spec = ProcessSpec(name, topkv_command(*args), ready, placement.netns, env=env)
        process = self.supervisor.start(spec)
        self.workers[name] = process
        return process

    def stop(self) -> None:
        self.supervisor.stop_all()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def client(self) -> OrchestratorClient:
        if not self.orchestrator_url:
            raise ClusterError("the cluster is not started")
        tls = ClientTLS(self.pki.ca_file) if self.pki is not None else None
        return OrchestratorClient(self.orchestrator_url, token=self.admin_token(), tls=tls)

    def describe(self) -> dict[str, Any]:
        """Where everything runs (what ``topkv cluster up`` prints)."""
        return {
            "orchestrator": {
                "url": self.orchestrator_url,
                "pid": self.orchestrator.pid if self.orchestrator else None,
                "registry": self.config.registry,
            },
            "workers": [
                {
                    "name": name,
                    "pid": p.pid,
                    "worker_id": p.ready.get("worker_id"),
                    "role": p.ready.get("role"),
                    "control_url": p.ready.get("control_url"),
                    "tcp": p.ready.get("tcp"),
                    "shm": p.ready.get("shm"),
                    "host_id": p.ready.get("host_id"),
                    "media": p.ready.get("media"),
                    "engine": p.ready.get("engine"),
                }
                for name, p in self.workers.items()
            ],
            "logs": str(self.run_dir),
            "auth": (
                {"admin_token_file": str(files.admin), "worker_token_file": str(files.worker)}
                if (files := self.token_files) is not None
                else None
            ),
            "tls": {"ca_file": str(self.pki.ca_file)} if self.pki is not None else None,
        }

    def served_model(self) -> str | None:
        """The model id the prefill workers' engine serves (None: the synthetic engine)."""
        for process in self.workers.values():
            engine = process.ready.get("engine")
            if process.ready.get("role") == "prefill" and isinstance(engine, dict):
                model_id = engine.get("model_id")
                return str(model_id) if model_id else None
        return None

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class SmokeLayout:
    layers: int = 4
    tokens: int = 256
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "fp16"

    def as_json(self) -> dict[str, object]:
        """Every field, under its name in the API's layout
        (:class:`~topkv.service.messages.LayoutModel`)."""
        return {_LAYOUT_NAMES.get(name, name): value for name, value in asdict(self).items()}


#: The fields of :class:`SmokeLayout` that the API's layout names otherwise.
_LAYOUT_NAMES = {"layers": "num_layers", "tokens": "seq_len"}


def check_forced_medium(medium: str, media: Sequence[str] | None) -> None:
    """ConfigError (exit 2) unless ``medium`` is known, installed here and among ``media``."""
    check_medium_name(medium)
    carrier = sink_medium(medium)
    reason = why_unavailable(carrier)
    if reason is not None:
        raise unavailable_error(carrier, reason, "--force-transport")
    if media is not None and carrier not in media:
        raise ConfigError(
            f"--force-transport {medium} needs {carrier}, which is not among --media "
            f"{','.join(media)}"
        )


def run_smoke(
    client: OrchestratorClient,
    count: int,
    layout: SmokeLayout,
    *,
    model: str = "smoke",
    first_id: int = 1,
    timeout_s: float = 60.0,
    sources: Sequence[str] | None = None,
    medium: str | None = None,
    model_id: str | None = None,
    new_tokens: int = 4,
) -> dict[str, Any]:
    """Submit ``count`` requests, wait for each, and report what happened to every one.

    ``medium`` forces the medium of every transfer. ``model_id``: the workers serve that
    model (``--engine hf``), so each request is a prompt of ``layout.tokens`` ids (seeded by
    its id) whose decode worker generates ``new_tokens`` tokens.
    """
    if count < 1:
        raise ServiceError(f"--smoke needs a positive count, got {count}")
    submitted: list[int] = []
    for n in range(count):
        rid = first_id + n
        source = sources[n % len(sources)] if sources else None
        if model_id is not None:
            client.submit(
                request_id=rid,
                model=model_id,
                prompt_seed=rid,
                prompt_tokens=layout.tokens,
                new_tokens=new_tokens,
                source=source,
                medium=medium,
            )
        else:
            client.submit(
                request_id=rid, model=model, layout=layout.as_json(), source=source, medium=medium
            )
        submitted.append(rid)
    results = [client.wait_done(rid, timeout_s) for rid in submitted]
    delivered = [r for r in results if r["state"] == "delivered"]
    verified = [r for r in delivered if (r.get("decode_check") or {}).get("matches_source")]
    return {
        "submitted": len(submitted),
        "delivered": len(delivered),
        "verified": len(verified),
        "failed": sum(1 for r in results if r["state"] == "failed"),
        "cancelled": sum(1 for r in results if r["state"] == "cancelled"),
        "bytes_each": results[0]["size_bytes"] if results else 0,
        "results": [
            {
                "request_id": r["request_id"],
                "state": r["state"],
                "source": r["source"],
                "destination": r["destination"],
                "transport": r["transport"],
                "medium": r["medium"],
                "emulated": r["emulated"],
                "transfer_seconds": r["transfer_seconds"],
                "attempts": len(r["attempts"]),
                "verified": bool((r.get("decode_check") or {}).get("matches_source")),
                "reason": r["reason"],
                "tokens": (r.get("decode_check") or {}).get("tokens"),
            }
            for r in results
        ],
    }


def smoke_results(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per smoke transfer, ``transport`` being the medium that moved its bytes
    (``path``: the path class the policy chose); what ``cluster up --smoke --json`` prints
    as ``results``."""
    return [
        {
            "request_id": r["request_id"],
            "transport": r["medium"],
            "path": r["transport"],
            "verified": r["verified"],
            "state": r["state"],
            "source": r["source"],
            "destination": r["destination"],
            "emulated": r["emulated"],
            "bytes": report["bytes_each"],
            "seconds": r["transfer_seconds"],
            "attempts": r["attempts"],
            "reason": r["reason"],
            "tokens": r["tokens"],
        }
        for r in report["results"]
    ]
