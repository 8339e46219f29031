"""etcd backend of leader election: one key held under an etcd lease, taken in a transaction.

Layout: ``<prefix>/leader`` holds ``{"holder": ID, "address": URL}`` attached to the
holder's lease. Its TTL is the renew deadline, rounded up to etcd's whole seconds (and at
most the election's lease): a holder acts only within the renew deadline of its last
renewal, so its key may lapse then. A follower takes over a killed holder after at most the
TTL + one retry period + etcd's expiry sweep (about 0.5 s): within the lease duration for
leases from 3 s (the default 15 s: 10 + 2 + 0.5 s). Acquiring is a transaction that creates
the key only if it does not exist (``create_revision == 0``), so of two candidates at most
one wins; renewing is a keepalive of that lease. A holder that stops renewing (killed, cut
off) loses its lease after the TTL and etcd deletes the key, so the next try of another
candidate takes it. The epoch of a leadership is the key's create revision: etcd's global
revision at the winning transaction, higher for every later leadership.

Connection, credentials and TLS are the registry's (:mod:`topkv.relay.registry.etcd_access`,
:mod:`topkv.relay.registry.etcd_session`).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Mapping
from typing import Any

from etcd3gw.client import Etcd3Client
from etcd3gw.lease import Lease

from topkv.errors import ConfigError
from topkv.relay.leader.base import Candidate, LeaderElectionError, LeaderRecord
from topkv.relay.registry.base import RegistryError
from topkv.relay.registry.etcd_access import EtcdAccess, parse_etcd_url
from topkv.relay.registry.etcd_session import ETCD_ERRORS, EtcdSession, explain_failure


class EtcdLeaderBackend:
    """Leader lock in etcd; see the module docstring."""

    def __init__(
        self,
        access: EtcdAccess,
        lease_s: float,
        *,
        renew_deadline_s: float | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """``renew_deadline_s``: the election's (default: the lease, the key then lives a
        whole lease); ``timeout_s``: per etcd call (default: a quarter of the lease, at
        most 5 s)."""
        if lease_s < 2:
            raise ConfigError(f"an etcd leader lease must be at least 2 s, got {lease_s}")
        if access.tls is not None:
            access.tls.check()
        self._access = access
        # etcd leases count whole seconds: at least the renew deadline (the holder may act
        # until then), never beyond the lease
        hold_s = lease_s if renew_deadline_s is None else renew_deadline_s
        self._ttl = max(1, min(math.floor(lease_s), math.ceil(hold_s)))
        self._key = access.prefix.rstrip("/") + "/leader"
        timeout = timeout_s if timeout_s is not None else min(5.0, lease_s / 4)
        self._session = EtcdSession(access.endpoint, access.tls, access.login, timeout)
        self._client = Etcd3Client(
            host=access.host,
            port=access.port,
            protocol="https" if access.tls is not None else "http",
            timeout=timeout,
            session=self._session,
        )
        self._lease: Lease | None = None
        self._epoch = 0
        self._logged_in = False

    @classmethod
    def from_url(
        cls,
        url: str,
        lease_s: float,
        env: Mapping[str, str] | None = None,
        renew_deadline_s: float | None = None,
    ) -> EtcdLeaderBackend:
        return cls(parse_etcd_url(url, env), lease_s, renew_deadline_s=renew_deadline_s)

    def describe(self) -> str:
        return f"{self._access.url()} key {self._key}"

    def try_acquire_or_renew(self, candidate: Candidate) -> LeaderRecord:
        try:
            self._log_in()
            if self._lease is not None and self._lease.refresh() <= 0:
                self._lease = None  # expired: whatever it held is gone
            current = self._read()
            if current is None:
                current = self._acquire(candidate)
            elif self._lease is not None and current[1] != self._lease.id:
                self._drop_lease()  # someone else holds the key: our lease guards nothing
        except ETCD_ERRORS as exc:
            raise self._error(exc, "electing a leader") from None
        except RegistryError as exc:
            raise LeaderElectionError(str(exc)) from None
        if current is None:
            return LeaderRecord(holder=None, address=None, epoch=self._epoch)
        value, _lease_id, epoch = current
        self._epoch = max(self._epoch, epoch)
        return LeaderRecord(holder=value.get("holder"), address=value.get("address"), epoch=epoch)

    def release(self, candidate: Candidate) -> None:
        try:
            self._drop_lease()
        except ETCD_ERRORS as exc:
            raise self._error(exc, "releasing leadership") from None

    def close(self) -> None:
        self._session.close()

    # -- helpers -----------------------------------------------------------------------------

    def _log_in(self) -> None:
        if not self._logged_in:
            self._session.log_in(self._client.get_url("/auth/authenticate"))
            self._logged_in = True

    def _acquire(self, candidate: Candidate) -> tuple[dict[str, Any], int, int] | None:
        if self._lease is None:
            self._lease = self._client.lease(ttl=self._ttl)
        value = json.dumps({"holder": candidate.identity, "address": candidate.address})
        self._client.create(self._key, value, lease=self._lease)  # the transaction
        return self._read()

    def _read(self) -> tuple[dict[str, Any], int, int] | None:
        """The key's value, lease id and create revision, or None when nobody holds it."""
        found = self._client.get(self._key, metadata=True)
        if not found:
            return None
        raw, meta = found[0]
        try:
            value = json.loads(raw)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise LeaderElectionError(
                f"{self._key} in {self._access.url()} does not hold a leader record: delete it "
                f"(etcdctl del {self._key}) if nothing else uses that key"
            )
        return value, int(meta.get("lease", 0)), int(meta.get("create_revision", 0))

    def _drop_lease(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            with contextlib.suppress(*ETCD_ERRORS):  # an expired lease is gone either way
                lease.revoke()

    def _error(self, exc: Exception, action: str) -> LeaderElectionError:
        failure = explain_failure(
            exc,
            action=action,
            endpoint=self._access.endpoint,
            prefix=self._key,
            login=self._access.login,
            tls=self._access.tls,
        )
        return LeaderElectionError(str(failure))
