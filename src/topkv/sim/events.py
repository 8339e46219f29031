"""The event core: a heap-ordered calendar of callbacks in simulated seconds.

Two interchangeable loops implement :class:`EventLoop`: :class:`HeapLoop`, a plain
``heapq`` calendar (the default, chosen because it measured several times faster than SimPy
on this workload; see ``docs/simulator.md``), and :class:`SimPyLoop`, the same interface on
top of ``simpy.Environment`` kept for the comparison benchmark. Both expose ``now()`` so a
loop is also the clock injected into the shared policies.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any, Protocol

import simpy

Callback = Callable[..., None]


class EventLoop(Protocol):
    """What the simulator needs from an event core."""

    def now(self) -> float:
        """Current simulated time in seconds."""
        ...

    def call_at(self, when: float, callback: Callback, *args: Any) -> None:
        """Run ``callback(*args)`` at simulated time ``when`` (>= now)."""
        ...

    def run(self, until: float = math.inf) -> None:
        """Process events in time order until none are left or ``until`` is reached."""
        ...

    @property
    def events_processed(self) -> int:
        """Number of callbacks run so far."""
        ...


class HeapLoop:
    """A minimal calendar queue: ``(time, sequence, callback, args)`` tuples in a heap.

    Ties are broken by insertion order, so runs are deterministic.
    """

    __slots__ = ("_heap", "_now", "_processed", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callback, tuple[Any, ...]]] = []
        self._now = 0.0
        self._seq = 0
        self._processed = 0

    def now(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callback, *args: Any) -> None:
        if when < self._now:
            when = self._now
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, callback, args))

    def run(self, until: float = math.inf) -> None:
        heap = self._heap
        pop = heapq.heappop
        processed = 0
        while heap:
            if heap[0][0] > until:
                self._now = until
                break
            when, _seq, callback, args = pop(heap)
            self._now = when
            callback(*args)
            processed += 1
        self._processed += processed

    @property
    def events_processed(self) -> int:
        return self._processed


class SimPyLoop:
    """The :class:`EventLoop` interface on top of ``simpy.Environment`` (for comparison)."""

    def __init__(self) -> None:
        self._env = simpy.Environment()
        self._processed = 0

    def now(self) -> float:
        return float(self._env.now)

    def call_at(self, when: float, callback: Callback, *args: Any) -> None:
        delay = max(0.0, when - float(self._env.now))
        event = self._env.timeout(delay)

        def fire(_event: simpy.Event) -> None:
            self._processed += 1
            callback(*args)

        event.callbacks.append(fire)

    def run(self, until: float = math.inf) -> None:
        if math.isinf(until):
            self._env.run()
        else:
            self._env.run(until=until)

    @property
    def events_processed(self) -> int:
        return self._processed


def make_loop(kind: str) -> EventLoop:
    """Return a fresh event loop: ``"heap"`` (default) or ``"simpy"``."""
    if kind == "heap":
        return HeapLoop()
    if kind == "simpy":
        return SimPyLoop()
    from topkv.sim.errors import SimError

    raise SimError(f"unknown event core {kind!r}; use 'heap' or 'simpy'")
