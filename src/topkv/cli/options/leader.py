"""``--leader-elect`` and its companions for ``topkv orchestrator`` (docs/kubernetes.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape

from topkv.relay.leader.base import (
    DEFAULT_LEASE_S,
    LEADER_ELECT_GRAMMAR,
    ElectionTiming,
    LeaderBackend,
    default_identity,
    parse_leader_elect,
)

if TYPE_CHECKING:
    from topkv.service.orchestrator.leadership import LeaderElectConfig


def leader_elect_option() -> Any:
    return typer.Option(
        None,
        help=f"campaign for leadership: {escape(LEADER_ELECT_GRAMMAR)} (only the leader acts)",
    )


def lease_seconds_option() -> Any:
    return typer.Option(
        DEFAULT_LEASE_S,
        help="leader lease (client-go LeaseDuration; renew deadline 2/3, retry period 2/15)",
    )


def advertise_url_option() -> Any:
    return typer.Option(
        None, help="the URL followers send clients to while this one leads (default: served URL)"
    )


def leader_elect_config(
    spec: str | None, lease_s: float, advertise_url: str | None
) -> LeaderElectConfig | None:
    """The election the flags ask for (None without ``--leader-elect``)."""
    if spec is None:
        return None
    from topkv.service.orchestrator.leadership import LeaderElectConfig

    parsed = parse_leader_elect(spec)
    timing = ElectionTiming.for_lease(lease_s)
    backend: LeaderBackend
    if parsed.kind == "etcd":
        from topkv.relay.leader.etcd import EtcdLeaderBackend

        backend = EtcdLeaderBackend.from_url(
            parsed.target, lease_s, renew_deadline_s=timing.renew_deadline_s
        )
    else:
        from topkv.integrations.kubernetes.lease import KubernetesLeaseBackend

        backend = KubernetesLeaseBackend.in_cluster(parsed.target or None, timing)
    return LeaderElectConfig(
        backend=backend, identity=default_identity(), timing=timing, advertise_url=advertise_url
    )
