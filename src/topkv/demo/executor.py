"""The demo's executor: the one :class:`~topkv.service.orchestrator.executor.RemoteExecutor`,
with the demo's hold on each prefill KV (the relay and the baselines both use it)."""

from __future__ import annotations

from typing import Any

from topkv.relay.executor import AttemptPlan, Delivery
from topkv.relay.transfers import FailureKind
from topkv.relay.workers import WorkerInfo
from topkv.service.orchestrator.executor import Pacing, RemoteExecutor
from topkv.transport.media import DEFAULT_MEDIA, real_medium

#: Who keeps a prefill worker's KV alive: the relay (until it released the source after a
#: verified delivery) and the demo's baselines (serial and replay copies).
HOLDERS = ("relay", "baselines")


class DemoExecutor(RemoteExecutor):
    """The one executor, holding each prefill KV until the relay *and* the baselines are
    done with it (the relay releases its source after a verified delivery; the baselines
    send the same KV again afterwards), and counting attempts."""

    def __init__(
        self, pacing: Pacing, timeout_s: float, token: str | None, pipelining: bool
    ) -> None:
        media = {path: real_medium(path) for path in DEFAULT_MEDIA}  # paced per send instead
        super().__init__(
            media,
            call_timeout_s=timeout_s,
            pacing=pacing,
            token=token,
            schedule="stream" if pipelining else "serial",
        )
        self.attempts = 0
        self._holders: dict[int, set[str]] = {}

    def hold(self, request_id: int) -> None:
        self._holders[request_id] = set(HOLDERS)

    async def transfer(self, plan: AttemptPlan) -> Delivery:
        self.attempts += 1
        return await super().transfer(plan)

    async def release_source(self, source: WorkerInfo, request_id: int) -> None:
        await self.release(source, request_id, "relay")

    async def release(self, source: WorkerInfo, request_id: int, holder: str) -> None:
        """``holder`` is done with ``request_id``'s KV; the worker frees it once all are."""
        holders = self._holders.get(request_id)
        if holders is None:
            return
        holders.discard(holder)
        if not holders:
            del self._holders[request_id]
            await super().release_source(source, request_id)

    async def worker_info(self, worker: WorkerInfo) -> Any:
        """``GET /v1/info`` of ``worker`` (its engine, counters, ...)."""
        return await self._call(
            worker, "GET", "/v1/info", None, self.call_timeout_s, FailureKind.DESTINATION_DIED
        )
