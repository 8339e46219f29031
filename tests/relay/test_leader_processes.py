"""``topkv orchestrator --leader-elect etcd://...`` processes over a real etcd, with real
workers (in-process ``WorkerService``s registered in the same etcd) moving real bytes:

* two orchestrators: exactly one leader; the follower answers mutating requests 503 with
  the leader's address and ``GET /v1/leader`` to any caller;
* SIGKILL the leader: the other takes over within the lease (plus one retry period and
  etcd's 500 ms expiry sweep);
* 20 kill/restart rounds: no sample ever shows two orchestrators acting; every transfer a
  client asked for is delivered and verified (one whose leader died is resubmitted to the
  next); after each takeover the workers refuse the deposed leader's epoch (fencing).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from topkv.harness.inprocess_cluster import InProcessCluster, WorkerSpec
from topkv.relay.registry.etcd import EtcdRegistry
from topkv.service.http.auth import new_token, write_token_file
from topkv.service.http.fencing import EPOCH_HEADER

pytestmark = pytest.mark.etcd

TOPKV = [sys.executable, "-c", "from topkv.cli.main import app; app()"]
#: 4.5 s: the etcd key lives the renew deadline (3 s, whole seconds), so a killed leader is
#: replaced within 3 s + one retry period (0.6 s) + etcd's expiry sweep (~0.5 s) < 4.5 s
LEASE_S = 4.5
RETRY_S = LEASE_S * 2 / 15
LAYOUT = {"num_layers": 2, "seq_len": 16, "kv_heads": 2, "head_dim": 32, "dtype": "fp16"}


@dataclass
class Orch:
    name: str
    proc: subprocess.Popen[bytes]
    ready: Path
    url: str = ""

    def wait_ready(self, timeout_s: float = 30) -> str:
        deadline = time.monotonic() + timeout_s
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"orchestrator {self.name} did not start")
            time.sleep(0.05)
        self.url = json.loads(self.ready.read_text())["url"]
        return self.url


@dataclass
class Group:
    """Orchestrator processes sharing one etcd (registry and election)."""

    tmp: Path
    etcd_url: str
    token_file: Path
    orchs: dict[str, Orch] = field(default_factory=dict)

    def start(self, name: str) -> Orch:
        ready = self.tmp / f"{name}.ready"
        ready.unlink(missing_ok=True)
        log = (self.tmp / f"{name}.log").open("ab")
        proc = subprocess.Popen(
            [
                *TOPKV,
                "orchestrator",
                "--port",
                "0",
                "--registry",
                self.etcd_url,
                "--leader-elect",
                self.etcd_url,
                "--lease-seconds",
                str(LEASE_S),
                "--token-file",
                str(self.token_file),
                "--ready-file",
                str(ready),
                "--attempt-timeout",
                "5",
                "--log-level",
                "warning",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if not k.startswith("TOPKV_")},
        )
        orch = Orch(name, proc, ready)
        self.orchs[name] = orch
        return orch

    def kill(self, name: str) -> None:
        orch = self.orchs.pop(name)
        orch.proc.send_signal(signal.SIGKILL)
        orch.proc.wait(timeout=10)

    def stop_all(self) -> None:
        for orch in self.orchs.values():
            orch.proc.terminate()
        for orch in self.orchs.values():
            try:
                orch.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                orch.proc.kill()
        self.orchs.clear()


@asynccontextmanager
async def _setup(tmp_path: Path, etcd_url: str) -> AsyncIterator[tuple[Group, InProcessCluster]]:
    url = f"{etcd_url}/leader-{secrets.token_hex(4)}"
    token = new_token()
    token_file = write_token_file(tmp_path / "admin.token", token)
    registry = await asyncio.to_thread(EtcdRegistry.from_url, url)
    cluster = InProcessCluster(registry, ttl_s=5.0, admin_token=token)
    group = Group(tmp_path, url, token_file)
    try:
        await cluster.start(
            [WorkerSpec("prefill", "n0", 0, worker_id="p0"), WorkerSpec("decode", "n0", 1, "d0")]
        )
        yield group, cluster
    finally:
        await asyncio.to_thread(group.stop_all)
        await cluster.stop()
        await asyncio.to_thread(registry.close)


async def _leader_views(http: aiohttp.ClientSession, group: Group) -> dict[str, dict[str, Any]]:
    """GET /v1/leader of every live orchestrator (no token: any caller may ask)."""
    views: dict[str, dict[str, Any]] = {}
    for name, orch in list(group.orchs.items()):
        if not orch.url and orch.ready.exists():
            orch.url = json.loads(orch.ready.read_text())["url"]  # restarted: serving now
        if not orch.url:
            continue
        try:
            async with http.get(f"{orch.url}/v1/leader", timeout=aiohttp.ClientTimeout(1)) as r:
                views[name] = await r.json()
        except (aiohttp.ClientError, TimeoutError):
            continue
    return views


async def _acting(http: aiohttp.ClientSession, group: Group) -> list[str]:
    return [n for n, v in (await _leader_views(http, group)).items() if v["acting"]]


async def _wait_leader(
    http: aiohttp.ClientSession, group: Group, timeout_s: float, watch: list[int]
) -> str:
    """The one acting orchestrator; ``watch[0]`` counts samples with two acting."""
    deadline = time.monotonic() + timeout_s
    while True:
        acting = await _acting(http, group)
        if len(acting) > 1:
            watch[0] += 1
        if len(acting) == 1:
            return acting[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"no single leader within {timeout_s} s: {acting}")
        await asyncio.sleep(0.02)


async def _submit(http: aiohttp.ClientSession, url: str, rid: int) -> aiohttp.ClientResponse:
    body = {"request_id": rid, "model": "m", "layout": LAYOUT, "source": "p0"}
    async with http.post(f"{url}/v1/requests", json=body) as response:
        await response.read()
        return response


async def _delivered(http: aiohttp.ClientSession, url: str, rid: int, timeout_s: float) -> bool:
    """True once ``rid`` is delivered with the decode check matching the source."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with http.get(f"{url}/v1/requests/{rid}") as response:
                record = await response.json()
        except (aiohttp.ClientError, TimeoutError):
            return False  # its orchestrator is gone
        if record.get("state") == "delivered" and record.get("decode_check"):
            return bool(record["decode_check"]["matches_source"])
        if record.get("state") in ("failed", "cancelled"):
            return False
        await asyncio.sleep(0.02)
    return False


def test_two_orchestrators_one_leader_follower_503_and_sigkill_takeover(
    tmp_path: Path, etcd_url: str
) -> None:
    async def main() -> None:
        async with _setup(tmp_path, etcd_url) as (group, cluster):
            for name in ("o1", "o2"):
                group.start(name)
            for orch in group.orchs.values():
                await asyncio.to_thread(orch.wait_ready)
            token = group.token_file.read_text().strip()
            headers = {"Authorization": f"Bearer {token}"}
            async with aiohttp.ClientSession(headers=headers) as http:
                watch = [0]
                leader = await _wait_leader(http, group, 10, watch)
                follower = next(n for n in group.orchs if n != leader)
                views = await _leader_views(http, group)
                epoch = views[leader]["epoch"]
                assert views[leader]["leader"] == views[leader]["self"]
                assert views[follower]["leader"] == views[leader]["self"]
                assert views[follower]["epoch"] == epoch > 0
                assert set(views[follower]) >= {"leader", "epoch", "self"}

                refused = await _submit(http, group.orchs[follower].url, 1)
                assert refused.status == 503
                assert refused.headers["X-TopKV-Leader"] == group.orchs[leader].url
                accepted = await _submit(http, group.orchs[leader].url, 1)
                assert accepted.status == 202
                assert await _delivered(http, group.orchs[leader].url, 1, 20)
                assert cluster.workers["p0"].fence.highest == epoch
                control = cluster.info("p0").control_url
                for bad in ("abc", "-1", "\u0661\u0662", "9" * 20):
                    async with http.get(f"{control}/v1/kv", headers={EPOCH_HEADER: bad}) as r:
                        assert r.status == 400, bad
                        assert EPOCH_HEADER in (await r.json())["error"]["detail"]
                assert cluster.workers["p0"].fence.highest == epoch  # bad input changes nothing

                group.kill(leader)
                killed_at = time.monotonic()
                assert await _wait_leader(http, group, LEASE_S + 3, watch) == follower
                takeover = time.monotonic() - killed_at
                assert takeover <= LEASE_S, takeover  # within the lease duration
                new_epoch = (await _leader_views(http, group))[follower]["epoch"]
                assert new_epoch > epoch
                assert watch[0] == 0
                print(f"takeover after SIGKILL: {takeover:.2f} s (lease {LEASE_S} s)")

    asyncio.run(main())


ROUNDS = 20


def test_twenty_kill_restart_rounds_never_two_leaders_and_no_transfer_lost(
    tmp_path: Path, etcd_url: str
) -> None:
    async def main() -> None:
        async with _setup(tmp_path, etcd_url) as (group, cluster):
            names = ["o1", "o2"]
            for name in names:
                group.start(name)
            for orch in group.orchs.values():
                await asyncio.to_thread(orch.wait_ready)
            token = group.token_file.read_text().strip()
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
                watch = [0]
                epochs: list[int] = []
                delivered: set[int] = set()
                resubmitted = 0
                takeovers: list[float] = []
                for round_no in range(ROUNDS):
                    leader = await _wait_leader(http, group, LEASE_S + 5, watch)
                    url = group.orchs[leader].url
                    epoch = (await _leader_views(http, group))[leader]["epoch"]
                    assert not epochs or epoch > epochs[-1], (epochs, epoch)
                    epochs.append(epoch)
                    # Two transfers to completion, a third left in flight as the leader dies.
                    wanted = [round_no * 3 + k for k in range(3)]
                    for rid in wanted[:2]:
                        assert (await _submit(http, url, rid)).status == 202
                        assert await _delivered(http, url, rid, 20), rid
                        delivered.add(rid)
                    # The new leader has driven both workers: the old epoch is fenced there.
                    for worker_id, worker in cluster.workers.items():
                        assert worker.fence.highest == epoch
                        if epochs[:-1]:
                            async with http.get(
                                f"{cluster.info(worker_id).control_url}/v1/kv",
                                headers={EPOCH_HEADER: str(epochs[-2])},
                            ) as stale:
                                assert stale.status == 409
                                assert (await stale.json())["error"]["kind"] == "fenced"
                    assert (await _submit(http, url, wanted[2])).status == 202
                    group.kill(leader)
                    killed_at = time.monotonic()
                    group.start(leader)  # restarted: it rejoins as a candidate
                    survivor = await _wait_leader(http, group, LEASE_S + 5, watch)
                    takeovers.append(time.monotonic() - killed_at)
                    # The killed leader's in-flight transfer: resubmitted to its successor.
                    new_url = group.orchs[survivor].url
                    if not await _delivered(http, new_url, wanted[2], 0.1):
                        resubmitted += 1
                        assert (await _submit(http, new_url, wanted[2])).status == 202
                    assert await _delivered(http, new_url, wanted[2], 20), wanted[2]
                    delivered.add(wanted[2])
                    await asyncio.to_thread(group.orchs[leader].wait_ready)
                assert delivered == set(range(ROUNDS * 3))
                assert max(takeovers) <= LEASE_S, takeovers  # every takeover within the lease
                assert watch[0] == 0, f"{watch[0]} samples showed two leaders acting"
                refused = sum(w.fence.refused for w in cluster.workers.values())
                print(
                    f"{ROUNDS} rounds: takeover p50 {sorted(takeovers)[ROUNDS // 2]:.2f} s, max "
                    f"{max(takeovers):.2f} s; {resubmitted} resubmitted; {refused} stale calls "
                    f"refused; epochs {epochs[0]}..{epochs[-1]}"
                )

    asyncio.run(main())
