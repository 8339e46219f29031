"""The orchestrator's live view of the workers, kept current by a registry watch.

On :meth:`LiveWorkerView.start` the view lists the registry (so a restarted orchestrator
rebuilds everything from the registry alone) and then applies every join, update and leave
as it happens. Registry callbacks may arrive on a backend thread (etcd); they are handed to
the event loop, or applied at once when they already run on it (the memory registry).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from topkv.relay.registry.memory import WorkerRegistry
from topkv.relay.workers import RegistryEvent, Role, WorkerInfo

LeaveListener = Callable[[str], None]
ChangeListener = Callable[[RegistryEvent], None]


class LiveWorkerView:
    """Worker records by id, mirrored from a :class:`WorkerRegistry`."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self._registry = registry
        self._workers: dict[str, WorkerInfo] = {}
        self._listeners: list[ChangeListener] = []
        self._cancel_watch: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self.version = 0
        self._sorted: dict[Role | None, tuple[int, list[WorkerInfo]]] = {}

    async def start(self) -> None:
        """Watch first (so nothing is missed), then list the registry."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._cancel_watch = await asyncio.to_thread(self._registry.watch, self._on_event)
        infos = await asyncio.to_thread(self._registry.workers)
        for info in infos:
            self._apply(RegistryEvent("join", info.worker_id, info))

    def stop(self) -> None:
        cancel, self._cancel_watch = self._cancel_watch, None
        if cancel is not None:
            cancel()

    def subscribe(self, listener: ChangeListener) -> None:
        """Call ``listener`` (on the event loop) after each applied change."""
        self._listeners.append(listener)

    def get(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.get(worker_id)

    def alive(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def workers(self, role: Role | None = None) -> list[WorkerInfo]:
        """Workers sorted by id (cached until the next change; do not mutate the list)."""
        cached = self._sorted.get(role)
        if cached is None or cached[0] != self.version:
            infos = sorted(self._workers.values(), key=lambda i: i.worker_id)
            cached = (self.version, [i for i in infos if role is None or i.role == role])
            self._sorted[role] = cached
        return cached[1]

    def _on_event(self, event: RegistryEvent) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if threading.get_ident() == self._loop_thread:
            self._apply(event)
        else:
            loop.call_soon_threadsafe(self._apply, event)

    def _apply(self, event: RegistryEvent) -> None:
        if event.kind == "leave":
            if self._workers.pop(event.worker_id, None) is None:
                return
        elif event.info is not None:
            self._workers[event.worker_id] = event.info
        else:
            return
        self.version += 1
        for listener in list(self._listeners):
            listener(event)
