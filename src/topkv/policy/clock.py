"""Injected time for policies.

Policies never read the wall clock themselves: the live runtime hands them a
:class:`MonotonicClock`, the simulator and the tests a :class:`ManualClock` that only moves
when told to. So a policy decides the same way in both, and tests never sleep.
"""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    """A source of time in seconds; only differences between readings are meaningful."""

    def now(self) -> float:
        """Current time in seconds."""
        ...


class MonotonicClock:
    """The live runtime's clock: :func:`time.monotonic`, immune to wall-clock steps."""

    def now(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told to (simulated time, tests)."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        """Move time forward by ``seconds`` (>= 0) and return the new time."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go backwards (advance by {seconds} s)")
        self._now += seconds
        return self._now

    def set(self, when: float) -> None:
        """Jump to an absolute time that is not earlier than the current one."""
        if when < self._now:
            raise ValueError(f"a clock cannot go backwards (from {self._now} s to {when} s)")
        self._now = float(when)
