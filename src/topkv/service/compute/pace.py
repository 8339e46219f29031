"""Paced compute: each engine turn lasts C times its own CPU time (``--compute-pace C``).

On a test host several workers share a few cores, so a worker's compute slows down whenever
another computes. Paced, every engine turn is held (still holding the model) until
``wall_start + C * cpu_used``, so each worker behaves as its own device, C times slower than a
core. :class:`ComputePacer` holds turns and layers, :class:`PaceStats` counts turns and
overruns (:class:`PaceCollector` exports them), :func:`check_pace` and
:func:`check_torch_threads` check the settings. Why and how: docs/demo.md ("Paced compute").
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from topkv.errors import ConfigError

Clock = Callable[[], float]


def check_pace(value: float | None) -> float | None:
    """``--compute-pace``: None (off) or a finite float >= 1; :class:`ConfigError` else."""
    if value is None:
        return None
    if math.isnan(value):
        raise ConfigError("--compute-pace must be a number >= 1, got nan")
    if math.isinf(value):
        raise ConfigError(f"--compute-pace must be finite, got {value}")
    if value < 1:
        raise ConfigError(
            f"--compute-pace must be >= 1 (a turn cannot last less than its own compute), "
            f"got {value}"
        )
    return float(value)


def check_torch_threads(threads: int) -> None:
    """Paced compute counts the calling thread's CPU time: torch must compute on it alone."""
    if threads != 1:
        raise ConfigError(
            f"--compute-pace counts the engine thread's CPU time, so torch must run one "
            f"intra-op thread (give --torch-threads 1); it runs {threads}"
        )


@dataclass(frozen=True)
class PaceStats:
    """A worker's paced turns so far: how many, how many overran, by how much in all, how
    long the turns were held in all, and how long they lasted in all (wall, holds included:
    the emulated device's busy time; ``overrun_s / busy_s`` is the share of it the host
    could not hold to the pace)."""

    turns: int = 0
    overruns: int = 0
    overrun_s: float = 0.0
    held_s: float = 0.0
    busy_s: float = 0.0

    def minus(self, earlier: PaceStats) -> PaceStats:
        """The turns since ``earlier`` (a snapshot of the same counters)."""
        return PaceStats(
            self.turns - earlier.turns,
            self.overruns - earlier.overruns,
            self.overrun_s - earlier.overrun_s,
            self.held_s - earlier.held_s,
            self.busy_s - earlier.busy_s,
        )

    def plus(self, other: PaceStats) -> PaceStats:
        return PaceStats(
            self.turns + other.turns,
            self.overruns + other.overruns,
            self.overrun_s + other.overrun_s,
            self.held_s + other.held_s,
            self.busy_s + other.busy_s,
        )

    def as_json(self) -> dict[str, float | int]:
        return {
            "turns": self.turns,
            "overruns": self.overruns,
            "overrun_s": round(self.overrun_s, 6),
            "held_s": round(self.held_s, 6),
            "busy_s": round(self.busy_s, 6),
        }

    @classmethod
    def of(cls, payload: object) -> PaceStats:
        """From :meth:`as_json`'s keys (a worker's answer); ValueError if they are not there."""
        if not isinstance(payload, dict):
            raise ValueError(f"compute pace stats must be an object, got {payload!r}")
        try:
            return cls(
                int(payload["turns"]),
                int(payload["overruns"]),
                float(payload["overrun_s"]),
                float(payload["held_s"]),
                float(payload["busy_s"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"compute pace stats {payload!r}: {exc}") from None


@dataclass(frozen=True)
class PaceMark:
    """Where a turn began: its wall clock and its thread's CPU clock."""

    wall_s: float
    cpu_s: float


class ComputePacer:
    """Holds each turn until ``C`` times its CPU time passed (module docstring).

    The clocks and the sleep are injected so a test can be exact: ``cpu_clock`` is the
    calling thread's CPU time (``time.thread_time``), ``wall_clock`` a monotonic clock
    (``time.perf_counter``), ``sleep`` waits (``time.sleep``).
    """

    def __init__(
        self,
        pace: float,
        *,
        cpu_clock: Clock = time.thread_time,
        wall_clock: Clock = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        checked = check_pace(pace)
        assert checked is not None
        self.pace = checked
        self._cpu = cpu_clock
        self._wall = wall_clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._stats = PaceStats()

    def start(self) -> PaceMark:
        """A turn begins on the calling thread (it just got the model)."""
        return PaceMark(self._wall(), self._cpu())

    def hold(self, mark: PaceMark) -> None:
        """Inside the turn begun at ``mark``: wait until ``C`` times its CPU time so far
        passed (before a layer is published)."""
        held = self._wait_until(mark.wall_s + self.pace * (self._cpu() - mark.cpu_s))
        if held:
            with self._lock:
                s = self._stats
                self._stats = replace(s, held_s=s.held_s + held)

    def end(self, mark: PaceMark) -> None:
        """The turn begun at ``mark`` computed its last: hold it until ``C`` times its CPU
        time passed, or count an overrun if its wall time is already past that."""
        cpu, wall = self._cpu() - mark.cpu_s, self._wall()
        due = mark.wall_s + self.pace * cpu
        late = wall - due
        held = 0.0 if late > 0 else self._wait_until(due)
        with self._lock:
            s = self._stats
            self._stats = PaceStats(
                s.turns + 1,
                s.overruns + (late > 0),
                s.overrun_s + max(0.0, late),
                s.held_s + held,
                s.busy_s + (wall + held - mark.wall_s),
            )

    def _wait_until(self, due: float) -> float:
        """Sleep until the wall clock reads ``due``; the seconds slept."""
        began = now = self._wall()
        while now < due:
            self._sleep(due - now)
            now = self._wall()
        return now - began

    def stats(self) -> PaceStats:
        with self._lock:
            return self._stats

    def describe(self) -> dict[str, object]:
        """``GET /v1/info`` ``engine.compute_pace``."""
        return {"pace": self.pace, "clock": "thread_time", **self.stats().as_json()}


class PaceCollector(Collector):
    """``GET /metrics``: a paced engine's turns and overruns."""

    def __init__(self, pacer: ComputePacer) -> None:
        self.pacer = pacer

    def collect(self) -> Iterator[Metric]:
        s = self.pacer.stats()
        pace = GaugeMetricFamily("topkv_engine_compute_pace", "each turn lasts C x its CPU time")
        pace.add_metric([], self.pacer.pace)
        yield pace
        for name, doc, value in (
            ("topkv_engine_paced_turns", "engine turns held to the compute pace", s.turns),
            ("topkv_engine_pace_overruns", "turns whose wall time exceeded C x CPU", s.overruns),
            ("topkv_engine_pace_overrun_seconds", "wall time past C x CPU, summed", s.overrun_s),
            ("topkv_engine_pace_held_seconds", "time turns were held, summed", s.held_s),
            ("topkv_engine_paced_busy_seconds", "wall time of the paced turns", s.busy_s),
        ):
            family = CounterMetricFamily(name, doc)
            family.add_metric([], value)
            yield family
