"""The front door's Adaptive Decoder Pool: ``kv_both`` vLLM instances move between pools.

:class:`FrontDoorADP` runs the policy of :mod:`topkv.policy.adp.pool` on what the front door
sees, applies its plans to the picker's pools (:meth:`FrontDoorADP.workers`) and records each
move in the registry through a :class:`RoleWriter`; :func:`front_door_adp` builds it from
:class:`AdpOptions`. How and why: docs/vllm.md ("Adaptive Decoder Pool over ``kv_both``
instances").
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from topkv.errors import ConfigError, TopKVError
from topkv.policy.adp.pool import DEFAULT_ADP, ADPConfig, ConversionPlan, WorkerView
from topkv.policy.clock import Clock, MonotonicClock
from topkv.relay.adp import PREFILL_STAGES, Conversion, ConversionFailed, ConversionTasks
from topkv.relay.registry.base import WorkerRegistry
from topkv.relay.workers import Role, WorkerInfo
from topkv.service.orchestrator.adp import AdpState, ConversionView
from topkv.service.orchestrator.registrations import Registrations
from topkv.service.worker.registrar import HttpRegistrar

log = logging.getLogger(__name__)


class RoleWriter(Protocol):
    """Rewrites an instance's registry record with another role."""

    async def write(self, info: WorkerInfo, role: Role) -> None:
        """Raises a :class:`~topkv.errors.TopKVError` when the registry refuses."""
        ...


class EmbeddedRoleWriter:
    """The front door's embedded registry: the instance's own registration is updated (its
    lease and its worker token's ownership stay as they are)."""

    def __init__(self, registrations: Registrations) -> None:
        self.registrations = registrations

    async def write(self, info: WorkerInfo, role: Role) -> None:
        registration = self.registrations.by_worker.get(info.worker_id)
        if registration is None:
            raise ConversionFailed(f"{info.worker_id} holds no registration here")
        registration.update(info.model_copy(update={"role": role}))


class OrchestratorRoleWriter:
    """An orchestrator's registry: the record is registered again (``POST /v1/workers``)
    with the instances' worker token, so the instance's own heartbeats (same token) keep
    renewing it; then the front door's view is refreshed."""

    def __init__(
        self,
        url: str,
        worker_token: str | None,
        refresh: Callable[[], Any],
        ttl_s: float = 6.0,
    ) -> None:
        self.url = url
        self.worker_token = worker_token
        self.refresh = refresh
        #: The connector's lease (:class:`~.registration.BackgroundRegistration`'s default).
        self.ttl_s = ttl_s

    async def write(self, info: WorkerInfo, role: Role) -> None:
        registrar = HttpRegistrar(self.url, self.worker_token)
        try:
            await registrar.update(info.model_copy(update={"role": role}), self.ttl_s)
        finally:
            await registrar.close()
        refreshed = self.refresh()
        if asyncio.iscoroutine(refreshed):
            await refreshed


def prompt_tokens(body: Mapping[str, Any]) -> int:
    """A request's prompt tokens as far as the front door knows them: a token-id prompt's
    length, else its text's UTF-8 bytes over 4 (a text prompt, chat messages), at least 1."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list):
        text = "".join(p for p in prompt if isinstance(p, str))
    elif isinstance(prompt, str):
        text = prompt
    else:
        messages = body.get("messages")
        text = "".join(str(m.get("content", "")) for m in messages or () if isinstance(m, dict))
    return max(1, len(text.encode()) // 4)


class Ticket:
    """One request's marks in the pools' load (:meth:`FrontDoorADP.admit`); every method is
    a no-op without an ADP. :meth:`close` takes back whatever is still marked."""

    def __init__(self, adp: FrontDoorADP | None) -> None:
        self._adp = adp
        self._queued = adp is not None
        self._prefill: str | None = None
        self._decode: str | None = None
        self._unacked: tuple[str, ...] = ()
        self._decoding: str | None = None

    def routed(self, prefill: str, decode: str) -> None:
        """The prefill instance runs the prompt, streaming its KV to ``decode``."""
        if self._adp is None:
            return
        self._release_route()
        self._prefill, self._decode = prefill, decode
        self._unacked = (prefill, decode)
        self._adp.prefilling[prefill] += 1
        self._adp.unacked.update(self._unacked)

    def prefilled(self) -> None:
        """The prefill call answered: out of the prefill queue."""
        if self._adp is None:
            return
        if self._prefill is not None:
            self._adp.prefilling[self._prefill] -= 1
            self._prefill = None
        if self._queued:
            self._adp.queued -= 1
            self._queued = False

    def answered(self, ttft_s: float) -> None:
        """The decode instance answered (its KV loaded, the first token out): a TTFT."""
        if self._adp is None or self._decode is None:
            return
        self._adp.unacked.subtract(self._unacked)
        self._unacked = ()
        self._decoding, self._decode = self._decode, None
        self._adp.decoding[self._decoding] += 1
        self._adp.pool.observe_ttft(ttft_s)

    def _release_route(self) -> None:
        assert self._adp is not None
        if self._prefill is not None:
            self._adp.prefilling[self._prefill] -= 1
        self._adp.unacked.subtract(self._unacked)
        if self._decoding is not None:
            self._adp.decoding[self._decoding] -= 1
        self._prefill = self._decode = self._decoding = None
        self._unacked = ()

    def close(self) -> None:
        if self._adp is None:
            return
        self._release_route()
        if self._queued:
            self._adp.queued -= 1
            self._queued = False
        self._adp = None


class FrontDoorADP(ConversionTasks):
    """The ADP over the front door's instances (module docstring).

    ``movable``: the ids of the ``kv_both`` instances (native decode). ``clock`` drives the
    policy, ``timer`` measures the moves (both monotonic by default)."""

    close_grace_s = 5.0  # a move is a registry write, no worker restarts

    def __init__(
        self,
        registry: WorkerRegistry,
        writer: RoleWriter,
        movable: Collection[str],
        metrics: CollectorRegistry,
        *,
        config: ADPConfig = DEFAULT_ADP,
        clock: Clock | None = None,
        timer: Clock | None = None,
        registry_wait_s: float = 10.0,
    ) -> None:
        super().__init__(
            config, clock or MonotonicClock(), metrics, timer=timer, registry_wait_s=registry_wait_s
        )
        self.registry = registry
        self.writer = writer
        self.movable = frozenset(movable)
        #: Load, by instance: prefill calls running, KV not yet acknowledged to or from it,
        #: decode answers and streams it serves; requests whose prefill is not done.
        self.prefilling: Counter[str] = Counter()
        self.unacked: Counter[str] = Counter()
        self.decoding: Counter[str] = Counter()
        self.queued = 0
        self._rewriting: set[str] = set()

    # -- what the router calls ---------------------------------------------------------------

    def admit(self, body: Mapping[str, Any]) -> Ticket:
        """A request arrived: its prompt tokens observed, it joins the prefill queue."""
        self.pool.observe_arrival(prompt_tokens(body))
        self.queued += 1
        return Ticket(self)

    def pool_of(self, info: WorkerInfo) -> Role | None:
        """The pool ``info`` takes new work in now (None: neither, while it moves)."""
        wid = info.worker_id
        if wid not in self.movable:
            return info.role
        stage = self.stage.get(wid)
        if stage is None:
            return "decode"
        return "prefill" if stage == "converted" else None

    def workers(self, role: Role) -> list[WorkerInfo]:
        """The registered instances that take new ``role`` work now (what the picker uses)."""
        return [w for w in self.registry.workers() if self.pool_of(w) == role]

    # -- the tick ----------------------------------------------------------------------------

    def views(self) -> list[WorkerView]:
        out = []
        for info in self.registry.workers():
            wid = info.worker_id
            if wid not in self.movable:
                if info.role == "prefill":
                    out.append(WorkerView(wid, "prefill", "prefill", 0, 0, self.unacked[wid]))
                else:  # a plain decode instance: counted, never moved (module docstring)
                    out.append(
                        WorkerView(
                            wid, "decode", "decode", self.decoding[wid], info.capacity,
                            unacked_kv=self.unacked[wid], convertible=False,
                        )
                    )  # fmt: skip
                continue
            stage = self.stage.get(wid)
            out.append(
                WorkerView(
                    wid,
                    "decode",
                    "prefill" if stage in PREFILL_STAGES else "decode",
                    self.decoding[wid],
                    info.capacity,
                    unacked_kv=self.unacked[wid],
                    prefilling=self.prefilling[wid] > 0 or stage in ("converting", "returning"),
                    fenced=stage == "fenced",
                )
            )
        return out

    async def tick(self) -> ConversionPlan:
        """One update: the signals, the plan, the plan applied (moves start as tasks)."""
        plan = self.pool.update(max(self.queued, 0), self.views())
        self._apply(plan)
        self._reconcile()
        self._gauges()
        return plan

    def _reconcile(self) -> None:
        """A moved instance whose record shows another role (it registered again with its
        native one) is written again; a movable instance gone from the registry is forgotten."""
        live = {w.worker_id: w for w in self.registry.workers()}
        for wid in list(self.stage):
            if wid not in live and self.stage[wid] in ("fenced", "converted", "draining"):
                del self.stage[wid]
        for wid, info in live.items():
            if wid not in self.movable or wid in self._rewriting:
                continue
            stage = self.stage.get(wid)
            if stage in ("converted", "draining") and info.role != "prefill":
                self._spawn(self._rewrite(info, "prefill"))
            elif stage in (None, "fenced") and info.role != "decode":
                self._spawn(self._rewrite(info, "decode"))  # a move this front door forgot

    async def _rewrite(self, info: WorkerInfo, role: Role) -> None:
        self._rewriting.add(info.worker_id)
        try:
            await self.writer.write(info, role)
        except TopKVError as exc:
            log.warning("router adp: rewriting %s as %s: %s", info.worker_id, role, exc)
        finally:
            self._rewriting.discard(info.worker_id)

    def _gauges(self) -> None:
        m = self.metrics
        m.rush.set(1 if self.pool.in_rush else 0)
        m.pool.labels("prefill").set(len(self.workers("prefill")))
        m.pool.labels("decode").set(len(self.workers("decode")))
        m.converted.set(sum(1 for s in self.stage.values() if s in PREFILL_STAGES))

    # -- moves -------------------------------------------------------------------------------

    def _registered(self, worker_id: str) -> WorkerInfo | None:
        return self.registry.get(worker_id)

    async def _switch(self, info: WorkerInfo, role: Role) -> float:
        """The instance's record rewritten with ``role`` (the :class:`RoleWriter`), done when
        the registry the front door reads shows it; returns the write's seconds."""
        started = self.timer.now()
        await self.writer.write(info, role)
        written = self.timer.now()
        await self._shown(info.worker_id, role)
        return written - started

    async def _shown(self, worker_id: str, role: Role) -> None:
        """Until the registry the front door reads shows ``worker_id`` as ``role``."""
        deadline = self.timer.now() + self.registry_wait_s
        while True:
            info = self.registry.get(worker_id)
            if info is not None and info.role == role:
                return
            if self.timer.now() > deadline:
                raise self._not_shown(worker_id, role)
            await asyncio.sleep(0.02)

    def _record(self, conversion: Conversion) -> None:
        """Counted and kept (:class:`ConversionTasks`), and logged."""
        super()._record(conversion)
        c = conversion
        if c.ok:
            log.info(
                "router adp: %s %s -> %s in %.1f ms",
                c.worker,
                c.from_role,
                c.to_role,
                c.duration_ms,
            )
        else:
            log.warning("router adp: moving %s to %s failed: %s", c.worker, c.to_role, c.detail)

    # -- state and lifecycle -----------------------------------------------------------------

    def state(self) -> AdpState:
        """``GET /v1/adp`` on the front door: the orchestrator's shape (:class:`AdpState`)."""
        now = self.clock.now()
        return AdpState(
            enabled=True,
            in_rush=self.pool.in_rush,
            stages=dict(self.stage),
            conversions=[
                ConversionView.model_validate(dataclasses.asdict(c)) for c in self.conversions
            ],
            rush_periods=[
                [(s - self.origin_s) * 1000.0, ((now if e is None else e) - self.origin_s) * 1e3]
                for s, e in self.pool.rush_periods
            ],
        )

    def start(self, tick_s: float) -> None:
        """Tick every ``tick_s`` seconds on the running loop until :meth:`close`."""
        if self._ticker is None:
            self._ticker = asyncio.ensure_future(self._tick_loop(tick_s))

    async def _tick_loop(self, tick_s: float) -> None:
        while True:
            try:
                await self.tick()
            except TopKVError as exc:  # a bad observation: the next tick tries again
                log.warning("router adp: %s", exc)
            await asyncio.sleep(tick_s)


@dataclass(frozen=True)
class AdpOptions:
    """The front door's ADP (``topkv router --adp on``): the policy's thresholds, the
    ``kv_both`` instance ids, the instances' worker token (to rewrite their records at an
    orchestrator) and how often it ticks."""

    movable: frozenset[str]
    config: ADPConfig = DEFAULT_ADP
    worker_token: str | None = None
    tick_s: float = 0.5


def front_door_adp(
    options: AdpOptions,
    registry: WorkerRegistry,
    registrations: Registrations,
    metrics: CollectorRegistry,
) -> FrontDoorADP:
    """The ADP over ``registry``: the embedded one (records updated in place) or an
    orchestrator's (records registered again there); etcd leases are the instances' own, so
    no front door can rewrite them: refused."""
    from topkv.integrations.vllm.frontdoor.remote_registry import (
        EtcdReadRegistry,
        OrchestratorRegistry,
    )

    writer: RoleWriter
    if isinstance(registry, EtcdReadRegistry):
        raise ConfigError(
            "--adp on with an etcd registry: the instances' records are their own leases; "
            "use the embedded registry or an orchestrator's"
        )
    if isinstance(registry, OrchestratorRegistry):
        writer = OrchestratorRoleWriter(registry.url, options.worker_token, registry.refresh)
    else:
        writer = EmbeddedRoleWriter(registrations)
    return FrontDoorADP(registry, writer, options.movable, metrics, config=options.config)
