"""The orchestrator's side of leader election: who leads, the follower's 503, the epoch.

With ``--leader-elect`` several orchestrators share one registry and campaign through a
:class:`~topkv.relay.leader.base.LeaderBackend`; only the one acting as leader accepts mutating
requests (every method but GET/HEAD/OPTIONS). A follower answers them 503 ``not_leader``
with the leader's id and address (in the body and the ``X-TopKV-Leader`` header), so a
client retries there. ``GET /v1/leader`` answers ``{"leader", "epoch", "self"}`` (plus
``leader_address`` and ``acting``) to any caller.

Once leading with epoch N, the executor sends N on every worker call (``service.fencing``);
it keeps sending N after losing leadership, so the workers refuse what a deposed leader
still tries once its successor has driven them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.typedefs import Handler

from topkv.relay.leader.base import Candidate, ElectionTiming, LeaderBackend, LeaderRecord
from topkv.relay.leader.loop import LeaderElection
from topkv.service.orchestrator.executor import RemoteExecutor

log = logging.getLogger(__name__)

LEADER_HEADER = "X-TopKV-Leader"
_READ_ONLY = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True)
class LeaderElectConfig:
    """``backend``: the lock; ``identity``: this candidate's unique id; ``advertise_url``:
    where clients are sent when it leads (None: the URL it serves on)."""

    backend: LeaderBackend
    identity: str
    timing: ElectionTiming = field(default_factory=ElectionTiming)
    advertise_url: str | None = None


class Leadership:
    """Leader election for one orchestrator service (None config: it always leads)."""

    def __init__(self, config: LeaderElectConfig | None, executor: RemoteExecutor) -> None:
        self.config = config
        self.identity = config.identity if config is not None else "standalone"
        self.election: LeaderElection | None = None
        self._executor = executor

    def start(self, served_url: str) -> None:
        if self.config is None:
            return
        address = self.config.advertise_url or served_url
        self.election = LeaderElection(
            self.config.backend,
            Candidate(self.identity, address),
            self.config.timing,
            on_change=self._changed,
        )
        self.election.start()

    async def stop(self) -> None:
        if self.election is not None:
            await self.election.stop()

    def acting(self) -> bool:
        return self.election is None or self.election.acting()

    def _changed(self, acting: bool, record: LeaderRecord) -> None:
        if acting:
            self._executor.epoch = record.epoch

    def _view(self) -> dict[str, object]:
        if self.election is None:
            return {
                "leader": self.identity,
                "epoch": 0,
                "self": self.identity,
                "leader_address": None,
                "acting": True,
            }
        record = self.election.record
        acting = self.election.acting()
        holder = record.holder
        if acting:
            holder = self.identity
        elif holder == self.identity:
            holder = None  # its own claim, past the renew deadline: not leading
        return {
            "leader": holder,
            "epoch": record.epoch,
            "self": self.identity,
            "leader_address": record.address if holder is not None else None,
            "acting": acting,
        }

    async def leader(self, request: web.Request) -> web.Response:
        return web.json_response(self._view())

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method in _READ_ONLY or self.acting():
            return await handler(request)
        view = self._view()
        leader, address = view["leader"], view["leader_address"]
        where = f"{leader} at {address}" if leader is not None else "none elected yet"
        body = {
            "error": {
                "kind": "not_leader",
                "type": "NotLeader",
                "detail": f"this orchestrator ({self.identity}) is a follower; the leader is "
                f"{where}: send mutating requests there",
            },
            "leader": leader,
            "leader_address": address,
            "epoch": view["epoch"],
        }
        headers = {"Retry-After": "1"}
        if isinstance(address, str):
            headers[LEADER_HEADER] = address
        return web.json_response(body, status=503, headers=headers)
