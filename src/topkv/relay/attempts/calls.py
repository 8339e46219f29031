"""The executor calls the attempt loop and the handoff make, each bounded by
``executor_call_timeout_s`` (:class:`ExecutorCalls`)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable

from topkv.errors import TopKVError
from topkv.relay.attempts.bounded import bounded
from topkv.relay.context import RelayPart
from topkv.relay.executor import AttemptFailed, classify_failure
from topkv.relay.runs import Exhausted
from topkv.relay.transfers import FailureKind, TransferRecord
from topkv.relay.workers import WorkerInfo

log = logging.getLogger(__name__)


class ExecutorCalls(RelayPart):
    """Bounded source digest, probe, source release and copy discard."""

    async def source_digest(self, record: TransferRecord, source: WorkerInfo) -> int:
        """The digest of the KV ``source`` holds for ``record``; a failure ends the transfer
        (:class:`Exhausted`, as source lost unless the executor classifies it)."""
        call = self.executor.source_digest(source, record.request_id, record.layout)
        try:
            return await bounded(call, self.config.executor_call_timeout_s)
        except (AttemptFailed, TopKVError, TimeoutError) as exc:
            raise Exhausted(
                classify_failure(exc)
                if isinstance(exc, AttemptFailed)
                else FailureKind.SOURCE_LOST,
                str(exc) or exc.__class__.__name__,
            ) from exc

    async def probe(self, destination: WorkerInfo) -> bool:
        """Whether ``destination`` answers the executor's probe (False on any failure)."""
        try:
            return await bounded(
                self.executor.probe(destination), self.config.executor_call_timeout_s
            )
        except (TopKVError, TimeoutError, OSError):
            return False

    async def release_source(self, source: WorkerInfo, request_id: int) -> None:
        call = self.executor.release_source(source, request_id)
        await self._quietly(call, f"release of request {request_id} at {source.worker_id}")

    async def discard(self, destination: WorkerInfo, request_id: int) -> None:
        call = self.executor.discard_destination(destination, request_id)
        await self._quietly(call, f"discard of request {request_id} at {destination.worker_id}")

    async def _quietly(self, call: Awaitable[None], what: str) -> None:
        """``await call``, bounded; a failure is logged, not raised (nothing depends on it)."""
        try:
            await bounded(call, self.config.executor_call_timeout_s)
        except (TopKVError, TimeoutError, OSError) as exc:
            log.warning("%s failed: %s", what, exc)
