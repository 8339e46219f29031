"""A vLLM instance registers with TopKV's registry like any worker, from a daemon thread.

The connector runs inside vLLM's worker process, which has no event loop of ours: the
registrar (``service.registrar.open_registrar``, what ``topkv worker`` uses: the
orchestrator's ``/v1/workers`` for an ``http(s)://`` URL, the etcd lease itself for
``etcd://``) runs on its own loop in a daemon thread, registers, heartbeats every
``ttl_s / 3`` and registers again when the record is gone (the registry restarted, the
lease ran out).

The connector's worker half runs in a vLLM process below the API server (``VLLM::Worker``
under ``VLLM::EngineCore`` under the API server, or in the engine process itself). When the
API server dies (SIGKILL, OOM), those live on, orphaned, and would keep heartbeating a
registration whose ``api_url`` no longer answers. So the thread watches the chain of parents
up to the API server (:func:`api_server_chain`): once a link breaks it deregisters the
instance and sends SIGTERM to the process that lost its parent (vLLM's engine shuts down
its workers on it), within ``ttl_s / 3``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading

from topkv.relay.registry.etcd_access import is_etcd_url
from topkv.relay.workers import WorkerInfo
from topkv.service.errors import ServiceError
from topkv.service.worker.registrar import open_registrar

log = logging.getLogger(__name__)

#: How a vLLM API server's command line reads (``python -m vllm.entrypoints...``, ``vllm serve``).
_API_SERVER_MARKS = (b"vllm.entrypoints", b"vllm serve", b"vllm\x00serve", b"VLLM::APIServer")


def _parent_of(pid: int) -> int | None:
    """``pid``'s parent (None: no such process, or no /proc)."""
    try:
        stat = open(f"/proc/{pid}/stat", "rb").read()  # noqa: SIM115  # one read
    except OSError:
        return None
    fields = stat.rsplit(b")", 1)[-1].split()
    return int(fields[1]) if len(fields) > 1 else None


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def api_server_chain(pid: int | None = None, depth: int = 4) -> list[tuple[int, int]]:
    """The (process, parent) links from ``pid`` (this process) up to the vLLM API server
    that runs it; empty when no API server is found within ``depth`` parents (then nothing
    is watched)."""
    chain: list[tuple[int, int]] = []
    child = os.getpid() if pid is None else pid
    for _ in range(depth):
        parent = _parent_of(child)
        if parent is None or parent <= 1:
            return []
        chain.append((child, parent))
        if any(mark in _cmdline(parent) for mark in _API_SERVER_MARKS):
            return chain
        child = parent
    return []


def broken_link(chain: list[tuple[int, int]]) -> int | None:
    """The first process of ``chain`` whose parent is no longer the one recorded (None:
    the chain is whole)."""
    for child, parent in chain:
        if _parent_of(child) != parent:
            return child
    return None


class BackgroundRegistration:
    def __init__(self, url: str, token: str | None, info: WorkerInfo, ttl_s: float = 6.0) -> None:
        self.info = info
        self.ttl_s = ttl_s
        etcd = is_etcd_url(url)
        self._registrar = open_registrar("" if etcd else url, url if etcd else "", token)
        self._chain = api_server_chain()
        self.orphaned: int | None = None  # the process that lost its parent
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
            self.orphaned = broken_link(self._chain)
            if self.orphaned is not None:
                log.warning(
                    "topkv: %s: the vLLM API server (pid %d) is gone; deregistering and "
                    "stopping the orphaned engine (pid %d)",
                    self.info.worker_id, self._chain[-1][1], self.orphaned,
                )  # fmt: skip
                break
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
        if self.orphaned is not None:
            with contextlib.suppress(OSError):
                os.kill(self.orphaned, signal.SIGTERM)
            await asyncio.sleep(20)  # still here: vLLM did not shut down
            os.kill(os.getpid(), signal.SIGKILL)

    def close(self, timeout_s: float = 5.0) -> None:
        """Deregister and stop the thread (bounded)."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout_s)
