"""A real etcd server for registry tests, on a free loopback port with a temp data dir."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def etcd_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd binary not installed (apt-get install etcd-server); .ci/run installs it")
    data_dir: Path = tmp_path_factory.mktemp("etcd")
    client_port, peer_port = _free_port(), _free_port()
    client = f"http://127.0.0.1:{client_port}"
    peer = f"http://127.0.0.1:{peer_port}"
    proc = subprocess.Popen(
        [
            binary,
            "--name=topkv-test",
            f"--data-dir={data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=topkv-test={peer}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while True:
        try:
            if requests.get(f"{client}/health", timeout=1).ok:
                break
        except requests.RequestException:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("etcd did not become healthy within 20 s")
        time.sleep(0.1)
    try:
        yield f"etcd://127.0.0.1:{client_port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
