"""Leader election: one interface, two backends (etcd here, a Kubernetes Lease in
``topkv.integrations.kubernetes``), and the timing rules they share.

Semantics follow client-go's ``leaderelection`` package:

* ``lease_s`` (LeaseDuration): how long a holder's claim stands without a renewal; a
  candidate takes over a claim only once it is that old;
* ``renew_deadline_s`` (RenewDeadline): the leader acts only while its last successful
  renewal *started* less than this ago, so it stops acting before anyone else may start;
* ``retry_period_s`` (RetryPeriod): how often every candidate tries to acquire or renew.

Every leadership has an *epoch*, a number that grows with each new leadership (etcd: the
leader key's create revision; Kubernetes: ``leaseTransitions``). Every transfer the leader
starts carries it (``service.fencing``), and a worker refuses an epoch lower than one it
has seen, so a deposed leader's late actions are refused.
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from topkv.errors import ConfigError, TopKVError

DEFAULT_LEASE_S = 15.0
#: ``--leader-elect`` grammar, for error messages.
LEADER_ELECT_GRAMMAR = "etcd[s]://HOST:PORT[/PREFIX] or k8s[:NAMESPACE]"


class LeaderElectionError(TopKVError):
    """A backend call failed (unreachable, refused, conflict); the election loop retries."""


class Candidate(NamedTuple):
    """Who campaigns: a unique identity and the URL clients are sent to when it leads."""

    identity: str
    address: str


@dataclass(frozen=True)
class LeaderRecord:
    """What a backend read after one try: the holder (None: nobody holds an unexpired
    claim), the holder's advertised address, and the epoch of that holder's leadership (of
    the last one known when there is no holder)."""

    holder: str | None
    address: str | None
    epoch: int


class LeaderBackend(Protocol):
    """One lock that at most one candidate holds at a time."""

    def describe(self) -> str:
        """Where the lock lives (safe to log: no secret)."""
        ...

    def try_acquire_or_renew(self, candidate: Candidate) -> LeaderRecord:
        """Acquire the lock if it is free or expired, renew it if ``candidate`` holds it;
        answer the record as it now stands. Blocking; LeaderElectionError on failure."""
        ...

    def release(self, candidate: Candidate) -> None:
        """Give the lock up at once if ``candidate`` holds it (a clean stop)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ElectionTiming:
    """client-go's three durations; :meth:`for_lease` derives client-go's ratios
    (15 s / 10 s / 2 s) from the lease alone."""

    lease_s: float = DEFAULT_LEASE_S
    renew_deadline_s: float = DEFAULT_LEASE_S * 2 / 3
    retry_period_s: float = DEFAULT_LEASE_S * 2 / 15

    def __post_init__(self) -> None:
        if not self.retry_period_s > 0:
            raise ConfigError(f"the retry period must be positive, got {self.retry_period_s}")
        if not self.lease_s > self.renew_deadline_s:
            raise ConfigError(
                f"the lease ({self.lease_s} s) must be longer than the renew deadline "
                f"({self.renew_deadline_s} s)"
            )
        if not self.renew_deadline_s > 1.2 * self.retry_period_s:
            raise ConfigError(
                f"the renew deadline ({self.renew_deadline_s} s) must exceed 1.2 x the retry "
                f"period ({self.retry_period_s} s)"
            )

    @classmethod
    def for_lease(cls, lease_s: float) -> ElectionTiming:
        if not 1.0 <= lease_s <= 3600.0:
            raise ConfigError(f"--lease-seconds must be within 1-3600, got {lease_s}")
        return cls(lease_s, lease_s * 2 / 3, lease_s * 2 / 15)


def default_identity() -> str:
    """A unique candidate id: ``$POD_NAME`` (or the host name), the pid and a random tag,
    so a restarted process never passes for its former self."""
    base = os.environ.get("POD_NAME") or socket.gethostname() or "topkv"
    return f"{base}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class LeaderElectSpec:
    """A parsed ``--leader-elect``: ``kind`` etcd (``target``: the etcd URL) or k8s
    (``target``: the namespace, empty for the pod's own)."""

    kind: str
    target: str


def parse_leader_elect(spec: str) -> LeaderElectSpec:
    text = spec.strip()
    scheme = text.partition("://")[0].lower()
    if "://" in text and scheme in ("etcd", "etcds"):
        return LeaderElectSpec("etcd", text)
    if text == "k8s" or text.startswith("k8s:"):
        namespace = text.removeprefix("k8s").removeprefix(":")
        return LeaderElectSpec("k8s", namespace)
    raise ConfigError(f"--leader-elect {spec!r} is not {LEADER_ELECT_GRAMMAR}")
