"""Several hosts on one machine: workers in network namespaces joined by a bridge.

Three namespaces act as three hosts (host_id = namespace name). etcd and the orchestrator
run in the root namespace, bound to the bridge's address so every namespace reaches them.
Transfers between workers of one namespace go over shared memory; transfers that cross
namespaces go over TCP through the veth pairs, and the test checks each one's medium.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from service_helpers import free_port_in, run_ip, start_etcd, stop_etcd

from topkv.service.cluster.local import ClusterConfig, LocalCluster, WorkerPlacement

pytestmark = pytest.mark.netns

LAYOUT = {"num_layers": 4, "seq_len": 128, "kv_heads": 4, "head_dim": 64, "dtype": "fp16"}


@dataclass(frozen=True)
class Hosts:
    bridge_ip: str
    namespaces: dict[str, str]  # name -> address


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"tkvprobe{uuid.uuid4().hex[:6]}"
    created = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if created.returncode != 0:
        return f"`ip netns add` failed: {created.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    reason = _netns_unavailable()
    if reason is not None:
        pytest.skip(reason)
    tag = uuid.uuid4().hex[:6]
    bridge = f"tkv{tag}br"
    subnet = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
    names = [f"tkv{tag}h{i}" for i in range(3)]
    created_ns: list[str] = []
    created_links: list[str] = []
    try:
        run_ip("link", "add", bridge, "type", "bridge")
        created_links.append(bridge)
        run_ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        run_ip("link", "set", bridge, "up")
        addresses: dict[str, str] = {}
        for i, ns in enumerate(names):
            run_ip("netns", "add", ns)
            created_ns.append(ns)
            outside, inside = f"tkv{tag}v{i}", f"tkv{tag}p{i}"
            run_ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            created_links.append(outside)
            run_ip("link", "set", inside, "netns", ns)
            run_ip("link", "set", outside, "master", bridge)
            run_ip("link", "set", outside, "up")
            address = f"{subnet}.{10 + i}"
            run_ip("-n", ns, "addr", "add", f"{address}/24", "dev", inside)
            run_ip("-n", ns, "link", "set", inside, "up")
            run_ip("-n", ns, "link", "set", "lo", "up")
            addresses[ns] = address
        yield Hosts(f"{subnet}.1", addresses)
    finally:
        for ns in created_ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for link in reversed(created_links):
            subprocess.run(["ip", "link", "del", link], capture_output=True)


def test_same_namespace_uses_shm_and_cross_namespace_uses_tcp(hosts: Hosts, tmp_path: Path) -> None:
    h0, h1, h2 = hosts.namespaces
    etcd, etcd_url = start_etcd(hosts.bridge_ip, tmp_path / "etcd")
    placements = [
        WorkerPlacement("prefill", h0, 0, netns=h0, host_id=h0, bind_host=hosts.namespaces[h0]),
        WorkerPlacement("decode", h0, 1, netns=h0, host_id=h0, bind_host=hosts.namespaces[h0]),
        WorkerPlacement("decode", h1, 0, netns=h1, host_id=h1, bind_host=hosts.namespaces[h1]),
        WorkerPlacement("prefill", h2, 0, netns=h2, host_id=h2, bind_host=hosts.namespaces[h2]),
    ]
    config = ClusterConfig(
        registry=etcd_url,
        host=hosts.bridge_ip,
        port=free_port_in(hosts.bridge_ip),
        ttl_s=10.0,
        placements=placements,
    )
    cluster = LocalCluster(config, tmp_path / "cluster")
    try:
        cluster.start()
        # Each worker really runs inside its namespace.
        for process in cluster.workers.values():
            ns = process.spec.netns
            assert ns is not None
            inode = os.stat(f"/proc/{process.pid}/ns/net").st_ino
            assert inode == os.stat(f"/run/netns/{ns}").st_ino
        client = cluster.client()
        ids = {p.role + "@" + p.node: f"{p.role}-{p.node}-gpu{p.gpu}" for p in placements}
        same_host_prefill, remote_prefill = ids[f"prefill@{h0}"], ids[f"prefill@{h2}"]

        records = []
        for n in range(3):
            client.submit(request_id=n + 1, model="m", layout=LAYOUT, source=same_host_prefill)
            records.append(client.wait_done(n + 1, 30))
        for n in range(3):
            client.submit(request_id=n + 11, model="m", layout=LAYOUT, source=remote_prefill)
            records.append(client.wait_done(n + 11, 30))

        for record in records:
            assert record["state"] == "delivered", record
            assert record["decode_check"]["matches_source"], record
            src_ns = record["source"].split("-")[1]
            dst_ns = record["destination"].split("-")[1]
            if src_ns == dst_ns:
                assert (record["transport"], record["medium"]) == ("pcie", "shm"), record
            else:
                assert (record["transport"], record["medium"]) == ("tcp", "tcp"), record
        # Same-host requests stay on the host (cheapest path); remote ones must cross.
        assert {r["destination"] for r in records[:3]} == {ids[f"decode@{h0}"]}
        assert all(r["source"].split("-")[1] != r["destination"].split("-")[1] for r in records[3:])
        metrics = client.metrics()
        assert 'topkv_transfers_total{mode="pcie",outcome="delivered"} 3.0' in metrics
        assert 'topkv_transfers_total{mode="tcp",outcome="delivered"} 3.0' in metrics
    finally:
        cluster.stop()
        stop_etcd(etcd)
