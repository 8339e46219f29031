"""A loopback-only private network namespace for tests and benchmarks.

NIXL (UCX) and Mooncake bind every interface for their data ports, so tests and benchmarks
run both of their processes in one namespace that nothing outside can reach. It needs root
or CAP_SYS_ADMIN (``unshare -n``); :func:`netns_available` says why not where it cannot be
made.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence

from topkv.transport.errors import TransportUnavailable


def netns_available() -> str | None:
    """None when a private network namespace can be made here, else the reason why not."""
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = subprocess.run(
        ["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.strip() or probe.returncode}"
    return None


class PrivateNetns:
    """A loopback-only network namespace held open by a sleeping process.

    ``command(argv)`` wraps a command so that it runs inside (``nsenter -t PID -n``); every
    process started that way shares the namespace, and nothing in it is reachable from
    outside. NIXL (UCX) and Mooncake bind every interface for their data ports, so tests and
    benchmarks run them in here.
    """

    def __init__(self) -> None:
        reason = netns_available()
        if reason is not None:
            raise TransportUnavailable(f"private network namespace unavailable: {reason}")
        self._holder = subprocess.Popen(
            ["unshare", "-n", "sh", "-c", "ip link set lo up && echo ready && exec sleep 86400"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._holder.stdout is not None
        if self._holder.stdout.readline().strip() != "ready":
            self.close()
            raise TransportUnavailable("the network namespace holder did not start")
        self.pid = self._holder.pid

    def command(self, argv: Sequence[str]) -> list[str]:
        return ["nsenter", "-t", str(self.pid), "-n", *argv]

    def close(self) -> None:
        if self._holder.poll() is None:
            self._holder.kill()
        self._holder.wait(10)

    def __enter__(self) -> PrivateNetns:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
