"""Dedicated etcd servers for live tests: plain, TLS, or with ``auth enable``.

Shared by the etcd registry's live tests and the CLI's etcd-credential test (``tests/`` is
on the test path). Each server listens on free loopback ports with its own data dir.
"""

from __future__ import annotations

import base64
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

ROOT_PASSWORD = "root-Zx9-pw"
WORKER_PASSWORD = "worker-Zx9-pw"
OTHER_PASSWORD = "other-Zx9-pw"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Etcd:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path


def start_etcd(
    workdir: Path,
    name: str,
    *,
    tls: tuple[Path, Path, Path] | None = None,
    client_cert: tuple[str, str] | None = None,
    extra: tuple[str, ...] = (),
    host: str = "127.0.0.1",
    netns: str | None = None,
) -> Etcd:
    """etcd on free ports of ``host`` (loopback unless given, inside ``netns`` if given);
    ``tls`` = (ca, server cert, server key) serves HTTPS."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd binary not installed (apt-get install etcd-server); .ci/run installs it")
    client_port, peer_port = free_port(host), free_port()
    client = f"{'https' if tls else 'http'}://{host}:{client_port}"
    peer = f"http://127.0.0.1:{peer_port}"
    args = [
        binary,
        f"--name={name}",
        f"--data-dir={workdir / name}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster={name}={peer}",
        *extra,
    ]
    if tls is not None:
        args += [f"--cert-file={tls[1]}", f"--key-file={tls[2]}"]
    if netns is not None:
        args = ["ip", "netns", "exec", netns, *args]
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    etcd = Etcd(proc, client_port, log)
    verify: str | bool = str(tls[0]) if tls else True
    deadline = time.monotonic() + 20
    while True:
        try:
            if requests.get(f"{client}/health", timeout=1, verify=verify, cert=client_cert).ok:
                return etcd
        except requests.RequestException:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_etcd(etcd)
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"etcd {name} did not become healthy within 20 s:\n{tail}")
        time.sleep(0.1)


def stop_etcd(etcd: Etcd) -> None:
    etcd.proc.terminate()
    try:
        etcd.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        etcd.proc.kill()
        etcd.proc.wait(timeout=10)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def enable_auth(port: int) -> None:
    """Users root, worker (readwrite on /topkv/) and other (no role); then ``auth enable``."""
    base = f"http://127.0.0.1:{port}/v3/auth"
    calls: list[tuple[str, dict[str, Any]]] = [
        ("user/add", {"name": "root", "password": ROOT_PASSWORD}),
        ("user/grant", {"user": "root", "role": "root"}),
        ("user/add", {"name": "worker", "password": WORKER_PASSWORD}),
        ("user/add", {"name": "other", "password": OTHER_PASSWORD}),
        ("role/add", {"name": "topkv"}),
        (
            "role/grant",
            {
                "name": "topkv",
                "perm": {
                    "permType": "READWRITE",
                    "key": _b64("/topkv/"),
                    "range_end": _b64("/topkv0"),
                },
            },
        ),
        ("user/grant", {"user": "worker", "role": "topkv"}),
        ("enable", {}),
    ]
    for path, body in calls:
        response = requests.post(f"{base}/{path}", json=body, timeout=5)
        assert response.ok, f"{path}: {response.status_code} {response.text}"
