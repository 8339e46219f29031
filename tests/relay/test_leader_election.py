"""Leader election over a real etcd (``etcd_url``: tests/relay/conftest.py), in-process:
two candidates, exactly one leader; a clean stop hands over at once; a candidate that just
stops (a crash) is replaced within the lease; the timing rules and ``--leader-elect``'s
grammar refuse bad input."""

from __future__ import annotations

import asyncio
import secrets
import time

import pytest

from topkv.errors import ConfigError
from topkv.relay.leader.base import Candidate, ElectionTiming, LeaderRecord, parse_leader_elect
from topkv.relay.leader.etcd import EtcdLeaderBackend
from topkv.relay.leader.loop import LeaderElection
from topkv.relay.registry.etcd_access import parse_etcd_url

LEASE_S = 2.0


def test_timing_follows_client_go_and_refuses_impossible_durations() -> None:
    timing = ElectionTiming.for_lease(15)
    assert (timing.lease_s, timing.renew_deadline_s, timing.retry_period_s) == (15, 10, 2)
    with pytest.raises(ConfigError, match="longer than the renew deadline"):
        ElectionTiming(lease_s=5, renew_deadline_s=5, retry_period_s=1)
    with pytest.raises(ConfigError, match=r"1\.2 x the retry period"):
        ElectionTiming(lease_s=5, renew_deadline_s=2, retry_period_s=2)
    with pytest.raises(ConfigError, match="--lease-seconds must be within"):
        ElectionTiming.for_lease(0.5)


def test_leader_elect_grammar() -> None:
    assert parse_leader_elect("etcd://127.0.0.1:2379").kind == "etcd"
    assert parse_leader_elect("etcds://h:1/p").target == "etcds://h:1/p"
    assert parse_leader_elect("k8s").target == ""
    assert parse_leader_elect("k8s:inference").target == "inference"
    for bad in ("http://x:1", "k8", "kube:ns", ""):
        with pytest.raises(ConfigError, match=r"is not etcd\[s\]://HOST:PORT"):
            parse_leader_elect(bad)
    with pytest.raises(ConfigError, match="at least 2 s"):
        EtcdLeaderBackend(parse_etcd_url("etcd://127.0.0.1:1"), 1.0)


def _election(etcd_url: str, prefix: str, name: str) -> LeaderElection:
    backend = EtcdLeaderBackend(parse_etcd_url(f"{etcd_url}/{prefix}"), LEASE_S)
    candidate = Candidate(name, f"http://{name}.example:8470")
    return LeaderElection(backend, candidate, ElectionTiming.for_lease(LEASE_S))


async def _until(predicate: object, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():  # type: ignore[operator]
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


@pytest.mark.etcd
def test_two_candidates_exactly_one_leader_and_handover(etcd_url: str) -> None:
    prefix = f"leader-{secrets.token_hex(4)}"

    async def main() -> None:
        a, b = _election(etcd_url, prefix, "a"), _election(etcd_url, prefix, "b")
        a.start()
        b.start()
        try:
            await _until(lambda: a.acting() or b.acting(), 5, "a leader")
            both_seen = 0
            deadline = time.monotonic() + 3 * LEASE_S  # several renewals
            while time.monotonic() < deadline:
                both_seen += a.acting() and b.acting()
                assert a.acting() or b.acting(), "the leader lost its lease while alive"
                await asyncio.sleep(0.01)
            assert both_seen == 0
            leader, follower = (a, b) if a.acting() else (b, a)
            await _until(lambda: follower.record.holder == leader.candidate.identity, 2, "view")
            assert follower.record.address == leader.candidate.address
            first_epoch = leader.epoch
            assert follower.epoch == first_epoch > 0

            # A clean stop releases the key: the follower leads at its next try.
            await leader.stop()
            waited = await _until(follower.acting, LEASE_S, "the follower to take over")
            assert waited < LEASE_S / 2, waited
            assert follower.epoch > first_epoch
        finally:
            await a.stop()
            await b.stop()

    asyncio.run(main())


@pytest.mark.etcd
def test_a_crashed_leader_is_replaced_within_the_lease(etcd_url: str) -> None:
    """The leader's loop just stops (no release, as under SIGKILL): its etcd lease runs out
    and the other candidate takes over within the lease plus one retry period."""
    prefix = f"leader-{secrets.token_hex(4)}"

    async def main() -> None:
        a = _election(etcd_url, prefix, "a")
        assert await a.try_once()
        b = _election(etcd_url, prefix, "b")
        b.start()
        try:
            await asyncio.sleep(LEASE_S / 2)
            assert not b.acting() and b.record.holder == "a"  # an unexpired claim stands
            assert await a.try_once()  # a's last renewal; then a "dies"
            died = time.monotonic()
            await _until(b.acting, LEASE_S + 2, "b to take over")
            taken = time.monotonic() - died
            timing = b.timing
            # etcd expires leases on a 500 ms sweep: the bound is lease + retry + sweep.
            assert taken <= timing.lease_s + 1.2 * timing.retry_period_s + 0.5, taken
            assert not a.acting() or time.monotonic() - died < timing.renew_deadline_s
            assert b.epoch > a.epoch
        finally:
            await b.stop()
            a.backend.close()

    asyncio.run(main())


def test_leader_election_needs_a_shared_registry() -> None:
    from topkv.service.orchestrator.api import OrchestratorServiceConfig
    from topkv.service.orchestrator.leadership import LeaderElectConfig

    backend = EtcdLeaderBackend(parse_etcd_url("etcd://127.0.0.1:1"), LEASE_S)
    elect = LeaderElectConfig(backend=backend, identity="a")
    with pytest.raises(ConfigError, match="--leader-elect needs a registry the orchestrators"):
        OrchestratorServiceConfig(auth=None, leader_elect=elect)
    backend.close()


class _ScriptedBackend:
    """A lock whose answers are given in advance: the loop's reaction to each is the test."""

    def __init__(self, records: list[LeaderRecord]) -> None:
        self.records = records

    def describe(self) -> str:
        return "scripted"

    def try_acquire_or_renew(self, candidate: Candidate) -> LeaderRecord:
        return self.records.pop(0)

    def release(self, candidate: Candidate) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_new_epoch_while_still_acting_is_announced() -> None:
    """The key ran out between two renewals (a stalled host) and the same candidate took
    the lock again: it never stopped acting, but its epoch changed, and whoever fences with
    the epoch (the executor) must hear of the new one. Seen live: a re-elected orchestrator
    kept sending its old epoch to the workers."""
    changes: list[tuple[bool, int]] = []
    backend = _ScriptedBackend(
        [
            LeaderRecord("a", "http://a", 64),
            LeaderRecord("a", "http://a", 64),
            LeaderRecord("a", "http://a", 66),
            LeaderRecord("b", "http://b", 67),
        ]
    )
    election = LeaderElection(
        backend,
        Candidate("a", "http://a"),
        ElectionTiming.for_lease(LEASE_S),
        on_change=lambda acting, record: changes.append((acting, record.epoch)),
    )

    async def main() -> None:
        for _ in range(4):
            await election.try_once()

    asyncio.run(main())
    assert changes == [(True, 64), (True, 66), (False, 67)]
