"""Decode slots: how many each decode worker has in use, routing's view of every decode
worker, and the event that wakes routing when a slot frees (:class:`DecodeSlots`)."""

from __future__ import annotations

import asyncio

from topkv.policy.route import DecodeWorkerView
from topkv.policy.view import Endpoint
from topkv.relay.liveview import LiveWorkerView
from topkv.relay.pairs import endpoint_of
from topkv.relay.runs import TransferRun
from topkv.relay.workers import WorkerInfo


class DecodeSlots:
    """Slot accounting of the decode workers in ``view``.

    A slot is reserved for a transfer when routing picks its destination (held by the
    run), belongs to the delivered KV after handoff (until decode releases it), and is
    freed on every other path. A decode worker that leaves takes its slots with it.
    """

    def __init__(self, view: LiveWorkerView) -> None:
        self.view = view
        self.used: dict[str, int] = {}
        # Request id -> the decode worker holding its delivered KV.
        self.delivered: dict[int, str] = {}
        # Decode workers as routing sees them, kept current on slot and registry changes.
        self.views: dict[str, DecodeWorkerView] = {}
        self.capacity_changed: asyncio.Event | None = None
        #: Decode workers routing sends nothing new to (the ADP fences one it converts).
        self.closed: set[str] = set()
        self._endpoints: dict[str, tuple[WorkerInfo, Endpoint]] = {}

    def open(self) -> None:
        self.capacity_changed = asyncio.Event()

    def used_by(self, worker_id: str) -> int:
        return self.used.get(worker_id, 0)

    def endpoint(self, info: WorkerInfo) -> Endpoint:
        """``info``'s endpoint (one object per registration)."""
        found = self._endpoints.get(info.worker_id)
        if found is None or found[0] is not info:
            found = self._endpoints[info.worker_id] = (info, endpoint_of(info))
        return found[1]

    def refresh(self, worker_id: str) -> None:
        """Rebuild routing's view of ``worker_id`` from its registration and slots."""
        info = self.view.get(worker_id)
        if info is None or info.role != "decode" or worker_id in self.closed:
            self.views.pop(worker_id, None)
            return
        used = self.used.get(worker_id, 0)
        self.views[worker_id] = DecodeWorkerView(
            worker_id=worker_id,
            endpoint=self.endpoint(info),
            free_slots=info.capacity - used,
            load=used / info.capacity if info.capacity else 1.0,
        )

    def reserve(self, run: TransferRun, worker_id: str) -> None:
        """``run`` now holds one slot of ``worker_id``."""
        self.used[worker_id] = self.used.get(worker_id, 0) + 1
        self.refresh(worker_id)
        run.slot_holder = worker_id

    def release(self, run: TransferRun) -> None:
        """Free the slot ``run`` holds, if any."""
        if run.slot_holder is not None:
            worker, run.slot_holder = run.slot_holder, None
            self.free(worker)

    def deliver(self, run: TransferRun, request_id: int) -> None:
        """The slot ``run`` holds now belongs to the delivered KV of ``request_id``."""
        if run.slot_holder is not None:
            self.delivered[request_id] = run.slot_holder
            run.slot_holder = None

    def release_delivered(self, request_id: int) -> bool:
        """Decode finished with ``request_id``: free its slot (False: it holds none)."""
        worker = self.delivered.pop(request_id, None)
        if worker is None:
            return False
        self.free(worker)
        return True

    def free(self, worker_id: str) -> None:
        used = self.used.get(worker_id, 0) - 1
        if used > 0:
            self.used[worker_id] = used
        else:
            self.used.pop(worker_id, None)
        self.refresh(worker_id)
        self.signal_capacity()

    def signal_capacity(self) -> None:
        event = self.capacity_changed
        if event is not None:
            event.set()
            self.capacity_changed = asyncio.Event()

    def left(self, worker_id: str) -> None:
        """``worker_id`` left: the delivered KV it held is gone with it, and so are its slots."""
        for request_id, worker in list(self.delivered.items()):
            if worker == worker_id:
                del self.delivered[request_id]
                self.used.pop(worker, None)
        self.views.pop(worker_id, None)
