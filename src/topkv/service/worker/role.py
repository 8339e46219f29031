"""A worker changes pools: ``POST /v1/role`` (the Adaptive Decoder Pool's conversions).

The orchestrator's live ADP (:mod:`topkv.relay.adp`) converts a decode worker to prefill in
a rush and back when it ends. On the worker a conversion is:

1. a safety check: a worker holding KV not yet acknowledged (a send in flight, a receive
   announced and not taken, a prefilled KV its destination has not verified) is never
   converted: ``409`` kind ``busy``, nothing changed. A drained copy landing on it
   (``keep`` false: a measurement, verified and released on arrival whatever the worker's
   role, as the demo's baseline copies) holds no request's KV and does not count. A
   decode worker turning prefill keeps the decode sequences it holds (received KV) only
   up to ``reserved_slots`` (the chunked prefill reserve); more is ``409`` too, unless
   ``drain`` asks to wait (at most ``drain_timeout_s``) for decode to release them;
2. the new mode: ``prefill`` on a native decode worker runs chunked prefill
   (``chunk_tokens`` per chunk, ``reserved_slots`` decode slots kept), ``decode`` clears it;
3. re-registration under the new role with the same worker id (the registry's ``update``:
   memory and etcd keep the lease, the orchestrator's HTTP registry replaces the record),
   so the orchestrator's view moves the worker to the other pool.

The answer says what changed and how long the worker took (``seconds``). The same role
again is a no-op (``changed`` false).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from topkv.relay.workers import Role, WorkerInfo
from topkv.service.compute.engines import PrefillPlan
from topkv.service.http.util import error_response, model_response, read_model
from topkv.service.kvstore import KVStore
from topkv.service.messages import ChunkedPrefill, RoleAnswer, RoleRequest

#: How often a draining conversion looks again at the decode sequences held.
_DRAIN_POLL_S = 0.02


class Convertible(Protocol):
    """What a conversion needs of the worker
    (:class:`~topkv.service.worker.service.WorkerService`)."""

    worker_id: str
    store: KVStore
    info: WorkerInfo | None

    def transfers_in_flight(self) -> tuple[int, int]:
        """Sends in flight, and receives announced and not yet taken that it will keep."""
        ...

    async def reregister(self, info: WorkerInfo) -> None:
        """Replace the worker's registration with ``info`` (same worker id)."""
        ...


@dataclass(frozen=True)
class Busy:
    """What keeps a worker from converting now (all zero: it may)."""

    sending: int
    receiving: int
    prefilled: int

    @property
    def unacked(self) -> int:
        return self.sending + self.receiving + self.prefilled

    def describe(self) -> str:
        return (
            f"{self.sending} send(s) in flight, {self.receiving} receive(s) pending, "
            f"{self.prefilled} prefilled KV not yet released by its destination"
        )


class RoleSwitch:
    """The worker's pool membership and the ``/v1/role`` handler (module docstring)."""

    def __init__(self, service: Convertible, native: Role) -> None:
        self._service = service
        self.native: Role = native
        self.chunked: ChunkedPrefill | None = None
        self._lock = asyncio.Lock()

    def busy(self) -> Busy:
        s = self._service
        prefilled = sum(1 for kv in s.store.all() if kv.origin == "prefill")
        sending, receiving = s.transfers_in_flight()
        return Busy(sending, receiving, prefilled)

    def chunk(self, plan: PrefillPlan) -> PrefillPlan:
        """``plan`` as this worker runs it: chunked while it is a converted decode worker."""
        if self.chunked is None:
            return plan
        return dataclasses.replace(plan, chunk_tokens=self.chunked.chunk_tokens)

    def held_decode(self) -> int:
        return sum(1 for kv in self._service.store.all() if kv.origin == "received")

    async def handle(self, request: web.Request) -> web.Response:
        body = await read_model(request, RoleRequest)
        async with self._lock:  # one conversion at a time
            return await self._convert(body)

    async def _convert(self, body: RoleRequest) -> web.Response:
        s = self._service
        info = s.info
        assert info is not None
        started = time.perf_counter()
        previous: Role = info.role
        if body.role == previous:
            return self._answer(previous, False, started)
        busy = self.busy()
        if busy.unacked:
            return _busy(f"worker {s.worker_id} holds KV not yet acknowledged: {busy.describe()}")
        if body.role == "prefill":
            refused = await self._fit_reserve(body)
            if refused is not None:
                return refused
        # a registry failure is a ServiceError, answered 500 by the worker's middleware
        await s.reregister(info.model_copy(update={"role": body.role}))
        if body.role == "prefill" and self.native == "decode":
            self.chunked = ChunkedPrefill(
                chunk_tokens=body.chunk_tokens, reserved_slots=body.reserved_slots
            )
        else:
            self.chunked = None
        return self._answer(previous, True, started)

    async def _fit_reserve(self, body: RoleRequest) -> web.Response | None:
        """None once the decode sequences held fit the reserve; else the 409 answer."""
        deadline = time.perf_counter() + (body.drain_timeout_s if body.drain else 0.0)
        while (held := self.held_decode()) > body.reserved_slots:
            if time.perf_counter() >= deadline:
                how = f"within {body.drain_timeout_s} s" if body.drain else "(drain not asked)"
                return _busy(
                    f"worker {self._service.worker_id} holds {held} decode sequences, more "
                    f"than the {body.reserved_slots} chunked prefill keeps {how}"
                )
            await asyncio.sleep(_DRAIN_POLL_S)
        return None

    def _answer(self, previous: Role, changed: bool, started: float) -> web.Response:
        info = self._service.info
        assert info is not None
        return model_response(
            RoleAnswer(
                worker_id=info.worker_id,
                native=self.native,
                previous=previous,
                role=info.role,
                changed=changed,
                seconds=time.perf_counter() - started,
                kept_decode=self.held_decode(),
                chunked_prefill=self.chunked,
            )
        )

    async def current(self, request: web.Request) -> web.Response:
        """``GET /v1/role``: the pool it serves now, its native one, its prefill mode."""
        info = self._service.info
        assert info is not None
        return self._answer(info.role, False, time.perf_counter())


def _busy(detail: str) -> web.Response:
    return error_response(409, "busy", detail, "WorkerBusy")
