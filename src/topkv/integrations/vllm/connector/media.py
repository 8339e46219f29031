"""Which media a connector offers, and which one carries a prefill/decode pair's KV (no vLLM).

Offer (:func:`offered_media`): like ``topkv worker --media``
(:func:`topkv.service.worker.media.why_unavailable`), an instance offers every connector
medium its host has: ``shm`` and ``tcp`` always, ``nixl`` and ``mooncake`` when their
packages load; ``kv_connector_extra_config.media`` restricts the offer (a listed medium
this host lacks is a configuration error, not a silent fallback). A decode instance opens
a sink for each medium it offers and lists them in its registration
(``capabilities.media``; the arena sinks' addresses in ``sink_addresses``).

Pair (:func:`pair_medium`): the selection policy's path class for the pair becomes a medium
through the one decision the orchestrator's executor makes too,
:func:`topkv.transport.media.medium_for`: an arena medium first where one serves the class
(``nixl`` for rdma), then the class's real medium (shm for a same-host class), then tcp,
among the connector's media (no shm across hosts); the first that both registrations offer
and that can join their hosts (:func:`topkv.service.worker.media.check_medium`) wins.
``allowed`` (a request's ``X-TopKV-Medium``) keeps only those media, the policy's order
first.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from topkv.integrations.vllm.connector.params import MEDIA, ConnectorConfigError, ConnectorSettings
from topkv.relay.workers import WorkerInfo
from topkv.service.worker.media import check_medium, same_host, why_unavailable
from topkv.transport import media as path_media
from topkv.transport.arena.factory import make_sink, make_source
from topkv.transport.base import TransferSink, TransferSource
from topkv.transport.media import real_medium

#: The arena media a connector offers: their sink address is not the registration's
#: ``address`` (tcp) nor derived from it (shm).
ARENA_MEDIA = ("nixl", "mooncake")


@dataclass(frozen=True)
class Offer:
    media: tuple[str, ...]
    unavailable: dict[str, str] = field(default_factory=dict)


def offered_media(settings: ConnectorSettings) -> Offer:
    """The media this instance offers (``settings.media``, each one required, or every
    connector medium installed here)."""
    requested = settings.media
    offered: list[str] = []
    unavailable: dict[str, str] = {}
    for medium in requested or MEDIA:
        reason = why_unavailable(medium)
        if reason is None:
            offered.append(medium)
        elif requested is not None:
            raise ConnectorConfigError(
                f"kv_connector_extra_config.media lists {medium}, not available here: {reason}"
            )
        else:
            unavailable[medium] = reason
    return Offer(tuple(offered), unavailable)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def arena_options(medium: str, settings: ConnectorSettings, sink: bool) -> dict[str, object]:
    """The factory options of an arena medium's sink (``sink``) or source, from settings."""
    options: dict[str, object] = {}
    if medium == "nixl":
        options["ucx_tls"] = settings.ucx_tls
        if _is_loopback(settings.tcp_host):
            # An instance told to serve on loopback keeps UCX there too: UCX's tcp transport
            # otherwise listens on every interface. An explicit UCX_NET_DEVICES wins.
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
    if sink or medium == "mooncake":
        options["host"] = settings.tcp_host
    if sink:
        options["capacity_bytes"] = settings.arena_bytes
    return options


def arena_sink(medium: str, settings: ConnectorSettings) -> TransferSink:
    return make_sink(medium, settings.secret, **arena_options(medium, settings, True))


def arena_source(medium: str, settings: ConnectorSettings) -> TransferSource:
    return make_source(medium, settings.secret, **arena_options(medium, settings, False))


def pair_medium(
    path_class: str,
    prefill: WorkerInfo,
    decode: WorkerInfo,
    allowed: Sequence[str] | None = None,
) -> tuple[str | None, str]:
    """(the medium for this pair, why) - (None, why not) when no allowed medium joins them."""
    choice = path_media.medium_for(
        path_class,
        MEDIA,
        same_host(prefill, decode),
        lambda medium: check_medium(medium, prefill, decode),
        own=(real_medium(path_class), "tcp"),
        allowed=allowed,
    )
    if choice.medium is not None:
        return choice.medium, f"{choice.medium} for the {path_class} path"
    problems = "; ".join(f"{medium}: {problem}" for medium, problem in choice.refused)
    return None, problems or f"no medium serves the {path_class} path"


def sink_address(decode: WorkerInfo, medium: str) -> str | None:
    """Where ``decode``'s ``medium`` sink listens (tcp and arena media; None: not listed)."""
    if medium == "tcp":
        return decode.address if decode.address.startswith("tcp://") else None
    prefix = f"{medium}://"
    return next((a for a in decode.sink_addresses if a.startswith(prefix)), None)
