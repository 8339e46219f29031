"""A vLLM instance registers with TopKV's registry like any worker, from a daemon thread.

The connector runs inside vLLM's worker process, which has no event loop of ours: the
registrar (``service.registrar.HttpRegistrar``, the same client ``topkv worker`` uses) runs
on its own loop in a daemon thread, registers, heartbeats every ``ttl_s / 3`` and registers
again when the record is gone (the registry restarted, the lease ran out).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

from topkv.relay.workers import WorkerInfo
from topkv.service.errors import ServiceError
from topkv.service.registrar import HttpRegistrar

log = logging.getLogger(__name__)


class BackgroundRegistration:
    def __init__(self, url: str, token: str | None, info: WorkerInfo, ttl_s: float = 6.0) -> None:
        self.info = info
        self.ttl_s = ttl_s
        self._registrar = HttpRegistrar(url, token)
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self.registered = threading.Event()
        self._thread = threading.Thread(target=self._run, name="topkv-registration", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        stop = self._stop = asyncio.Event()
        registered = False
        while not stop.is_set():
            try:
                if registered:
                    await self._registrar.heartbeat()
                else:
                    await self._registrar.register(self.info, self.ttl_s)
                    registered = True
                    self.registered.set()
                    log.info("topkv: registered %s (%s)", self.info.worker_id, self.info.role)
            except ServiceError as exc:
                log.warning("topkv: registration of %s: %s", self.info.worker_id, exc)
                registered = False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.ttl_s / 3)
        if registered:
            try:
                await self._registrar.deregister()
            except ServiceError as exc:
                log.warning("topkv: deregistering %s: %s", self.info.worker_id, exc)
        await self._registrar.close()

    def close(self, timeout_s: float = 5.0) -> None:
        """Deregister and stop the thread (bounded)."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout_s)
