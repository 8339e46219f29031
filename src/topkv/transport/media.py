"""Which medium carries each path class, in one place.

The selection policy names *path classes* (``nvlink``, ``nvswitch``, ``xgmi``, ``pcie``,
``rdma``, ``tcp``); a *medium* is a registered transport (:mod:`topkv.transport.catalog`)
that moves the bytes. On one host the same-host classes ride on shared memory and every
other class on TCP; classes faster than host memory are emulated (paced shm), RDMA is
emulated over TCP (no RDMA hardware is assumed). An arena transport (``nixl``, ``cuda``)
serving a class is preferred where both ends offer it.

:func:`medium_for` is the one decision from a pair's path class to its medium, made the
same way by the orchestrator's executor and the vLLM connector; it is pure (the caller
passes its judge of a medium between the pair's two ends).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

#: The real medium under each same-host path class (every other class rides on ``tcp``).
MEDIUM_FOR_MODE: Mapping[str, str] = {
    "nvlink": "shm",
    "nvswitch": "shm",
    "pcie": "shm",
    "xgmi": "shm",
}

#: Registered medium serving each path class by default: NVLink-class paths are emulated
#: (paced shared memory), PCIe-class same-host paths are real shared memory, RDMA is
#: emulated over TCP, TCP is real.
DEFAULT_MEDIA: Mapping[str, str] = {
    "nvlink": "emulated-nvlink",
    "nvswitch": "emulated-nvswitch",
    "xgmi": "emulated-nvlink",
    "pcie": "shm",
    "rdma": "emulated-rdma",
    "tcp": "tcp",
}


def real_medium(path_class: str) -> str:
    """``shm`` or ``tcp``: the real medium under ``path_class`` between processes of one host."""
    return MEDIUM_FOR_MODE.get(path_class, "tcp")


#: Arena media (:mod:`topkv.transport.arena`) that serve a path class, preferred in this
#: order over the class's own medium when both ends offer one.
ARENA_MEDIA_FOR_PATH: Mapping[str, tuple[str, ...]] = {
    "rdma": ("nixl",),
    "nvlink": ("cuda",),
    "nvswitch": ("cuda",),
}

#: Real media whose two ends must be on one OS host.
SAME_HOST_MEDIA = frozenset({"shm", "cuda"})

#: ``check(medium)``: None when ``medium`` can join the pair's two ends, else why not.
MediumCheck = Callable[[str], str | None]


@dataclass(frozen=True)
class MediumChoice:
    """The medium that serves a pair's path class (None: none), and each candidate refused
    before it, with why, in the order they were tried."""

    medium: str | None
    refused: tuple[tuple[str, str], ...] = ()

    def why_refused(self, medium: str) -> str | None:
        """Why ``medium`` was refused (None: it was not tried, or it won)."""
        return next((why for name, why in self.refused if name == medium), None)


def candidate_media(
    path_class: str,
    offers: Collection[str] | None,
    same_host: bool,
    *,
    own: Sequence[str],
    allowed: Sequence[str] | None = None,
) -> list[str]:
    """The media that may serve ``path_class``, in the order they are tried.

    The arena media serving the class (:data:`ARENA_MEDIA_FOR_PATH`) come first, then the
    class's ``own`` media (the caller's default for the class, and its fallbacks). With
    ``offers`` (the real media a caller can run) only those stay, and across hosts
    (``same_host`` false) none of :data:`SAME_HOST_MEDIA`; with None every medium stays
    for the caller's check to judge (it also knows what an ``emulated-*`` medium rides on).
    ``allowed`` (a request's restriction) keeps only its media, this order first, then the
    allowed ones not among them.
    """
    order: list[str] = []
    for medium in (*ARENA_MEDIA_FOR_PATH.get(path_class, ()), *own):
        if medium in order:
            continue
        if offers is not None and (
            medium not in offers or (not same_host and medium in SAME_HOST_MEDIA)
        ):
            continue
        order.append(medium)
    if allowed is not None:
        order = [m for m in order if m in allowed] + [m for m in allowed if m not in order]
    return order


def medium_for(
    path_class: str,
    offers: Collection[str] | None,
    same_host: bool,
    check: MediumCheck,
    *,
    own: Sequence[str],
    allowed: Sequence[str] | None = None,
    forced: str | None = None,
) -> MediumChoice:
    """The medium that carries a pair's ``path_class`` path: the first candidate
    (:func:`candidate_media`) that ``check`` accepts; a ``forced`` medium is the only
    candidate, whatever the class. Pure: ``check`` is the caller's judge of a medium between
    the pair's two ends (e.g. :func:`topkv.service.worker.media.check_medium`)."""
    if forced is not None:
        order = [forced]
    else:
        order = candidate_media(path_class, offers, same_host, own=own, allowed=allowed)
    refused: list[tuple[str, str]] = []
    for medium in order:
        problem = check(medium)
        if problem is None:
            return MediumChoice(medium, tuple(refused))
        refused.append((medium, problem))
    return MediumChoice(None, tuple(refused))
