"""The orchestrator service's Adaptive Decoder Pool (``topkv orchestrator --adp on``).

:class:`ServiceADP` runs a :class:`~topkv.relay.adp.LiveAdaptivePool` inside the
:class:`~topkv.service.orchestrator.api.OrchestratorService`: its submit path reports each
request's prompt tokens (:meth:`ServiceADP.arrived`), its decode stand-in each delivery
(:meth:`ServiceADP.delivered`, the TTFT), and it picks prefill sources from
:meth:`ServiceADP.prefill_workers` (converted workers included, drained ones not). The
pool ticks every ``tick_s`` while this orchestrator leads, and converts workers through the
service's :class:`~topkv.service.orchestrator.executor.RemoteExecutor` (``POST /v1/role``).

``GET /v1/adp`` (admin) answers :class:`AdpState`: the rush, each worker's stage, every
conversion (failed ones with the reason) and the rush periods, in ms since the service
started.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

from aiohttp import web
from pydantic import BaseModel, Field

from topkv.policy.adp.pool import ADPConfig
from topkv.relay.adp import LiveAdaptivePool
from topkv.relay.orchestrator import Orchestrator
from topkv.relay.transfers import TransferRecord
from topkv.relay.workers import Role, WorkerInfo
from topkv.service.orchestrator.executor import RemoteExecutor


class ConversionView(BaseModel):
    worker: str
    from_role: Role = Field(serialization_alias="from")
    to_role: Role = Field(serialization_alias="to")
    at_ms: float
    duration_ms: float | None = Field(description="decided to re-registered; null: it failed")
    fenced_ms: float = Field(description="fenced before, waiting for its KV to be acknowledged")
    worker_ms: float | None = None
    detail: str = ""


class AdpState(BaseModel):
    """``GET /v1/adp``."""

    enabled: bool
    in_rush: bool = False
    stages: dict[str, str] = Field(default_factory=dict)
    conversions: list[ConversionView] = Field(default_factory=list)
    rush_periods: list[list[float]] = Field(default_factory=list)


class ServiceADP:
    """The live ADP of one orchestrator service (module docstring)."""

    def __init__(
        self,
        orchestrator: Orchestrator,
        executor: RemoteExecutor,
        config: ADPConfig,
        *,
        tick_s: float = 1.0,
        acting: Callable[[], bool] | None = None,
    ) -> None:
        self.pool = LiveAdaptivePool(orchestrator, executor, config=config)
        self.tick_s = tick_s
        self._acting = acting

    def start(self) -> None:
        self.pool.start(self.tick_s, self._acting)

    async def stop(self) -> None:
        await self.pool.close()

    def arrived(self, prompt_tokens: int) -> None:
        self.pool.observe_arrival(prompt_tokens)

    def delivered(self, record: TransferRecord) -> None:
        self.pool.delivered(record)

    def prefill_workers(self) -> list[WorkerInfo]:
        return self.pool.prefill_workers()

    def state(self) -> AdpState:
        return AdpState(
            enabled=True,
            in_rush=self.pool.in_rush,
            stages=dict(self.pool.stage),
            conversions=[
                ConversionView.model_validate(dataclasses.asdict(c)) for c in self.pool.conversions
            ],
            rush_periods=self.pool.rush_periods_ms(),
        )


def adp_handler(adp: ServiceADP | None) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The ``GET /v1/adp`` handler: the state, or ``{"enabled": false}`` with ADP off."""

    async def handle(request: web.Request) -> web.Response:
        state = adp.state() if adp is not None else AdpState(enabled=False)
        return web.Response(
            body=state.model_dump_json(by_alias=True),
            content_type="application/json",
        )

    return handle
