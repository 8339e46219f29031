"""Adaptive Decoder Pool (paper §3.5): decode workers turn into prefill workers in a rush.

One decision logic for the simulator, the live orchestrator and the vLLM front door, pure
and clock-injected: the caller feeds observations (prompt tokens arriving, first tokens out,
the prefill queue depth) and a snapshot of its workers (:class:`WorkerView`), and gets back a
:class:`ConversionPlan`. Pieces: :class:`TokenVelocity`, :class:`RushDetector`,
:func:`plan_conversions` and :class:`AdaptiveDecoderPool`; defaults in :class:`ADPConfig`.
The rules, their defaults and why: docs/adp.md.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from topkv.policy.adp.memory import (
    decode_bound,
    kv_fits,
    kv_runs_out,
    open_decode,
    serving_decode,
)
from topkv.policy.clock import Clock
from topkv.policy.errors import PolicyInputError

Role = Literal["prefill", "decode"]


@dataclass(frozen=True)
class ADPConfig:
    """Thresholds and limits of the Adaptive Decoder Pool (all times in seconds)."""

    #: Time constant of the fast token-velocity EMA. 10 s spans tens of requests at the
    #: rates of the Azure and Mooncake traces (a few req/s), enough to average out Poisson
    #: noise, and is short against the minutes a rush lasts, so a burst shows within
    #: seconds.
    velocity_window_s: float = 10.0
    #: Time constant of the slow EMA the spike is measured against: 30x the fast window
    #: (5 minutes), the paper's "steady state", long enough that a burst of a minute
    #: barely moves it.
    baseline_window_s: float = 300.0
    #: Velocity spike threshold: fast over slow EMA. 1.5 sits above the ~1.2 that Poisson
    #: noise reaches over a 10 s window at a few requests/s and below the 2-4x swings of
    #: the ServeGen rates and the Azure bursts.
    velocity_spike_ratio: float = 1.5
    #: Window over which the queue growth rate is measured (depth now minus depth then,
    #: over the time between). 10 s matches the fast velocity window.
    queue_window_s: float = 10.0
    #: Queue growth threshold, requests/s: 0.5 means 5 more requests queued than 10 s
    #: ago. Any sustained positive growth is overload (arrivals beyond prefill capacity);
    #: the margin above 0 ignores the few-request wobble of a queue at its service rate.
    queue_growth_per_s: float = 0.5
    #: TTFT target (the simulator's default goodput SLO, 2 s) and the window of first
    #: tokens its P99 is taken over (60 s: about a hundred first tokens at the traces'
    #: rates, enough for a P99 that is not one request).
    ttft_target_s: float = 2.0
    ttft_window_s: float = 60.0
    #: Signals that must pass together for a rush to start: 2 of 3 (the paper); one alone
    #: (a spike the pool absorbs, a slow request) is not a rush.
    min_signals: int = 2
    #: How long every signal must stay below its threshold before the rush ends: 30 s,
    #: three fast windows, longer than the gaps between the waves of a bursty trace and
    #: short against the 10 s target conversion time times the few conversions, so the
    #: pool neither flaps nor stays converted long after the load is gone.
    hold_s: float = 30.0
    #: A rush also needs demand to fall before it ends: the fast velocity at most 80% of
    #: what it was when the rush began. Converted workers relieve the signals, not the
    #: load; releasing on the signals alone converts back into the same overload and
    #: flaps (measured: five rushes within the first 10 minutes of a constant-rate
    #: ServeGen m-large window). 80% leaves margin for the EMA's noise (module tests).
    release_velocity_ratio: float = 0.8
    #: Most of the native decode pool that may be converted at once: 50%, so at least
    #: half the decode capacity (and KV memory) stays for the sequences in flight; the
    #: TPOT cost of a smaller decode pool grows fast beyond that.
    max_convert_share: float = 0.5
    #: Decode workers converted per update while the start condition holds: 1, so the
    #: pool ramps with the pressure instead of jumping to the cap on the first sign.
    convert_step: int = 1
    #: Least time between two conversions to prefill: 5 s lets the last converted worker
    #: take load (and the queue signal react) before another is converted.
    convert_interval_s: float = 5.0
    #: Chunked prefill on a converted worker: 512-token chunks (the paper; Sarathi's
    #: range for a 70B model keeps one iteration within a few decode steps) and 30% of
    #: its decode slots kept for the sequences it was decoding.
    chunk_tokens: int = 512
    decode_reserve: float = 0.3

    def __post_init__(self) -> None:
        for name in (
            "velocity_window_s",
            "baseline_window_s",
            "queue_window_s",
            "ttft_target_s",
            "ttft_window_s",
            "velocity_spike_ratio",
        ):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise PolicyInputError(f"ADP {name} = {value} must be a positive number")
        if self.baseline_window_s < self.velocity_window_s:
            raise PolicyInputError("ADP baseline window must not be shorter than the fast one")
        for name in ("hold_s", "convert_interval_s", "queue_growth_per_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise PolicyInputError(f"ADP {name} = {value} must be >= 0")
        if not 1 <= self.min_signals <= 3:
            raise PolicyInputError(f"ADP min_signals {self.min_signals} must be 1, 2 or 3")
        if not 0 <= self.max_convert_share <= 1:
            raise PolicyInputError(f"ADP max_convert_share {self.max_convert_share} not in [0,1]")
        if not 0 < self.release_velocity_ratio <= 1e9:
            raise PolicyInputError(
                f"ADP release_velocity_ratio {self.release_velocity_ratio} must be > 0"
            )
        if not 0 <= self.decode_reserve < 1:
            raise PolicyInputError(f"ADP decode_reserve {self.decode_reserve} not in [0, 1)")
        if self.chunk_tokens < 1 or self.convert_step < 1:
            raise PolicyInputError("ADP chunk_tokens and convert_step must be >= 1")

    def reserved_slots(self, decode_slots: int) -> int:
        """Decode slots a converted worker keeps for decode (30% of ``decode_slots``)."""
        return math.floor(decode_slots * self.decode_reserve + 1e-9)

    def chunks(self, prompt_tokens: int) -> int:
        """Chunks of chunked prefill for ``prompt_tokens`` (at least one)."""
        return max(1, -(-prompt_tokens // self.chunk_tokens))


DEFAULT_ADP = ADPConfig()


class TokenVelocity:
    """EMA of the token arrival rate (tokens/s) over ``window_s``, bias-corrected."""

    def __init__(self, clock: Clock, window_s: float) -> None:
        if not window_s > 0:
            raise PolicyInputError(f"velocity window {window_s} must be > 0")
        self._clock = clock
        self.window_s = window_s
        self._start = clock.now()
        self._last = self._start
        self._raw = 0.0

    def _decay_to(self, now: float) -> None:
        if now < self._last:
            raise PolicyInputError(f"time went backwards ({self._last} -> {now})")
        self._raw *= math.exp(-(now - self._last) / self.window_s)
        self._last = now

    def observe(self, tokens: float) -> None:
        """``tokens`` arrived now."""
        if tokens < 0:
            raise PolicyInputError(f"cannot observe {tokens} tokens")
        self._decay_to(self._clock.now())
        self._raw += tokens / self.window_s

    def rate(self) -> float:
        """Tokens/s now; 0 before any time has passed."""
        now = self._clock.now()
        self._decay_to(now)
        warm = 1.0 - math.exp(-(now - self._start) / self.window_s)
        return self._raw / warm if warm > 0 else 0.0


@dataclass(frozen=True)
class Signals:
    """The three rush signals at one update, each with whether it passes its threshold."""

    at: float
    queue_growth_per_s: float
    #: the fast token velocity (tokens/s) and its ratio to the slow one
    velocity: float
    velocity_ratio: float
    ttft_p99_s: float | None
    queue_high: bool
    velocity_high: bool
    ttft_high: bool

    @property
    def passing(self) -> int:
        return int(self.queue_high) + int(self.velocity_high) + int(self.ttft_high)


def p99(values: Sequence[float]) -> float:
    """The 99th percentile by linear interpolation (as numpy's default); values nonempty."""
    ordered = sorted(values)
    pos = 0.99 * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class RushDetector:
    """Rush detection from the three signals, with hysteresis (module docstring)."""

    def __init__(self, clock: Clock, config: ADPConfig = DEFAULT_ADP) -> None:
        self.config = config
        self._clock = clock
        self.fast = TokenVelocity(clock, config.velocity_window_s)
        self.slow = TokenVelocity(clock, config.baseline_window_s)
        self._depths: deque[tuple[float, int]] = deque()
        self._ttfts: deque[tuple[float, float]] = deque()
        self.in_rush = False
        self._calm_since: float | None = None
        self._onset_velocity = 0.0
        self.periods: list[tuple[float, float | None]] = []
        self.last: Signals | None = None

    def observe_arrival(self, tokens: float) -> None:
        """A request of ``tokens`` prompt tokens arrived."""
        self.fast.observe(tokens)
        self.slow.observe(tokens)

    def observe_ttft(self, seconds: float) -> None:
        """A first token came out ``seconds`` after its request arrived."""
        self._ttfts.append((self._clock.now(), seconds))

    def signals(self, queue_depth: int) -> Signals:
        """Record the prefill queue depth now and evaluate the three signals."""
        cfg = self.config
        now = self._clock.now()
        depths = self._depths
        depths.append((now, queue_depth))
        while len(depths) > 1 and depths[1][0] <= now - cfg.queue_window_s:
            depths.popleft()
        t0, d0 = depths[0]
        growth = (queue_depth - d0) / (now - t0) if now > t0 else 0.0
        slow = self.slow.rate()
        fast = self.fast.rate()
        ratio = fast / slow if slow > 0 else (math.inf if fast > 0 else 1.0)
        ttfts = self._ttfts
        while ttfts and ttfts[0][0] < now - cfg.ttft_window_s:
            ttfts.popleft()
        tail = p99([t for _, t in ttfts]) if ttfts else None
        return Signals(
            at=now,
            queue_growth_per_s=growth,
            velocity=fast,
            velocity_ratio=ratio,
            ttft_p99_s=tail,
            queue_high=growth > cfg.queue_growth_per_s,
            velocity_high=ratio > cfg.velocity_spike_ratio,
            ttft_high=tail is not None and tail > cfg.ttft_target_s,
        )

    def update(self, queue_depth: int) -> Signals:
        """One detector step: evaluate the signals and move the rush state."""
        s = self.signals(queue_depth)
        self.last = s
        now = s.at
        if not self.in_rush:
            if s.passing >= self.config.min_signals:
                self.in_rush = True
                self._calm_since = None
                self._onset_velocity = s.velocity
                self.periods.append((now, None))
            return s
        demand_fell = s.velocity <= self.config.release_velocity_ratio * self._onset_velocity
        if s.passing or not demand_fell:
            self._calm_since = None
        elif self._calm_since is None:
            self._calm_since = now
        if self._calm_since is not None and now - self._calm_since >= self.config.hold_s:
            self.in_rush = False
            self.periods[-1] = (self.periods[-1][0], now)
            self._calm_since = None
        return s

    @property
    def onset_velocity(self) -> float:
        """The fast velocity when the current (or last) rush began, tokens/s."""
        return self._onset_velocity

    @property
    def pressure(self) -> bool:
        """Whether the start condition holds at the last update (ramp more conversions)."""
        return self.last is not None and self.last.passing >= self.config.min_signals


@dataclass(frozen=True)
class WorkerView:
    """What the ADP may know about one worker."""

    worker_id: str
    #: The pool it was deployed in; only native decode workers are ever converted.
    native: Role
    #: The pool it serves now (``prefill`` for a converted decode worker).
    role: Role
    #: Decode sequences running on it now.
    active_decode: int
    #: Its decode slots (max batch) as a decode worker.
    decode_slots: int
    #: KV transfers to or from it not yet acknowledged.
    unacked_kv: int = 0
    #: Prefill work in progress on it (only a converted worker has any).
    prefilling: bool = False
    healthy: bool = True
    #: Chosen for conversion: no new KV is routed to it while its KV is acknowledged.
    fenced: bool = False
    #: Decode KV memory reserved on it and its capacity, in any one unit (bytes in the
    #: simulator); capacity 0: not reported (the KV rules of :mod:`.memory` are off).
    kv_used: float = 0.0
    kv_capacity: float = 0.0
    #: KV freed on it by finished sequences since it started (same unit; a running total),
    #: for the KV holding time of the projected return (0: not reported).
    kv_released: float = 0.0
    #: Whether it may ever change pools: False for a decode worker that serves decode only
    #: (a vLLM ``kv_consumer``): it counts for the decode pool's size, slots and KV, but
    #: is never chosen.
    convertible: bool = True

    @property
    def converted(self) -> bool:
        return self.native == "decode" and self.role == "prefill"


@dataclass(frozen=True)
class ConversionPlan:
    """What to do now: workers to convert each way, and converted ones to drain first."""

    to_prefill: tuple[str, ...] = ()
    to_decode: tuple[str, ...] = ()
    #: Converted workers that must take no new prefill work, to be converted back once
    #: idle (their prefill done and their KV acknowledged).
    drain: tuple[str, ...] = ()
    #: Decode workers chosen for conversion that still have KV not acknowledged: route
    #: no new KV to them; they are converted once it is (a later plan's ``to_prefill``).
    fence: tuple[str, ...] = ()
    #: Fenced workers to open again (the rush ended before they were converted).
    unfence: tuple[str, ...] = ()
    rationale: str = ""

    @property
    def empty(self) -> bool:
        return not (self.to_prefill or self.to_decode or self.drain or self.fence or self.unfence)


def convert_cap(native_decode: int, config: ADPConfig, convertible: int | None = None) -> int:
    """Most decode workers that may be converted: the share cap of the native decode pool,
    always leaving one, and no more than the ``convertible`` ones among them (all if None)."""
    share = math.floor(native_decode * config.max_convert_share + 1e-9)
    movable = native_decode if convertible is None else convertible
    return max(0, min(share, native_decode - 1, movable))


def convertible(w: WorkerView, config: ADPConfig) -> bool:
    """A native decode worker serving decode may turn prefill now (module docstring): its
    KV acknowledged and no more decode sequences than the chunked-prefill reserve keeps."""
    return (
        candidate(w)
        and w.unacked_kv == 0
        and w.active_decode <= config.reserved_slots(w.decode_slots)
    )


def candidate(w: WorkerView) -> bool:
    """A native decode worker that may be chosen for conversion: it is then fenced until
    :func:`convertible` (its KV acknowledged, its decode drained to the reserve)."""
    return w.native == "decode" and w.role == "decode" and w.healthy and w.convertible


def decode_in_use(workers: Sequence[WorkerView]) -> int:
    """Decode slots the decode pool uses now: on every native decode worker still serving
    decode (fenced ones too), the sequences it decodes (or queues) plus the KV on its way to
    it. Converted workers are left out: the sequences they keep sit in their own reserve."""
    return sum(w.active_decode + w.unacked_kv for w in serving_decode(workers))


def decode_slots_open(workers: Sequence[WorkerView]) -> int:
    """Decode slots of the workers that take new decode work now: native decode workers
    serving decode, healthy and not fenced."""
    return sum(w.decode_slots for w in open_decode(workers))


def plan_conversions(
    workers: Sequence[WorkerView],
    in_rush: bool,
    pressure: bool,
    config: ADPConfig = DEFAULT_ADP,
    may_convert: bool = True,
    decode_blocked: bool = False,
    kv_growth: float = 0.0,
) -> ConversionPlan:
    """The conversion plan for this update (pure; see the module docstring).

    ``in_rush``: the detector's state; ``pressure``: whether the start condition holds now
    (more workers are chosen only then); ``may_convert``: the caller's rate limit
    (``convert_interval_s`` since the last choice). A chosen worker that still has KV not
    acknowledged is *fenced* (no new KV routed to it) and converted on a later update,
    once its KV is acknowledged: never before. The same holds for a chosen worker running
    more decode sequences than the chunked-prefill reserve keeps: fenced, it gets no new
    ones, and it is converted once the ones it has drained to the reserve. A worker is
    chosen only while the decode workers left open keep more slots than
    :func:`decode_in_use` (decode headroom, module docstring); a fenced worker's slots no
    longer count. With decode KV memory reported, a worker is chosen (and a fenced one
    converted) only if :func:`~topkv.policy.adp.memory.kv_fits`; ``decode_blocked`` (requests
    wait while a prefill worker idles, for want of decode KV room) turns the plan around in
    a rush: converted workers back, fenced ones open, nobody new (:mod:`topkv.policy.adp.memory`).
    ``kv_growth``: the decode KV's projected rise over one conversion (its recent slope
    times the conversion time). The KV projection counts it, and the same return happens
    as soon as the KV in use plus it exceeds the open decode capacity
    (:func:`~topkv.policy.adp.memory.kv_runs_out`), before requests block.
    """
    natives = [w for w in workers if w.native == "decode"]
    converted = [w for w in natives if w.converted]
    fenced = [w for w in natives if w.fenced and not w.converted]
    if not in_rush:
        back = [w for w in converted if w.unacked_kv == 0 and not w.prefilling]
        wait = [w for w in converted if w not in back]
        return ConversionPlan(
            to_decode=tuple(sorted(w.worker_id for w in back)),
            drain=tuple(sorted(w.worker_id for w in wait)),
            unfence=tuple(sorted(w.worker_id for w in fenced)),
            rationale="rush over: converting back" if converted or fenced else "",
        )
    runs_out = not decode_blocked and kv_runs_out(workers, kv_growth)
    if decode_blocked or runs_out:
        ret = decode_bound(converted) if may_convert else None
        cause = (
            "the projected decode KV exceeds the open decode capacity"
            if runs_out
            else "requests wait for decode KV room while prefill idles"
        )
        return ConversionPlan(
            to_decode=(ret.worker_id,) if ret is not None else (),
            unfence=tuple(sorted(w.worker_id for w in fenced)),
            rationale=(
                f"rush, decode-bound ({cause}): "
                + (f"converting {ret.worker_id} back" if ret is not None else "converting none")
            ),
        )
    cap = convert_cap(len(natives), config, sum(1 for w in natives if w.convertible))
    ready: list[WorkerView] = []
    reopen: list[WorkerView] = []
    for w in fenced:
        if not convertible(w, config):
            continue
        # checked again: the load may have grown since it was chosen (already fenced, so
        # its capacity is out of the open pool; only the prefill growth is new)
        if kv_fits(workers, 0.0, len(ready) + 1, kv_growth):
            ready.append(w)
        else:
            reopen.append(w)
    room = cap - len(converted) - len(fenced)
    new: list[WorkerView] = []
    in_use, left = decode_in_use(natives), decode_slots_open(natives)
    short = kv_short = False
    removed_kv = 0.0
    if pressure and may_convert and room > 0:
        # idle first, then least loaded, then fewest KV in flight, then id (deterministic)
        pool = sorted(
            (w for w in natives if not w.fenced and candidate(w)),
            key=lambda w: (w.active_decode, w.unacked_kv, w.worker_id),
        )
        for w in pool:
            if len(new) == min(room, config.convert_step):
                break
            if left - w.decode_slots <= in_use:  # no gain: decode would be the bottleneck
                short = True
                continue
            if not kv_fits(
                workers, removed_kv + w.kv_capacity, len(ready) + len(new) + 1, kv_growth
            ):
                kv_short = True  # the projected decode KV would not fit (policy.adp.memory)
                continue
            new.append(w)
            left -= w.decode_slots
            removed_kv += w.kv_capacity
    to_prefill = [*ready, *(w for w in new if convertible(w, config))]
    fence = [w for w in new if not convertible(w, config)]
    total = len(converted) + len(to_prefill)
    if to_prefill or fence:
        why = f"rush: converting {len(to_prefill)}, fencing {len(fence)} ({total}/{cap})"
    elif room <= 0:
        why = f"rush: at the cap ({len(converted)} converted, {len(fenced)} fenced of {cap})"
    elif kv_short:
        why = "rush: holding, the projected decode KV would not fit the decode pool left"
    elif short:
        why = (
            f"rush: holding, no decode headroom ({in_use} decode slots in use, {left} open; "
            "one worker fewer would leave no slot spare)"
        )
    else:
        why = f"rush: holding ({len(converted)}/{cap} converted)"
    return ConversionPlan(
        to_prefill=tuple(w.worker_id for w in to_prefill),
        fence=tuple(w.worker_id for w in fence),
        unfence=tuple(sorted(w.worker_id for w in reopen)),
        rationale=why if not reopen else f"{why}; reopening {len(reopen)} fenced (KV)",
    )


@dataclass
class AdaptiveDecoderPool:
    """Detector plus planner with the rate limit between conversions: the whole ADP.

    The caller reports arrivals and first tokens as they happen, and at each update
    (a tick of a second or so) its queue depth and workers; it applies the plan it gets.
    """

    clock: Clock
    config: ADPConfig = DEFAULT_ADP
    #: How long a conversion takes the caller (the simulator's ``adp_conversion_s``; the
    #: paper's 10 s target by default): the horizon over which the decode KV's growth is
    #: projected, since a worker turned back now serves decode only that much later.
    conversion_s: float = 10.0
    detector: RushDetector = field(init=False)
    conversions: int = 0
    _last_convert: float = field(default=-math.inf, init=False)
    _kv_seen: deque[tuple[float, float, float]] = field(default_factory=deque, init=False)

    def __post_init__(self) -> None:
        if not (self.conversion_s >= 0 and math.isfinite(self.conversion_s)):
            raise PolicyInputError(f"ADP conversion_s = {self.conversion_s} must be >= 0")
        self.detector = RushDetector(self.clock, self.config)

    def kv_growth(self, workers: Sequence[WorkerView]) -> float:
        """The decode KV's projected rise over one conversion (``conversion_s``), from its
        slope and its holding time over the queue window; 0 before a second update or when
        the caller reports no KV memory.

        The KV a decode pool holds follows ``dK/dt = inflow - K / tau``: a request holds its
        KV for ``tau`` on average (Little's law: ``tau = K / outflow``, the outflow being the
        KV freed by finished sequences per second, ``kv_released``), so at today's inflow
        ``K`` tends to ``K + tau * dK/dt`` and covers ``1 - exp(-h / tau)`` of that rise within
        ``h``. A straight line (the slope times ``h``) is the limit for a holding time much
        longer than ``h``; it is what is used when the caller reports no KV freed. Taken over
        every native decode worker, converted ones included, so a worker changing pools does
        not show as KV arriving or leaving."""
        now = self.clock.now()
        natives = [w for w in workers if w.native == "decode"]
        seen = self._kv_seen
        seen.append((now, sum(w.kv_used for w in natives), sum(w.kv_released for w in natives)))
        while len(seen) > 1 and seen[1][0] <= now - self.config.queue_window_s:
            seen.popleft()
        (t0, u0, r0), (t1, u1, r1) = seen[0], seen[-1]
        if not t1 > t0:
            return 0.0
        slope = (u1 - u0) / (t1 - t0)
        outflow = (r1 - r0) / (t1 - t0)
        h = self.conversion_s
        if outflow <= 0 or u1 <= 0:
            return slope * h
        tau = u1 / outflow
        return slope * tau * -math.expm1(-h / tau)

    def observe_arrival(self, tokens: float) -> None:
        self.detector.observe_arrival(tokens)

    def observe_ttft(self, seconds: float) -> None:
        self.detector.observe_ttft(seconds)

    def update(
        self, queue_depth: int, workers: Sequence[WorkerView], decode_blocked: bool = False
    ) -> ConversionPlan:
        """Advance the detector with ``queue_depth`` and plan for ``workers``;
        ``decode_blocked``: requests wait while a prefill worker is idle, for want of
        decode KV room (:func:`~topkv.policy.adp.memory.decode_bound`)."""
        self.detector.update(queue_depth)
        now = self.clock.now()
        plan = plan_conversions(
            workers,
            self.detector.in_rush,
            self.detector.pressure,
            self.config,
            may_convert=now - self._last_convert >= self.config.convert_interval_s,
            decode_blocked=decode_blocked,
            kv_growth=self.kv_growth(workers),
        )
        if plan.to_prefill or plan.fence or (self.detector.in_rush and plan.to_decode):
            self._last_convert = now
        self.conversions += len(plan.to_prefill) + len(plan.to_decode)
        return plan

    @property
    def in_rush(self) -> bool:
        return self.detector.in_rush

    @property
    def rush_periods(self) -> list[tuple[float, float | None]]:
        """``(start, end)`` of each rush; ``end`` None while one lasts."""
        return list(self.detector.periods)
