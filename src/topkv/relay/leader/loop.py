"""The election loop over any :class:`~topkv.relay.leader.base.LeaderBackend` (client-go's
``LeaderElector``): try to acquire or renew every retry period, act only within the renew
deadline of the last successful renewal, release the lock on a clean stop.

A candidate is *acting* (may start transfers, accept mutating requests) only while
:meth:`LeaderElection.acting` is true: it holds the lock and its last successful renewal
started less than ``renew_deadline_s`` ago. Because another candidate takes over only a
claim ``lease_s`` old and ``renew_deadline_s < lease_s``, two candidates never act at once
as long as their clocks run at the same rate (client-go's assumption too).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable

from topkv.relay.leader.base import (
    Candidate,
    ElectionTiming,
    LeaderBackend,
    LeaderElectionError,
    LeaderRecord,
)

log = logging.getLogger(__name__)

#: Called with (acting, record) whenever this candidate starts or stops leading.
LeadershipCallback = Callable[[bool, LeaderRecord], None]


class LeaderElection:
    """Campaigns for ``candidate`` through ``backend``; see the module docstring."""

    def __init__(
        self,
        backend: LeaderBackend,
        candidate: Candidate,
        timing: ElectionTiming,
        *,
        on_change: LeadershipCallback | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend, self.candidate, self.timing = backend, candidate, timing
        self._on_change, self._clock = on_change, clock
        self._record = LeaderRecord(holder=None, address=None, epoch=0)
        self._valid_until = 0.0  # acting until then (the last renewal's start + deadline)
        self._leading = False
        self._task: asyncio.Task[None] | None = None
        self.failures = 0

    @property
    def record(self) -> LeaderRecord:
        """The lock as last read (the holder may have expired since)."""
        return self._record

    @property
    def epoch(self) -> int:
        return self._record.epoch

    def acting(self) -> bool:
        return self._leading and self._clock() < self._valid_until

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="leader-election")

    async def stop(self) -> None:
        """Stop campaigning; a leader releases the lock so a follower takes over at once."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._leading:
            self._set_leading(False)
            try:
                await asyncio.wait_for(
                    asyncio.to_thread(self.backend.release, self.candidate),
                    self.timing.renew_deadline_s,
                )
            except (LeaderElectionError, TimeoutError) as exc:
                log.warning("releasing leadership in %s failed: %s", self.backend.describe(), exc)
        await asyncio.to_thread(self.backend.close)

    async def try_once(self) -> bool:
        """One acquire-or-renew; True when this candidate now holds the lock."""
        started = self._clock()
        try:
            record = await asyncio.wait_for(
                asyncio.to_thread(self.backend.try_acquire_or_renew, self.candidate),
                self.timing.renew_deadline_s,
            )
        except (LeaderElectionError, TimeoutError) as exc:
            self.failures += 1
            log.warning(  # one line per failed call; the loop's backoff bounds how many
                "leader election in %s: %s (attempt failed; %s)",
                self.backend.describe(),
                exc or "timed out",
                "still leading until the renew deadline" if self.acting() else "retrying",
            )
            if self._leading and not self.acting():
                self._set_leading(False)
            return False
        self.failures = 0
        epoch_before = self._record.epoch
        self._record = record
        held = record.holder == self.candidate.identity
        if held:
            self._valid_until = started + self.timing.renew_deadline_s
        if held != self._leading:
            self._set_leading(held)
        elif held and record.epoch != epoch_before:
            # Still acting, yet the claim is a new one: the key ran out between two renewals
            # (a stalled host) and this candidate took the lock again under a new epoch. The
            # executor must fence with the new epoch, so this is a change too.
            self._set_leading(True)
        return held

    async def _run(self) -> None:
        backoff = self.timing.retry_period_s
        while True:
            await self.try_once()
            if self.failures == 0:
                backoff = self.timing.retry_period_s
            else:
                # Failed calls back off (bounded by the lease) unless leading, where the
                # renew deadline needs the next try within one retry period.
                backoff = min(backoff * 2, self.timing.lease_s / 2)
            wait = self.timing.retry_period_s if self._leading else backoff
            await asyncio.sleep(wait * random.uniform(1.0, 1.2))  # client-go's jitter 1.2

    def _set_leading(self, leading: bool) -> None:
        self._leading = leading
        if not leading:
            self._valid_until = 0.0
        log.warning(
            "%s %s leadership in %s (epoch %d)",
            self.candidate.identity,
            "acquired" if leading else "lost",
            self.backend.describe(),
            self._record.epoch,
        )
        if self._on_change is not None:
            self._on_change(leading, self._record)
