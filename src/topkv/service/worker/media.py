"""Which media a worker offers, which are installed here, and which sink each one lands at.

A *medium* is a registered transport (:mod:`topkv.transport.catalog`). A worker offers the
real ones its host has: ``tcp`` and ``shm`` always, ``nixl`` and ``mooncake`` when their
packages load (``scripts/install-peers.sh``), ``cuda`` on a GPU host; it lists them in its
registration (:attr:`~topkv.relay.workers.WorkerCapabilities.media`). The emulated media
(``emulated-<mode>``) ride on ``shm`` or ``tcp``, so a worker serves each one whose carrier it
serves. Probing ``cuda`` imports torch, so it is probed only where an NVIDIA device node
exists or when asked for by name.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from glob import glob

from topkv.errors import ConfigError
from topkv.relay.workers import WorkerInfo
from topkv.transport import catalog as transports
from topkv.transport.arena.factory import ARENA_TRANSPORTS, missing_package, register_all
from topkv.transport.arena.protocol import INSTALL_HINT
from topkv.transport.errors import TransportUnavailable
from topkv.transport.media import SAME_HOST_MEDIA
from topkv.transport.shm import ShmSink

#: Every real medium a worker can offer, in the order it lists them.
KNOWN_MEDIA: tuple[str, ...] = ("tcp", "shm", *ARENA_TRANSPORTS)

#: Device nodes whose presence means an NVIDIA GPU may be usable (Linux, WSL).
_GPU_NODES = ("/dev/nvidiactl", "/dev/nvidia[0-9]*", "/dev/dxg")


def parse_media(text: str) -> tuple[str, ...] | None:
    """``tcp,shm,nixl`` -> names (known, deduplicated, in :data:`KNOWN_MEDIA` order);
    empty text -> None (every medium installed here)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        return None
    unknown = [n for n in names if n not in KNOWN_MEDIA]
    if unknown:
        raise ConfigError(
            f"--media: unknown medium {', '.join(unknown)}; choose from {', '.join(KNOWN_MEDIA)}"
        )
    return tuple(m for m in KNOWN_MEDIA if m in names)


def why_unavailable(medium: str) -> str | None:
    """None when ``medium`` can run on this host, else why not and how to get it."""
    if medium == "tcp":
        return None
    if medium == "shm":
        return None if os.path.isdir("/dev/shm") else "shm: /dev/shm is not mounted"
    if medium not in ARENA_TRANSPORTS:
        return f"{medium}: not a medium ({', '.join(KNOWN_MEDIA)})"
    if medium == "cuda" and not any(glob(pattern) for pattern in _GPU_NODES):
        return "cuda: no NVIDIA GPU device (/dev/nvidia*) on this host; the medium needs a GPU"
    try:
        return missing_package(medium)
    except (ImportError, OSError) as exc:  # a broken package, e.g. its parent fails to load
        return f"{medium}: its Python package does not load ({exc}; {INSTALL_HINT})"


def unavailable_error(medium: str, reason: str, flag: str = "--media") -> ConfigError:
    """The error for asking for a medium this host lacks (the CLI exits 2 with it)."""
    hint = "" if INSTALL_HINT in reason or medium in ("cuda", "shm") else f" ({INSTALL_HINT})"
    return ConfigError(f"{flag} {medium}: not available on this host: {reason}{hint}")


@dataclass(frozen=True)
class MediaOffer:
    """The real media a worker serves, and why each other known medium is absent."""

    media: tuple[str, ...]
    unavailable: dict[str, str] = field(default_factory=dict)


def resolve_media(requested: Sequence[str] | None, *, shm: bool = True) -> MediaOffer:
    """What a worker offers: ``requested`` (each must be installed, else ConfigError naming
    it and how to install it), or with None every medium installed here (``shm`` only if
    ``shm``)."""
    if requested is not None and not shm and "shm" in requested:
        raise ConfigError("--media shm contradicts --no-shm")
    candidates = list(KNOWN_MEDIA if requested is None else requested)
    if not shm:
        candidates = [m for m in candidates if m != "shm"]
    offered: list[str] = []
    unavailable: dict[str, str] = {}
    for medium in candidates:
        reason = why_unavailable(medium)
        if reason is None:
            offered.append(medium)
        elif requested is not None:
            raise unavailable_error(medium, reason)
        else:
            unavailable[medium] = reason
    if not offered:
        raise ConfigError("a worker needs at least one medium (--media)")
    return MediaOffer(tuple(offered), unavailable)


def register_arena_media(media: Iterable[str], host: str) -> None:
    """Register the arena media (nixl, mooncake, cuda) among ``media`` (sinks bound to
    ``host``)."""
    names = [m for m in media if m in ARENA_TRANSPORTS]
    if names:
        register_all(host=host, names=names, available_only=True)


def sink_medium(medium: str) -> str:
    """The real medium whose sink ``medium``'s bytes arrive at (``emulated-*`` ride on
    ``shm`` or ``tcp``); TransportUnavailable for an unknown name."""
    if medium in KNOWN_MEDIA:
        return medium
    info = transports.get(medium)
    return "shm" if info.make_sink is ShmSink else "tcp"


def served_media(info: WorkerInfo) -> frozenset[str]:
    """The real media a registered worker serves (a registration without a media list,
    from before they were listed, serves tcp and, if it says so, shm)."""
    caps = info.capabilities
    if caps.media:
        return frozenset(caps.media)
    return frozenset(m for m, on in (("tcp", caps.tcp), ("shm", caps.shm)) if on)


def same_host(source: WorkerInfo, destination: WorkerInfo) -> bool:
    """Do the two registrations name one OS host (an empty ``host_id`` names none)?"""
    return bool(source.host_id) and source.host_id == destination.host_id


def check_medium(medium: str, source: WorkerInfo, destination: WorkerInfo) -> str | None:
    """None when ``medium`` can move bytes from ``source`` to ``destination``, else why not."""
    try:
        carrier = sink_medium(medium)
    except TransportUnavailable as exc:
        return str(exc)
    for worker in (source, destination):
        served = served_media(worker)
        if carrier not in served:
            return (
                f"{worker.worker_id} does not offer {carrier} "
                f"(it offers {', '.join(sorted(served)) or 'nothing'})"
            )
    if carrier in SAME_HOST_MEDIA and not same_host(source, destination):
        return (
            f"{medium} needs one host; {source.worker_id} (on {source.host_id or '?'}) and "
            f"{destination.worker_id} (on {destination.host_id or '?'}) are on different hosts"
        )
    return None


def check_medium_name(medium: str) -> None:
    """ConfigError unless ``medium`` names a real or an emulated medium."""
    try:
        sink_medium(medium)
    except TransportUnavailable:
        emulated = sorted(n for n in transports.available() if n.startswith("emulated-"))
        raise ConfigError(
            f"no medium {medium!r}; choose from {', '.join([*KNOWN_MEDIA, *emulated])}"
        ) from None
