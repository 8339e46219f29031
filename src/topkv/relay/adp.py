"""The Adaptive Decoder Pool, live: the orchestrator's side of :mod:`topkv.policy.adp.pool`.

:class:`LiveAdaptivePool` runs the policy object the simulator runs (:mod:`topkv.sim.adp`)
on what the orchestrator sees (arrivals, TTFTs, the prefill queue, one ``WorkerView`` per
worker) and applies its plans to real workers: it fences them, converts them through a
:class:`RoleSwitcher` (``POST /v1/role``), drains them, and records each
:class:`Conversion`. How and why: docs/adp.md ("Live, in the orchestrator").
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from prometheus_client import CollectorRegistry

from topkv.errors import TopKVError
from topkv.policy.adp.pool import (
    DEFAULT_ADP,
    AdaptiveDecoderPool,
    ADPConfig,
    ConversionPlan,
    WorkerView,
)
from topkv.policy.clock import Clock, MonotonicClock
from topkv.relay.metrics import AdpMetrics
from topkv.relay.orchestrator import Orchestrator
from topkv.relay.transfers import TransferRecord
from topkv.relay.workers import RegistryEvent, Role, WorkerInfo

#: Where a native decode worker is in its conversions (absent: serving decode).
Stage = Literal["fenced", "converting", "converted", "draining", "returning"]

#: Stages in which a native decode worker counts as serving prefill (the policy's role).
PREFILL_STAGES: frozenset[Stage] = frozenset({"converting", "converted", "draining", "returning"})


class RoleSwitcher(Protocol):
    """Tells a worker to serve another pool (implemented over HTTP by the service's
    :class:`~topkv.service.orchestrator.executor.RemoteExecutor`)."""

    async def set_role(
        self, worker: WorkerInfo, role: Role, *, chunk_tokens: int, reserved_slots: int
    ) -> float:
        """Convert ``worker``; returns the worker's own seconds. Raises a
        :class:`~topkv.errors.TopKVError` when it refuses or cannot be reached."""
        ...


class ConversionFailed(TopKVError):
    """A conversion did not finish (the worker refused, died or never re-registered)."""


#: The keys of one conversion in :meth:`LiveAdaptivePool.report` (``Conversion.to_json``).
REPORT_KEYS = ("worker", "from", "to", "at_ms", "duration_ms")


@dataclass(frozen=True)
class Conversion:
    """One conversion: which worker, which way, when (ms since the pool's origin), how long."""

    worker: str
    from_role: Role
    to_role: Role
    at_ms: float
    #: Decided to re-registered in the other pool (None: it failed).
    duration_ms: float | None
    #: The worker's own share (checks and re-registration), ms.
    worker_ms: float | None = None
    #: How long it was fenced before (waiting for its KV to be acknowledged), ms.
    fenced_ms: float = 0.0
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.duration_ms is not None

    def to_json(self) -> dict[str, object]:
        """``{"worker", "from", "to", "at_ms", "duration_ms"}`` (the demo's contract)."""
        values = (self.worker, self.from_role, self.to_role, self.at_ms, self.duration_ms)
        return dict(zip(REPORT_KEYS, values, strict=True))


class ConversionTasks(ABC):
    """What the orchestrator's :class:`LiveAdaptivePool` and the vLLM front door's pool share:
    the policy's plan applied through :func:`apply_plan`; each conversion run in the
    background (:meth:`_convert`), timed, counted and recorded the same way; the ticker; and
    how they stop. A subclass says how a worker is found (:meth:`_registered`) and moved
    (:meth:`_switch`), what its gauges show (:meth:`_gauges`) and, where its router keeps a
    fence of its own, tells it in :meth:`_fence`.

    ``clock`` drives the policy and stamps ``at_ms`` and the rush periods; ``timer``
    measures conversion durations (default monotonic, so a manual policy clock still reports
    real durations); ``origin_s``: the ``clock`` time ``at_ms`` counts from (default: now);
    ``registry_wait_s``: the longest a conversion waits for the registry to show the
    worker's new role; ``metrics``: where the ADP's metrics (:class:`AdpMetrics`) go."""

    #: how long :meth:`close` waits past ``registry_wait_s`` for a conversion in progress
    close_grace_s: float = 35.0

    def __init__(
        self,
        config: ADPConfig,
        clock: Clock,
        metrics: CollectorRegistry,
        *,
        timer: Clock | None = None,
        origin_s: float | None = None,
        registry_wait_s: float = 10.0,
    ) -> None:
        self.config = config
        self.clock = clock
        self.timer: Clock = timer or MonotonicClock()
        self.origin_s = self.clock.now() if origin_s is None else origin_s
        self.registry_wait_s = registry_wait_s
        self.pool = AdaptiveDecoderPool(clock, config)
        self.metrics = AdpMetrics(metrics)
        self.conversions: list[Conversion] = []
        self.stage: dict[str, Stage] = {}
        self._fenced_at: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._ticker: asyncio.Task[None] | None = None

    @property
    def in_rush(self) -> bool:
        return self.pool.in_rush

    def _apply(self, plan: ConversionPlan) -> None:
        apply_plan(
            plan,
            self.stage,
            self._fenced_at,
            in_rush=self.pool.in_rush,
            now=self.timer.now(),
            start=self._start,
            fence=self._fence,
        )

    def _fence(self, worker_id: str, fenced: bool = True) -> None:  # noqa: B027 (optional hook)
        """Stop (or resume) routing new decode work to ``worker_id``; by default nothing to
        tell: a picker that reads :attr:`stage` itself needs no separate fence."""

    @abstractmethod
    def _registered(self, worker_id: str) -> WorkerInfo | None:
        """``worker_id``'s registration as this pool's registry shows it now."""

    @abstractmethod
    async def _switch(self, info: WorkerInfo, role: Role) -> float:
        """Move ``info`` to ``role`` until the registry shows it there; returns the seconds
        of the move's own share. Raises a :class:`~topkv.errors.TopKVError` on failure."""

    @abstractmethod
    def _gauges(self) -> None:
        """Set the pool gauges (``topkv_adp_rush``, ``topkv_adp_pool_workers``, ...)."""

    def _not_shown(self, worker_id: str, role: Role) -> ConversionFailed:
        return ConversionFailed(
            f"{worker_id} did not show up as {role} in the registry within {self.registry_wait_s} s"
        )

    def _start(self, worker_id: str, from_role: Role, to_role: Role) -> None:
        """Begin moving ``worker_id`` (its stage is already ``converting`` or ``returning``)."""
        self._spawn(self._convert(worker_id, from_role, to_role))

    async def _convert(self, worker_id: str, from_role: Role, to_role: Role) -> None:
        """One conversion: ``at_ms`` on the policy's clock, its duration (decided to shown in
        the other pool) and how long it was fenced before on ``timer``; then its stage: back
        to decode (unfenced), or ``converted``."""
        at_ms = (self.clock.now() - self.origin_s) * 1000.0
        started = self.timer.now()
        fenced_at = self._fenced_at.pop(worker_id, None)
        fenced_ms = 0.0 if fenced_at is None else (started - fenced_at) * 1000.0
        try:
            info = self._registered(worker_id)
            if info is None:
                raise ConversionFailed(f"{worker_id} is no longer registered")
            own_s = await self._switch(info, to_role)
        except TopKVError as exc:
            self._failed(worker_id, from_role, to_role, at_ms, str(exc))
            return
        duration_ms = (self.timer.now() - started) * 1000.0
        if to_role == "decode":
            self.stage.pop(worker_id, None)
            self._fence(worker_id, False)
        else:
            self.stage[worker_id] = "converted"
        self.metrics.seconds.labels(to_role).observe(duration_ms / 1000.0)
        self._record(
            Conversion(worker_id, from_role, to_role, at_ms, duration_ms, own_s * 1000.0, fenced_ms)
        )
        self._gauges()

    def _failed(
        self, worker_id: str, from_role: Role, to_role: Role, at_ms: float, why: str
    ) -> None:
        self._record(Conversion(worker_id, from_role, to_role, at_ms, None, detail=why))
        if self._registered(worker_id) is None or to_role == "prefill":
            # gone (its registration left: what was in flight to it is rerouted), or
            # still a decode worker: it serves decode again, the policy may retry
            self.stage.pop(worker_id, None)
            self._fence(worker_id, False)
        else:  # still serving prefill: converted, to be converted back on a later tick
            self.stage[worker_id] = "converted"
        self._gauges()

    def _record(self, conversion: Conversion) -> None:
        """``conversion`` counted (``topkv_conversions_total`` or its failures) and kept."""
        done = self.metrics.conversions if conversion.ok else self.metrics.failures
        done.labels(conversion.from_role, conversion.to_role).inc()
        self.conversions.append(conversion)

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run ``coroutine`` in the background, until it ends or :meth:`close` waits for it."""
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settle(self, timeout_s: float = 30.0) -> None:
        """Wait for the conversions in progress to finish (or fail)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)

    async def close(self) -> None:
        """Stop ticking and wait (bounded) for conversions in progress."""
        ticker, self._ticker = self._ticker, None
        if ticker is not None:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
        await self.settle(self.registry_wait_s + self.close_grace_s)


class LiveAdaptivePool(ConversionTasks):
    """The ADP applied to one running :class:`Orchestrator` (module docstring).

    ``clock`` drives the policy and stamps ``at_ms`` and the rush periods (default the
    orchestrator's); ``timer``, ``origin_s`` (where the report's milliseconds count from)
    and ``registry_wait_s``: :class:`ConversionTasks`.
    """

    def __init__(
        self,
        orchestrator: Orchestrator,
        switcher: RoleSwitcher,
        *,
        config: ADPConfig = DEFAULT_ADP,
        clock: Clock | None = None,
        timer: Clock | None = None,
        origin_s: float | None = None,
        registry_wait_s: float = 10.0,
    ) -> None:
        super().__init__(
            config,
            clock or orchestrator.clock,
            orchestrator.metrics.registry,
            timer=timer,
            origin_s=origin_s,
            registry_wait_s=registry_wait_s,
        )
        self.orchestrator = orchestrator
        self.switcher = switcher
        self.native: dict[str, Role] = {}
        self._waiters: dict[str, tuple[Role, asyncio.Future[None]]] = {}
        orchestrator.view.subscribe(self._on_event)

    # -- observations ------------------------------------------------------------------------

    def observe_arrival(self, prompt_tokens: float) -> None:
        """A request of ``prompt_tokens`` prompt tokens arrived."""
        self.pool.observe_arrival(prompt_tokens)

    def observe_ttft(self, seconds: float) -> None:
        """A first token came out ``seconds`` after its request arrived."""
        self.pool.observe_ttft(seconds)

    def delivered(self, record: TransferRecord) -> None:
        """``record``'s KV reached decode: its first token is out (TTFT on the orchestrator's
        clock, from its submission)."""
        self.observe_ttft(max(0.0, self.orchestrator.clock.now() - record.submitted_at))

    # -- the tick ----------------------------------------------------------------------------

    def views(self) -> list[WorkerView]:
        """The policy's view of every registered worker now."""
        touching: Counter[str] = Counter()
        sourcing: Counter[str] = Counter()
        for record in self.orchestrator.transfers.active():
            touching[record.source] += 1
            sourcing[record.source] += 1
            if record.destination is not None and record.destination != record.source:
                touching[record.destination] += 1
        out = []
        for info in self.orchestrator.view.workers():
            wid = info.worker_id
            native = self.native.setdefault(wid, info.role)
            if native == "prefill":
                out.append(WorkerView(wid, "prefill", "prefill", 0, 0, touching[wid]))
                continue
            stage = self.stage.get(wid)
            as_prefill = stage in PREFILL_STAGES
            out.append(
                WorkerView(
                    wid,
                    "decode",
                    "prefill" if as_prefill else "decode",
                    self.orchestrator.delivered_to(wid),
                    info.capacity,
                    unacked_kv=touching[wid],
                    prefilling=stage in ("converting", "returning")
                    or (as_prefill and sourcing[wid] > 0),
                    fenced=stage == "fenced",
                )
            )
        return out

    async def tick(self, queue_depth: int | None = None) -> ConversionPlan:
        """One ADP update: signals, plan, and the plan applied (conversions start as tasks).

        ``queue_depth``: the prefill queue depth (default: requests accepted by the
        orchestrator and not yet delivered)."""
        depth = self.orchestrator.transfers.active_count if queue_depth is None else queue_depth
        plan = self.pool.update(depth, self.views())
        self._apply(plan)
        self._gauges()
        return plan

    def _fence(self, worker_id: str, fenced: bool = True) -> None:
        self.orchestrator.fence(worker_id, fenced)

    def _gauges(self) -> None:
        m = self.metrics
        m.rush.set(1 if self.pool.in_rush else 0)
        decode = [
            w for w in self.orchestrator.view.workers("decode") if w.worker_id not in self.stage
        ]
        m.pool.labels("prefill").set(len(self.prefill_workers()))
        m.pool.labels("decode").set(len(decode))
        m.converted.set(sum(1 for s in self.stage.values() if s in PREFILL_STAGES))

    # -- conversions -------------------------------------------------------------------------

    def _registered(self, worker_id: str) -> WorkerInfo | None:
        return self.orchestrator.view.get(worker_id)

    async def _switch(self, info: WorkerInfo, role: Role) -> float:
        """The worker converts itself (:class:`RoleSwitcher`) and re-registers; done when
        the orchestrator's view shows it as ``role``. Returns the worker's own seconds."""
        registered: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[info.worker_id] = (role, registered)
        try:
            worker_s = await self.switcher.set_role(
                info,
                role,
                chunk_tokens=self.config.chunk_tokens,
                reserved_slots=self.config.reserved_slots(info.capacity),
            )
            try:
                await asyncio.wait_for(asyncio.shield(registered), self.registry_wait_s)
            except TimeoutError:
                raise self._not_shown(info.worker_id, role) from None
        finally:
            self._waiters.pop(info.worker_id, None)
        return worker_s

    def _on_event(self, event: RegistryEvent) -> None:
        waiting = self._waiters.get(event.worker_id)
        if waiting is None:
            if event.kind == "leave" and self.stage.pop(event.worker_id, None) is not None:
                self.orchestrator.fence(event.worker_id, False)  # gone: forget its fence
            return
        role, future = waiting
        if future.done():
            return
        if event.kind == "leave":
            future.set_exception(ConversionFailed(f"{event.worker_id} left the registry"))
        elif event.info is not None and event.info.role == role:
            future.set_result(None)

    # -- what callers read -------------------------------------------------------------------

    def prefill_workers(self) -> list[WorkerInfo]:
        """Registered prefill workers that take new prefill work now (draining and
        returning converted workers left out): where callers pick prefill sources."""
        return [
            w
            for w in self.orchestrator.view.workers("prefill")
            if self.stage.get(w.worker_id) not in ("draining", "returning")
        ]

    def rush_periods_ms(self, now_s: float | None = None) -> list[list[float]]:
        """``[[start_ms, end_ms], ...]`` since the origin; a rush still on ends ``now``."""
        now = self.clock.now() if now_s is None else now_s
        return [
            [
                (start - self.origin_s) * 1000.0,
                ((now if end is None else end) - self.origin_s) * 1000.0,
            ]
            for start, end in self.pool.rush_periods
        ]

    def report(self, now_s: float | None = None) -> dict[str, object]:
        """``{"conversions": [{worker, from, to, at_ms, duration_ms}], "rush_periods":
        [[start_ms, end_ms], ...]}``: finished conversions and rushes, in ms since the
        origin (the ``"adp"`` key of ``topkv demo --adp on --json``)."""
        return {
            "conversions": [c.to_json() for c in self.conversions if c.ok],
            "rush_periods": self.rush_periods_ms(now_s),
        }

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, tick_s: float = 1.0, acting: Callable[[], bool] | None = None) -> None:
        """Tick every ``tick_s`` seconds (real time) on the running loop until :meth:`close`;
        with ``acting``, only while it says so (an orchestrator that leads)."""
        if self._ticker is None:
            self._ticker = asyncio.ensure_future(self._tick_loop(tick_s, acting))

    async def _tick_loop(self, tick_s: float, acting: Callable[[], bool] | None) -> None:
        while True:
            if acting is None or acting():
                await self.tick()
            await asyncio.sleep(tick_s)


def apply_plan(
    plan: ConversionPlan,
    stage: dict[str, Stage],
    fenced_at: dict[str, float],
    *,
    in_rush: bool,
    now: float,
    start: Callable[[str, Role, Role], None],
    fence: Callable[..., object],
) -> None:
    """Move each worker named by ``plan`` to its next stage; the one stage machine of the
    orchestrator's pool and the vLLM front door's.

    ``fence(worker_id)`` / ``fence(worker_id, False)`` tells the caller's router to stop or
    resume sending a worker decode work; ``start(worker_id, from_role, to_role)`` begins a
    conversion (its stage is already ``converting`` or ``returning``)."""
    for wid in plan.fence:
        if wid not in stage:
            stage[wid] = "fenced"
            fenced_at[wid] = now
            fence(wid)
    for wid in plan.unfence:
        if stage.get(wid) == "fenced":
            del stage[wid]
            fenced_at.pop(wid, None)
            fence(wid, False)
    for wid in plan.to_prefill:
        if stage.get(wid) in (None, "fenced"):
            stage[wid] = "converting"
            fence(wid)
            start(wid, "decode", "prefill")
    if in_rush:  # a new rush: drained workers serve prefill again
        for wid, now_stage in list(stage.items()):
            if now_stage == "draining":
                stage[wid] = "converted"
    for wid in plan.drain:
        if stage.get(wid) == "converted":
            stage[wid] = "draining"
    for wid in plan.to_decode:
        if stage.get(wid) in ("converted", "draining"):
            stage[wid] = "returning"
            start(wid, "prefill", "decode")
