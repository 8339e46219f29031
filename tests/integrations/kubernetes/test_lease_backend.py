"""The Kubernetes Lease backend of leader election (client-go ``LeaseLock`` semantics)
against ``api_standin`` (a STAND-IN for the API server's Lease endpoints with its 404/409
rules, over real HTTP), and against a real cluster when ``KUBECONFIG`` is set."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("lightkube", reason="the kubernetes extra: pip install -e '.[kubernetes]'")

from api_standin import ApiStandIn

from topkv.integrations.kubernetes.lease import (
    ADDRESS_ANNOTATION,
    DEFAULT_LEASE_NAME,
    KubernetesLeaseBackend,
)
from topkv.relay.leader.base import Candidate, ElectionTiming, LeaderElectionError
from topkv.relay.leader.loop import LeaderElection

NS = "inference"
TIMING = ElectionTiming.for_lease(2.0)


@pytest.fixture
def standin() -> Iterator[ApiStandIn]:
    server = ApiStandIn()
    try:
        yield server
    finally:
        server.close()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _backend(standin: ApiStandIn, clock: FakeClock | None = None) -> KubernetesLeaseBackend:
    backend = KubernetesLeaseBackend.for_server(standin.url, NS, TIMING)
    if clock is not None:
        backend._clock = clock
    return backend


def _spec(standin: ApiStandIn) -> dict[str, object]:
    spec = standin.leases[(NS, DEFAULT_LEASE_NAME)]["spec"]
    assert isinstance(spec, dict)
    return spec


A = Candidate("orch-a", "http://a:8470")
B = Candidate("orch-b", "http://b:8470")


def test_create_renew_and_take_over_with_client_go_fields(standin: ApiStandIn) -> None:
    clock = FakeClock()
    a, b = _backend(standin, clock), _backend(standin, clock)
    record = a.try_acquire_or_renew(A)  # 404 -> create
    assert (record.holder, record.address, record.epoch) == ("orch-a", "http://a:8470", 0)
    spec = _spec(standin)
    assert spec["holderIdentity"] == "orch-a" and spec["leaseDurationSeconds"] == 2
    assert spec["leaseTransitions"] == 0 and spec["acquireTime"] and spec["renewTime"]
    lease = standin.leases[(NS, DEFAULT_LEASE_NAME)]
    assert lease["metadata"]["annotations"][ADDRESS_ANNOTATION] == "http://a:8470"

    seen = b.try_acquire_or_renew(B)  # held, not expired: respected
    assert (seen.holder, seen.address, seen.epoch) == ("orch-a", "http://a:8470", 0)
    acquired = spec["acquireTime"]
    clock.now += 1.0
    assert a.try_acquire_or_renew(A).holder == "orch-a"  # renew: same acquireTime
    assert _spec(standin)["acquireTime"] == acquired
    assert _spec(standin)["leaseTransitions"] == 0
    clock.now += 1.5  # b first sees a's renewed record now: respected
    assert b.try_acquire_or_renew(B).holder == "orch-a"
    clock.now += 1.9  # unchanged for 1.9 s of b's clock: still respected
    assert b.try_acquire_or_renew(B).holder == "orch-a"
    clock.now += 0.2  # unchanged for 2.1 s (the lease is 2 s): expired, taken over
    taken = b.try_acquire_or_renew(B)
    assert (taken.holder, taken.epoch) == ("orch-b", 1)
    assert _spec(standin)["leaseTransitions"] == 1
    assert _spec(standin)["acquireTime"] != acquired
    # A's next try finds b holding the lease (and does not take it back).
    assert a.try_acquire_or_renew(A).holder == "orch-b"


def test_optimistic_concurrency_one_of_two_updates_wins(standin: ApiStandIn) -> None:
    old = (dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)).isoformat()
    standin.put_lease(
        NS,
        DEFAULT_LEASE_NAME,
        {"holderIdentity": "gone", "leaseDurationSeconds": 2, "renewTime": old},
    )
    a, b = _backend(standin), _backend(standin)
    lease_a, lease_b = a._get(), b._get()  # both read the same resourceVersion
    assert lease_a is not None and lease_b is not None
    assert a.try_acquire_or_renew(A).holder == "orch-a"
    # b's update with the version it read earlier: 409 Conflict, this try lost.
    b._get = lambda: lease_b  # type: ignore[method-assign]
    with pytest.raises(LeaderElectionError, match="conflict: another candidate changed it"):
        b.try_acquire_or_renew(B)
    assert _spec(standin)["holderIdentity"] == "orch-a"
    # A create racing a create: 409 AlreadyExists.
    c = _backend(standin)
    c._get = lambda: None  # type: ignore[method-assign]
    with pytest.raises(LeaderElectionError, match="creating Lease inference/"):
        c.try_acquire_or_renew(Candidate("orch-c", "http://c"))


def test_an_expired_unknown_holder_is_taken_over_an_unexpired_one_respected(
    standin: ApiStandIn,
) -> None:
    now = dt.datetime.now(dt.UTC)
    standin.put_lease(
        NS,
        DEFAULT_LEASE_NAME,
        {
            "holderIdentity": "unknown",
            "leaseDurationSeconds": 15,
            "renewTime": (now - dt.timedelta(seconds=1)).isoformat(),
            "leaseTransitions": 7,
        },
    )
    assert _backend(standin).try_acquire_or_renew(A).holder == "unknown"  # respected
    standin.put_lease(
        NS,
        DEFAULT_LEASE_NAME,
        {
            "holderIdentity": "unknown",
            "leaseDurationSeconds": 15,
            "renewTime": (now - dt.timedelta(hours=1)).isoformat(),
            "leaseTransitions": 7,
        },
    )
    record = _backend(standin).try_acquire_or_renew(A)  # long expired: taken at once
    assert (record.holder, record.epoch) == ("orch-a", 8)


def test_api_errors_are_clear_and_the_loop_retries_them(
    standin: ApiStandIn, caplog: pytest.LogCaptureFixture
) -> None:
    backend = _backend(standin)
    standin.fail_next(403)
    with pytest.raises(LeaderElectionError, match="forbidden: the service account needs"):
        backend.try_acquire_or_renew(A)
    standin.fail_next(500)
    with pytest.raises(LeaderElectionError, match="HTTP 500"):
        backend.try_acquire_or_renew(A)
    dead = KubernetesLeaseBackend.for_server("http://127.0.0.1:9", NS, TIMING)
    with pytest.raises(LeaderElectionError, match=r"reading Lease inference/.* failed: Connect"):
        dead.try_acquire_or_renew(A)

    async def main() -> None:
        standin.fail_next(503, 500, 403)
        election = LeaderElection(_backend(standin), A, TIMING)
        election.start()
        try:
            deadline = time.monotonic() + 10
            while not election.acting():
                assert time.monotonic() < deadline, "never led after the errors cleared"
                await asyncio.sleep(0.02)
        finally:
            await election.stop()
        assert _spec(standin).get("holderIdentity") is None  # released on stop

    with caplog.at_level(logging.WARNING, logger="topkv.relay.leader.loop"):
        asyncio.run(main())
    failures = [r.getMessage() for r in caplog.records if "attempt failed" in r.getMessage()]
    assert len(failures) == 3, failures
    assert "HTTP 503" in failures[0] and "forbidden" in failures[2]


def test_two_elections_exactly_one_leader_and_handover(standin: ApiStandIn) -> None:
    async def main() -> None:
        a = LeaderElection(_backend(standin), A, TIMING)
        b = LeaderElection(_backend(standin), B, TIMING)
        a.start()
        b.start()
        try:
            deadline = time.monotonic() + 3 * TIMING.lease_s
            while time.monotonic() < deadline:
                assert not (a.acting() and b.acting())
                await asyncio.sleep(0.01)
            leader, follower = (a, b) if a.acting() else (b, a)
            assert leader.acting() and follower.record.holder == leader.candidate.identity
            await leader.stop()
            start = time.monotonic()
            while not follower.acting():
                assert time.monotonic() - start < TIMING.lease_s, "no takeover after release"
                await asyncio.sleep(0.02)
            assert follower.epoch == 1 and _spec(standin)["leaseTransitions"] == 1
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(main())


@pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="needs a real cluster: KUBECONFIG")
def test_against_a_real_cluster() -> None:
    """Two backends on a throwaway Lease in $TOPKV_TEST_NAMESPACE (default: default)."""
    from lightkube import Client
    from lightkube.resources.coordination_v1 import Lease

    namespace = os.environ.get("TOPKV_TEST_NAMESPACE", "default")
    name = f"topkv-test-{secrets.token_hex(4)}"
    timing = ElectionTiming.for_lease(3.0)
    client = Client(namespace=namespace)
    a = KubernetesLeaseBackend(client, namespace, timing, name=name)
    b = KubernetesLeaseBackend(Client(namespace=namespace), namespace, timing, name=name)
    try:
        assert a.try_acquire_or_renew(A).holder == "orch-a"
        assert b.try_acquire_or_renew(B).holder == "orch-a"
        a.release(A)
        assert b.try_acquire_or_renew(B).holder == "orch-b"
    finally:
        client.delete(Lease, name, namespace=namespace)


@pytest.mark.etcd
def test_orchestrator_process_leads_through_the_lease(standin: ApiStandIn, tmp_path: Path) -> None:
    """``topkv orchestrator --leader-elect k8s`` end to end: credentials and namespace from
    $KUBECONFIG (pointing at the stand-in), the Lease taken, ``/v1/leader`` saying so."""
    from etcd_servers import start_etcd, stop_etcd

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: s, cluster: {{server: '{standin.url}'}}}}]\n"
        "users: [{name: u, user: {token: stand-in}}]\n"
        f"contexts: [{{name: c, context: {{cluster: s, user: u, namespace: {NS}}}}}]\n"
    )
    etcd = start_etcd(tmp_path, "lease-etcd")
    ready = tmp_path / "ready.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOPKV_")}
    proc = subprocess.Popen(
        [
            *(sys.executable, "-c", "from topkv.cli.main import app; app()", "orchestrator"),
            *("--port", "0", "--insecure-no-auth", "--ready-file", str(ready)),
            *("--registry", f"etcd://127.0.0.1:{etcd.port}", "--leader-elect", "k8s"),
            *("--lease-seconds", "2"),
        ],
        env={**env, "KUBECONFIG": str(kubeconfig), "POD_NAME": "orch-pod-0"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        view: dict[str, object] = {}
        while not view.get("acting"):
            assert time.monotonic() < deadline and proc.poll() is None, view
            time.sleep(0.1)
            if ready.exists():
                url = json.loads(ready.read_text())["url"]
                with urllib.request.urlopen(f"{url}/v1/leader", timeout=2) as answer:
                    view = json.loads(answer.read())
        assert str(view["self"]).startswith("orch-pod-0-") and view["leader"] == view["self"]
        assert _spec(standin)["holderIdentity"] == view["self"]
        lease = standin.leases[(NS, DEFAULT_LEASE_NAME)]
        assert lease["metadata"]["annotations"][ADDRESS_ANNOTATION] == url
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        stop_etcd(etcd)
    assert _spec(standin).get("holderIdentity") is None  # SIGTERM released the Lease
