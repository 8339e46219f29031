"""KV memory tiers (paper §3.7): placement, demotion, promotion and disk admission.

Pure and clock-injected: the live worker (:mod:`topkv.service.tiers.tiered`) and the simulator
(:mod:`topkv.sim.tiers`) call the same functions. :class:`TierSpec` describes a tier
(:data:`PAPER_TIERS`), :class:`TierModel` keeps measured figures per tier; :func:`next_use_s`
says when each sequence is needed, and :func:`choose_victims`, :func:`place`,
:func:`admit_to_disk` and :func:`prefetch_order` decide with it. The rules and why:
docs/tiers.md ("Policies").
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from topkv.policy.bandwidth import BandwidthEstimator
from topkv.policy.clock import Clock
from topkv.policy.errors import PolicyInputError
from topkv.policy.view import PathCandidate

TierKind = Literal["device", "host", "cxl", "disk"]
Direction = Literal["read", "write"]
TIER_KINDS: tuple[TierKind, ...] = ("device", "host", "cxl", "disk")
#: Operations this small or smaller measure a tier's latency, larger ones its bandwidth.
LATENCY_PROBE_BYTES = 64 << 10


@dataclass(frozen=True)
class TierSpec:
    """One tier: its name, kind, capacity in bytes and nominal figures.

    ``emulated`` is True where the tier stands in for hardware this host lacks (a CXL tier
    paced in software, a device tier in host memory); ``backing`` says what holds the bytes
    (``"numa node 2"``, ``"host memory standing in for the GPU"``, ``"/var/kv (O_DIRECT)"``).
    """

    name: str
    kind: TierKind
    capacity_bytes: int
    latency_s: float
    bandwidth_gbps: float
    emulated: bool = False
    backing: str = ""
    numa: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in TIER_KINDS:
            raise PolicyInputError(
                f"tier {self.name!r}: kind {self.kind!r} is not one of {TIER_KINDS}"
            )
        if self.capacity_bytes < 0:
            raise PolicyInputError(f"tier {self.name!r}: capacity {self.capacity_bytes} < 0")
        if not (math.isfinite(self.bandwidth_gbps) and self.bandwidth_gbps > 0):
            raise PolicyInputError(f"tier {self.name!r}: bandwidth {self.bandwidth_gbps} GB/s")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise PolicyInputError(f"tier {self.name!r}: latency {self.latency_s} s")

    def seconds(self, nbytes: int) -> float:
        """Nominal time to move ``nbytes`` in or out of this tier."""
        return self.latency_s + nbytes / (self.bandwidth_gbps * 1e9)


#: The paper's Table 3 figures: HBM3, CXL 3.0 Type 3 (128 GB per endpoint), NVMe Gen5.
PAPER_TIERS: Mapping[str, TierSpec] = {
    "hbm": TierSpec("hbm", "device", 80 * 10**9, 100e-9, 3350.0),
    "dram": TierSpec("dram", "host", 512 * 10**9, 100e-9, 38.4),
    "cxl": TierSpec("cxl", "cxl", 128 * 10**9, 150e-9, 64.0),
    "nvme": TierSpec("nvme", "disk", 4 * 10**12, 13_000e-9, 7.0),
}


def fastest_first(tiers: Iterable[TierSpec]) -> list[TierSpec]:
    """Tiers ordered by kind (device, host, cxl, disk), then by bandwidth, highest first."""
    return sorted(tiers, key=lambda t: (TIER_KINDS.index(t.kind), -t.bandwidth_gbps))


@dataclass(frozen=True)
class TierReading:
    """What the tier model says about one tier and direction now."""

    tier: str
    direction: Direction
    bandwidth_gbps: float
    latency_s: float
    samples: int
    source: str

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / (self.bandwidth_gbps * 1e9)


class TierModel:
    """Latency and bandwidth of every tier, read and write, EMA-updated from measurements."""

    def __init__(self, tiers: Iterable[TierSpec], clock: Clock, *, alpha: float = 0.3) -> None:
        self.tiers = {t.name: t for t in tiers}
        self.alpha = alpha
        self._bandwidth = BandwidthEstimator(clock, alpha=alpha, half_life_s=300.0)
        self._latency: dict[tuple[str, Direction], float] = {}

    def _candidate(self, tier: str, direction: Direction) -> PathCandidate:
        spec = self.tiers.get(tier)
        if spec is None:
            raise PolicyInputError(f"no tier {tier!r} (tiers: {', '.join(self.tiers)})")
        return PathCandidate(f"tier:{tier}", spec.bandwidth_gbps, 0.0, (tier, direction))

    def reading(self, tier: str, direction: Direction) -> TierReading:
        bw = self._bandwidth.reading(self._candidate(tier, direction))
        latency = self._latency.get((tier, direction), self.tiers[tier].latency_s)
        return TierReading(tier, direction, bw.gbps, latency, bw.samples, bw.source)

    def record(self, tier: str, direction: Direction, nbytes: int, seconds: float) -> TierReading:
        """Fold one measured read or write of ``nbytes`` that took ``seconds``.

        A small operation (at most :data:`LATENCY_PROBE_BYTES`) is mostly latency: it updates
        the latency EMA with what its bytes do not explain. A larger one updates the
        bandwidth EMA with its bytes over its time less the current latency.
        """
        if nbytes <= 0 or not seconds > 0:
            raise PolicyInputError(
                f"a tier sample needs bytes > 0 and time > 0: {nbytes}, {seconds}"
            )
        prior = self.reading(tier, direction)
        if nbytes <= LATENCY_PROBE_BYTES:
            sample = max(0.0, seconds - nbytes / (prior.bandwidth_gbps * 1e9))
            key = (tier, direction)
            old = self._latency.get(key)
            self._latency[key] = (
                sample if old is None else self.alpha * sample + (1 - self.alpha) * old
            )
        else:
            data_s = max(seconds - prior.latency_s, seconds * 0.5)
            self._bandwidth.record(self._candidate(tier, direction), nbytes, data_s)
        return self.reading(tier, direction)

    def seconds(self, tier: str, direction: Direction, nbytes: int) -> float:
        return self.reading(tier, direction).seconds(nbytes)

    def snapshot(self) -> list[TierReading]:
        return [self.reading(t, d) for t in self.tiers for d in ("read", "write")]


# --------------------------------------------------------------------------- next use


@dataclass(frozen=True)
class Running:
    """A sequence in a decode slot now, with the tokens it still has to produce."""

    request_id: int
    tokens_left: int


def next_use_s(
    running: Sequence[Running],
    waiting: Sequence[int],
    *,
    slots: int,
    step_s: float,
    tokens_per_request: int,
) -> dict[int, float]:
    """Seconds from now until each sequence is next needed by a decode step.

    Running sequences: 0 (every step reads them). Waiting ones, in queue order: each takes
    the first slot to free; a running one frees its slot after ``tokens_left`` steps, a
    waiting one after ``tokens_per_request``.
    """
    if slots < 1:
        raise PolicyInputError(f"decode slots must be >= 1, got {slots}")
    if not step_s >= 0:
        raise PolicyInputError(f"decode step time must be >= 0, got {step_s}")
    out = {r.request_id: 0.0 for r in running}
    free = sorted(max(0, r.tokens_left) * step_s for r in running)[:slots]
    free += [0.0] * (slots - len(free))
    heapq.heapify(free)
    for rid in waiting:
        start = heapq.heappop(free)
        out[rid] = start
        heapq.heappush(free, start + tokens_per_request * step_s)
    return out


@dataclass(frozen=True)
class Resident:
    """A sequence's KV as the policy sees it: where it is, how big, when last used."""

    request_id: int
    tier: str
    nbytes: int
    last_use_s: float = 0.0
    pinned: bool = False  # in use right now (a decode step reads it): never moved


def demotion_order(residents: Iterable[Resident], needed_in: Mapping[int, float]) -> list[Resident]:
    """Movable residents, least soon needed first (unknown next use: last), then oldest use."""
    movable = [r for r in residents if not r.pinned]
    return sorted(
        movable, key=lambda r: (-needed_in.get(r.request_id, math.inf), r.last_use_s, r.request_id)
    )


def choose_victims(
    residents: Iterable[Resident], needed_in: Mapping[int, float], need_bytes: int, free_bytes: int
) -> list[Resident] | None:
    """The fewest least-soon-needed residents whose bytes make ``need_bytes`` fit; ``None``
    when even moving every movable one would not."""
    victims: list[Resident] = []
    for r in demotion_order(residents, needed_in):
        if free_bytes >= need_bytes:
            break
        victims.append(r)
        free_bytes += r.nbytes
    return victims if free_bytes >= need_bytes else None


def admit_to_disk(
    needed_in_s: float, nbytes: int, model: TierModel, disk: str, *, margin: float = 2.0
) -> bool:
    """Whether a cache may go to disk: not when it will be needed again before ``margin``
    times the disk round trip (write, then read back) could end."""
    round_trip = model.seconds(disk, "write", nbytes) + model.seconds(disk, "read", nbytes)
    return needed_in_s >= margin * round_trip


def place(
    nbytes: int,
    tiers: Sequence[TierSpec],
    free_bytes: Mapping[str, int],
    *,
    allow_disk: bool = True,
    skip: Iterable[str] = (),
) -> TierSpec | None:
    """The fastest tier with room for ``nbytes`` (``None``: none has room)."""
    skipped = set(skip)
    for tier in fastest_first(tiers):
        if tier.name in skipped or (tier.kind == "disk" and not allow_disk):
            continue
        if free_bytes.get(tier.name, 0) >= nbytes:
            return tier
    return None


def prefetch_order(
    demoted: Iterable[Resident],
    needed_in: Mapping[int, float],
    model: TierModel,
    *,
    lookahead_s: float,
) -> list[Resident]:
    """Demoted sequences to promote now, soonest needed first: those whose next use comes
    within ``lookahead_s`` plus the time the copy back takes."""
    due = []
    for r in demoted:
        when = needed_in.get(r.request_id)
        if when is None:
            continue
        if when <= lookahead_s + model.seconds(r.tier, "read", r.nbytes):
            due.append((when, r.request_id, r))
    return [r for _, _, r in sorted(due)]
