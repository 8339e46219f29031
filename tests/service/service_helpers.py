"""Helpers shared by the service tests: free ports, a real etcd process, ip commands."""

from __future__ import annotations

import subprocess
from pathlib import Path

import etcd_servers
from etcd_servers import free_port


def start_etcd(
    host: str, data_dir: Path, netns: str | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """Start etcd listening on ``host`` (optionally inside ``netns``); returns (proc, url)."""
    etcd = etcd_servers.start_etcd(data_dir, "topkv-service-test", host=host, netns=netns)
    return etcd.proc, f"etcd://{host}:{etcd.port}"


def stop_etcd(proc: subprocess.Popen[bytes]) -> None:
    etcd_servers.stop_etcd(etcd_servers.Etcd(proc, 0, Path()))


def free_port_in(host: str) -> int:
    """A port free on ``host`` (the address must be configured in this namespace)."""
    return free_port(host)


def run_ip(*args: str) -> None:
    """Run ``ip ARGS``; fail the test with ip's message when it refuses."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
