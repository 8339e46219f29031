"""A local cluster of demo worker processes, started and always torn down together.

:class:`DemoCluster` spawns one process per :class:`~topkv.demo.topology.Placement`
(multiprocessing ``forkserver``: the server imports torch once, each worker builds the
model itself), waits until each has
reported ``Ready`` (with its sinks' addresses), and on :meth:`close` - also on errors and
Ctrl-C, since it is a context manager - asks every worker to stop, waits a little, then
terminates and finally kills what is left, and joins all of them: no orphans. Workers also
exit on their own if this process dies (they watch their parent).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import secrets
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from topkv.demo.errors import DemoError, WorkerFailed
from topkv.demo.protocol import DemoWorkerConfig, Event, Failed, Ready, Stop
from topkv.demo.topology import Placement
from topkv.demo.worker import worker_main
from topkv.engine.spec import DemoModelConfig

#: Heavy modules the fork server imports before forking workers.
WORKER_PRELOAD = ("torch", "transformers", "topkv.engine.models", "topkv.engine.prefill")


def check_shared_clock() -> None:
    """Refuse to run where ``perf_counter`` is not one system-wide monotonic clock."""
    info = time.get_clock_info("perf_counter")
    if "CLOCK_MONOTONIC" not in info.implementation:
        raise DemoError(
            f"time.perf_counter is {info.implementation}, not CLOCK_MONOTONIC: timestamps "
            "of different processes would not be comparable (the demo needs Linux)"
        )


class DemoCluster:
    """Worker processes for the demo; use as a context manager."""

    def __init__(
        self,
        placements: Sequence[Placement],
        *,
        model: DemoModelConfig,
        seed: int,
        model_path: str | None = None,
        startup_timeout_s: float = 120.0,
    ) -> None:
        check_shared_clock()
        self.placements = list(placements)
        # A fork server imports torch and transformers once; every worker is forked from it
        # (single-threaded, so forking is safe), which saves each worker a cold import.
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(["topkv.demo.worker", *WORKER_PRELOAD])
        self.events: Any = self._context.Queue()
        self.inboxes: dict[str, Any] = {p.worker_id: self._context.Queue() for p in placements}
        self.processes: dict[str, Any] = {}
        self.ready: dict[str, Ready] = {}
        self._secret = secrets.token_bytes(32)
        self._model = model
        self._seed = seed
        self._model_path = model_path
        self._startup_timeout_s = startup_timeout_s
        self._closed = False

    def __enter__(self) -> DemoCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> None:
        decode_inboxes = {
            p.worker_id: self.inboxes[p.worker_id] for p in self.placements if p.role == "decode"
        }
        for placement in self.placements:
            config = DemoWorkerConfig(
                worker_id=placement.worker_id,
                role=placement.role,
                main_pid=os.getpid(),
                secret=self._secret,
                model=self._model,
                seed=self._seed,
                model_path=self._model_path,
            )
            process = self._context.Process(
                target=worker_main,
                args=(config, self.inboxes[placement.worker_id], self.events, decode_inboxes),
                name=f"topkv-demo-{placement.worker_id}",
                daemon=True,
            )
            process.start()
            self.processes[placement.worker_id] = process
        deadline = time.monotonic() + self._startup_timeout_s
        while len(self.ready) < len(self.placements):
            event = self.next_event(timeout=max(0.1, deadline - time.monotonic()))
            if event is None:
                if time.monotonic() >= deadline:
                    missing = sorted(set(self.processes) - set(self.ready))
                    raise WorkerFailed(f"workers {', '.join(missing)} did not start in time")
                continue
            if isinstance(event, Failed):
                raise WorkerFailed(f"{event.worker_id} failed to start: {event.message}")
            if isinstance(event, Ready):
                self.ready[event.worker_id] = event
        models = {r.model_id for r in self.ready.values()}
        if len(models) != 1:
            raise WorkerFailed(f"workers loaded different models: {sorted(models)}")

    def send(self, worker_id: str, message: object) -> None:
        self.inboxes[worker_id].put(message)

    def next_event(self, timeout: float) -> Event | None:
        """The next event from any worker, or None after ``timeout`` seconds.

        Raises :class:`WorkerFailed` when a worker process has died.
        """
        try:
            event: Event = self.events.get(timeout=timeout)
        except queue.Empty:
            self._check_alive()
            return None
        return event

    def _check_alive(self) -> None:
        for worker_id, process in self.processes.items():
            if not process.is_alive():
                raise WorkerFailed(
                    f"worker {worker_id} (pid {process.pid}) exited with status {process.exitcode}"
                )

    def close(self, grace_s: float = 5.0) -> None:
        """Stop every worker: ask, then terminate, then kill; join all (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for worker_id, process in self.processes.items():
            if process.is_alive():
                with contextlib.suppress(Exception):
                    self.inboxes[worker_id].put(Stop())
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes.values():
            if process.is_alive():
                process.terminate()
                process.join(2.0)
            if process.is_alive():
                process.kill()
                process.join(2.0)
        for q in (self.events, *self.inboxes.values()):
            q.close()
            q.cancel_join_thread()

    def pids(self) -> dict[str, int]:
        return {worker_id: int(p.pid) for worker_id, p in self.processes.items()}
