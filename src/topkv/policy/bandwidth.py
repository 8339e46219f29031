"""Measured bandwidth per path: an EMA over completed transfers that fades when stale.

The runtime reports each completed transfer with :meth:`BandwidthEstimator.record`; the cost
policy asks :meth:`BandwidthEstimator.reading` for the figure to use: the measured EMA per
``(transport, links)`` while it is fresh, fading back to the path's nominal figure as it
ages (:class:`NominalBandwidth` reads nominal figures only). Time comes from the injected
:class:`~topkv.policy.clock.Clock`. The model: docs/policies.md ("Transport selection").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from topkv.policy.clock import Clock
from topkv.policy.errors import PolicyInputError
from topkv.policy.view import PathCandidate

BandwidthSource = Literal["nominal", "measured"]
PathKey = tuple[str, tuple[str, ...]]

#: Shortest data time a sample may claim, so a transfer that took no time after its setup
#: does not produce an infinite bandwidth.
_MIN_DATA_TIME_S = 1e-9


@dataclass(frozen=True)
class BandwidthReading:
    """The bandwidth to plan with, and where it came from."""

    gbps: float
    source: BandwidthSource
    samples: int = 0
    weight: float = 0.0  # share of the reading that comes from measurements, 0..1


class BandwidthReader(Protocol):
    """Anything that can say which bandwidth a candidate path has now."""

    def reading(self, candidate: PathCandidate) -> BandwidthReading: ...


class NominalBandwidth:
    """A reader that always returns the candidate's nominal bandwidth."""

    def __init__(self) -> None:
        # Readings are immutable and depend on the figure alone: hand out one per figure.
        self._readings: dict[float, BandwidthReading] = {}

    def reading(self, candidate: PathCandidate) -> BandwidthReading:
        gbps = candidate.bandwidth_gbps
        found = self._readings.get(gbps)
        if found is None:
            if len(self._readings) >= 1024:
                self._readings.clear()
            found = self._readings[gbps] = BandwidthReading(gbps=gbps, source="nominal")
        return found


def path_key(candidate: PathCandidate) -> PathKey:
    return (candidate.transport, candidate.links)


@dataclass
class _Ema:
    gbps: float
    updated_at: float
    samples: int


class BandwidthEstimator:
    """Per-path EMA of measured bandwidth with staleness decay back to the nominal figure."""

    def __init__(
        self,
        clock: Clock,
        *,
        alpha: float = 0.3,
        half_life_s: float = 30.0,
        min_weight: float = 0.01,
    ) -> None:
        if not 0.0 < alpha <= 1.0:
            raise PolicyInputError(f"EMA alpha {alpha} must be in (0, 1]")
        if not half_life_s > 0:
            raise PolicyInputError(f"staleness half-life {half_life_s} s must be > 0")
        if not 0.0 < min_weight < 1.0:
            raise PolicyInputError(f"min_weight {min_weight} must be in (0, 1)")
        self._clock = clock
        self.alpha = alpha
        self.half_life_s = half_life_s
        self.min_weight = min_weight
        self._state: dict[PathKey, _Ema] = {}

    def _weight(self, state: _Ema, now: float) -> float:
        age = max(0.0, now - state.updated_at)
        return float(2.0 ** (-age / self.half_life_s))

    def reading(self, candidate: PathCandidate) -> BandwidthReading:
        """The bandwidth to plan ``candidate`` with at the clock's current time."""
        key = path_key(candidate)
        state = self._state.get(key)
        if state is None:
            return BandwidthReading(gbps=candidate.bandwidth_gbps, source="nominal")
        weight = self._weight(state, self._clock.now())
        if weight < self.min_weight:
            del self._state[key]
            return BandwidthReading(gbps=candidate.bandwidth_gbps, source="nominal")
        nominal = candidate.bandwidth_gbps
        gbps = nominal + (state.gbps - nominal) * weight
        return BandwidthReading(gbps=gbps, source="measured", samples=state.samples, weight=weight)

    def record(
        self, candidate: PathCandidate, nbytes: int, duration_s: float, *, chunks: int = 1
    ) -> BandwidthReading:
        """Fold one completed transfer over ``candidate`` into its EMA; return the new reading.

        ``duration_s`` is the whole transfer's wall time (setup included); ``chunks`` is how
        many pieces it was sent in, each of which paid the path's setup latency.
        """
        if nbytes <= 0:
            raise PolicyInputError(f"a bandwidth sample needs a positive size, got {nbytes}")
        if not duration_s > 0:
            raise PolicyInputError(f"a bandwidth sample needs a positive duration: {duration_s}")
        if chunks < 1:
            raise PolicyInputError(f"a bandwidth sample needs at least one chunk, got {chunks}")
        data_time = max(duration_s - chunks * candidate.setup_latency_s, _MIN_DATA_TIME_S)
        sample_gbps = nbytes / data_time / 1e9
        prior = self.reading(candidate)
        key = path_key(candidate)
        state = self._state.get(key)
        blended = (
            sample_gbps
            if state is None
            else (self.alpha * sample_gbps + (1.0 - self.alpha) * prior.gbps)
        )
        samples = 1 if state is None else state.samples + 1
        self._state[key] = _Ema(gbps=blended, updated_at=self._clock.now(), samples=samples)
        return self.reading(candidate)

    def forget(self, candidate: PathCandidate | None = None) -> None:
        """Drop the measurements of one path, or of every path."""
        if candidate is None:
            self._state.clear()
        else:
            self._state.pop(path_key(candidate), None)
