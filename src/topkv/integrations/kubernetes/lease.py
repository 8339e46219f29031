"""Kubernetes backend of leader election: a ``coordination.k8s.io/v1`` Lease, through
``lightkube`` (the ``kubernetes`` extra), with client-go's ``LeaseLock`` semantics.

:class:`KubernetesLeaseBackend` tries to acquire or renew the Lease (:data:`DEFAULT_LEASE_NAME`)
as client-go's ``tryAcquireOrRenew`` does, judging expiry on the local clock and updating with
the ``resourceVersion`` read (optimistic concurrency). The epoch is ``leaseTransitions``; the
holder's address is in :data:`ADDRESS_ANNOTATION`. The rules: docs/kubernetes.md ("Leader
election").
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from typing import TypeVar

import httpx2
from lightkube import ApiError, Client
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease

from topkv.integrations.kubernetes.client import api_client
from topkv.relay.leader.base import Candidate, ElectionTiming, LeaderElectionError, LeaderRecord

DEFAULT_LEASE_NAME = "topkv-orchestrator"
ADDRESS_ANNOTATION = "topkv.io/leader-address"
T = TypeVar("T")


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class KubernetesLeaseBackend:
    """Leader lock in one Lease; see the module docstring."""

    def __init__(
        self,
        client: Client,
        namespace: str,
        timing: ElectionTiming,
        *,
        name: str = DEFAULT_LEASE_NAME,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: the local monotonic clock that judges expiry (client-go's rule)."""
        self.namespace, self.name = namespace, name
        self._client, self._timing, self._clock = client, timing, clock
        self._observed: tuple[str, ...] | None = None  # the record last seen ...
        self._observed_at = 0.0  # ... and when (local monotonic clock)

    @classmethod
    def in_cluster(cls, namespace: str | None, timing: ElectionTiming) -> KubernetesLeaseBackend:
        """From the pod's service account (or ``$KUBECONFIG`` / ``~/.kube/config``);
        ``namespace`` None: the pod's own (the config's)."""
        client = api_client(namespace=namespace, timeout_s=_timeout_s(timing))
        return cls(client, namespace or client.namespace, timing)

    @classmethod
    def for_server(
        cls,
        url: str,
        namespace: str,
        timing: ElectionTiming,
        *,
        name: str = DEFAULT_LEASE_NAME,
        token: str | None = None,
    ) -> KubernetesLeaseBackend:
        """Against the API server at ``url`` with ``token`` (None: no credentials, as the
        tests' stand-in takes)."""
        client = api_client(url, namespace=namespace, token=token, timeout_s=_timeout_s(timing))
        return cls(client, namespace, timing, name=name)

    def describe(self) -> str:
        return f"Lease {self.namespace}/{self.name}"

    def try_acquire_or_renew(self, candidate: Candidate) -> LeaderRecord:
        lease = self._call("reading", lambda: self._get())
        if lease is None:
            self._call("creating", lambda: self._client.create(self._fresh(candidate, 0)))
            return LeaderRecord(candidate.identity, candidate.address, 0)
        spec = lease.spec or LeaseSpec()
        holder = spec.holderIdentity or None
        epoch = spec.leaseTransitions or 0
        address = (
            (lease.metadata.annotations or {}).get(ADDRESS_ANNOTATION) if lease.metadata else None
        )
        self._observe(spec)
        if holder is not None and holder != candidate.identity and not self._expired(spec):
            return LeaderRecord(holder, address, epoch)
        if holder != candidate.identity:
            epoch += 1  # a new holder: one more transition
            spec.acquireTime = _utcnow()
        spec.holderIdentity = candidate.identity
        spec.leaseDurationSeconds = max(1, round(self._timing.lease_s))
        spec.leaseTransitions = epoch
        spec.renewTime = _utcnow()
        if spec.acquireTime is None:
            spec.acquireTime = spec.renewTime
        lease.spec = spec
        assert lease.metadata is not None
        annotations = dict(lease.metadata.annotations or {})
        annotations[ADDRESS_ANNOTATION] = candidate.address
        lease.metadata.annotations = annotations
        self._call("updating", lambda: self._client.replace(lease))  # 409 on a stale version
        self._observe(spec)
        return LeaderRecord(candidate.identity, candidate.address, epoch)

    def release(self, candidate: Candidate) -> None:
        """client-go's ReleaseOnCancel: empty the holder, keep the transitions."""
        lease = self._call("reading", lambda: self._get())
        if lease is None or lease.spec is None or lease.spec.holderIdentity != candidate.identity:
            return
        lease.spec.holderIdentity = None
        lease.spec.leaseDurationSeconds = 1
        lease.spec.renewTime = _utcnow()
        self._call("releasing", lambda: self._client.replace(lease))

    def close(self) -> None:
        self._client.close()

    # -- helpers -----------------------------------------------------------------------------

    def _get(self) -> Lease | None:
        try:
            return self._client.get(Lease, self.name, namespace=self.namespace)
        except ApiError as exc:
            if exc.status.code == 404:
                return None
            raise

    def _fresh(self, candidate: Candidate, epoch: int) -> Lease:
        now = _utcnow()
        return Lease(
            metadata=ObjectMeta(
                name=self.name,
                namespace=self.namespace,
                annotations={ADDRESS_ANNOTATION: candidate.address},
            ),
            spec=LeaseSpec(
                holderIdentity=candidate.identity,
                leaseDurationSeconds=max(1, round(self._timing.lease_s)),
                acquireTime=now,
                renewTime=now,
                leaseTransitions=epoch,
            ),
        )

    def _observe(self, spec: LeaseSpec) -> None:
        key = (
            str(spec.holderIdentity),
            str(spec.renewTime),
            str(spec.leaseTransitions),
            str(spec.leaseDurationSeconds),
        )
        if key != self._observed:
            self._observed, self._observed_at = key, self._clock()

    def _expired(self, spec: LeaseSpec) -> bool:
        duration = float(spec.leaseDurationSeconds or self._timing.lease_s)
        if self._clock() - self._observed_at >= duration:
            return True  # unchanged for a whole lease since this candidate saw it
        renewed = spec.renewTime
        if renewed is None:
            return True
        if renewed.tzinfo is None:
            renewed = renewed.replace(tzinfo=dt.UTC)
        return (_utcnow() - renewed).total_seconds() > 2 * duration

    def _call(self, action: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except ApiError as exc:
            code = exc.status.code
            reason = {
                403: "forbidden: the service account needs get/create/update on "
                "coordination.k8s.io leases in this namespace (deploy/base/rbac.yaml)",
                404: "not found",
                409: "conflict: another candidate changed it first (this try lost)",
            }.get(code or 0, f"HTTP {code}")
            raise LeaderElectionError(
                f"{action} {self.describe()} failed: {reason}; {exc.status.message or ''}".rstrip(
                    "; "
                )
            ) from None
        except httpx2.HTTPError as exc:
            raise LeaderElectionError(
                f"{action} {self.describe()} failed: {exc.__class__.__name__}: {exc}"
            ) from None


def _timeout_s(timing: ElectionTiming) -> float:
    # A call must end well within the renew deadline, leaving room for the next try.
    return max(0.5, timing.renew_deadline_s / 3)
