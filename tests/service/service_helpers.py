"""Helpers shared by the service tests: free ports, a real etcd process, ip commands."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start_etcd(
    host: str, data_dir: Path, netns: str | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """Start etcd listening on ``host`` (optionally inside ``netns``); returns (proc, url)."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd binary not installed (apt-get install etcd-server); .ci/run installs it")
    client_port, peer_port = free_port(), free_port()
    client = f"http://{host}:{client_port}"
    peer = f"http://127.0.0.1:{peer_port}"
    argv = [
        binary,
        "--name=topkv-service-test",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=topkv-service-test={peer}",
    ]
    if netns is not None:
        argv = ["ip", "netns", "exec", netns, *argv]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(f"{client}/health", timeout=1) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError("etcd did not become healthy within 20 s")
        time.sleep(0.1)
    return proc, f"etcd://{host}:{client_port}"


def stop_etcd(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def free_port_in(host: str) -> int:
    """A port free on ``host`` (the address must be configured in this namespace)."""
    return free_port(host)


def run_ip(*args: str) -> None:
    """Run ``ip ARGS``; fail the test with ip's message when it refuses."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
