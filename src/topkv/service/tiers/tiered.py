"""A decode worker's KV tiers in use: at most K caches on the device, the rest demoted.

:class:`TieredKV` follows each received KV through the tiers: it demotes the least soon
needed one when more than K are on the device, promotes (and prefetches) a demoted one when
its decode comes, and keeps each request's :class:`TierTrail` for the decode answer. How
and why: ``docs/tiers.md`` ("On the worker").
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from topkv.policy.clock import MonotonicClock
from topkv.policy.tiers import (
    Resident,
    Running,
    TierModel,
    TierSpec,
    admit_to_disk,
    choose_victims,
    next_use_s,
    place,
    prefetch_order,
)
from topkv.service.kvstore import CapacityExceeded, HeldKV
from topkv.service.tiers.config import TierConfig, build_tier_stores
from topkv.service.tiers.device import DEVICE, DeviceTier, HostStandIn, open_device_tier
from topkv.service.tiers.stores import TierFull, TierKVLost, TierStore, TierWriteFailed
from topkv.topology.tiers import TierInventory, discover_tier_inventory

log = logging.getLogger(__name__)

__all__ = ["DEVICE", "DecodeTicket", "TierTrail", "TieredKV", "open_tiered_kv"]


@dataclass
class TierTrail:
    """One request's KV through the tiers."""

    tiers: list[str] = field(default_factory=lambda: [DEVICE])
    promotion_s: float = 0.0
    exposed_promotion_s: float = 0.0
    failures: list[str] = field(default_factory=list)


class _Phase(enum.Enum):
    """Where a request's KV stands in the tiers (``_Entry.tier`` names the tier its bytes are
    in); it changes only through the ``_Entry`` methods below."""

    RESIDENT = "resident"  # on the device
    DEMOTING = "demoting"  # chosen as a victim: its write to a lower tier is under way
    DEMOTED = "demoted"  # in a lower tier
    PROMOTING = "promoting"  # a promotion is scheduled: it holds its device slot already
    RELEASED = "released"  # decoded (or its device copy lost): released next, holds no slot

    @property
    def holds_device_slot(self) -> bool:
        return self in (_Phase.RESIDENT, _Phase.DEMOTING, _Phase.PROMOTING)


@dataclass
class _Entry:
    """A request's KV in the tiers (changed under ``TieredKV._lock``)."""

    kv: HeldKV
    tier: str = DEVICE
    phase: _Phase = _Phase.RESIDENT
    pinned: bool = False  # the engine is decoding it (in any phase): it never moves
    lost: str | None = None  # why its copy cannot be read back
    last_use_s: float = 0.0
    busy: Future[None] | None = None  # its last move (one at a time per request)

    @property
    def idle(self) -> bool:
        """No move of it is queued or running."""
        return self.busy is None or self.busy.done()

    def start_demotion(self) -> Future[None]:
        """Chosen as a victim (it was idle): the demotion, run on the thread that needs the
        room, is its move until :meth:`end_demotion` (a decode taken meanwhile waits for it)."""
        self.phase = _Phase.DEMOTING
        demotion: Future[None] = Future()
        self.busy = demotion
        return demotion

    def demoted_to(self, tier: str) -> None:
        """Its copy in ``tier`` is whole; the device copy is freed."""
        self.tier = tier
        self.phase = _Phase.DEMOTED

    def end_demotion(self, demotion: Future[None]) -> None:
        """The demotion is over (written nowhere, it stays on the device); the moves chained
        after it may run."""
        if self.phase is _Phase.DEMOTING:
            self.phase = _Phase.RESIDENT
        demotion.set_result(None)

    def start_promotion(self) -> None:
        self.phase = _Phase.PROMOTING

    def reclaim_slot(self) -> None:
        """A promotion chained after a demotion runs: a KV that demotion moved down takes
        its device slot back (the others took it when the promotion was scheduled)."""
        if self.phase is _Phase.DEMOTED:
            self.phase = _Phase.PROMOTING

    def promoted(self) -> None:
        """Read back onto the device (still ``PROMOTING`` until :meth:`end_promotion`)."""
        self.tier = DEVICE

    def end_promotion(self) -> None:
        """The promotion is over: on the device, or still demoted (its copy was lost)."""
        if self.phase is _Phase.PROMOTING:
            self.phase = _Phase.RESIDENT if self.tier == DEVICE else _Phase.DEMOTED

    def release(self) -> None:
        """Decoded (or its device copy lost): it gives up its device slot."""
        self.phase = _Phase.RELEASED


@dataclass
class DecodeTicket:
    """A decode's claim on its KV; :meth:`wait` (on the engine's thread, once the engine
    takes the decode) returns the seconds it then waited for the KV to be on the device."""

    request_id: int
    trail: TierTrail
    claim: Callable[[], Future[None] | None] | None = None
    load: Callable[[], bool] | None = None  # device memory -> the engine's host buffers

    def wait(self) -> float:
        ready = self.claim() if self.claim is not None else None
        started = time.perf_counter()
        if ready is not None:
            ready.result()  # raises TierKVLost: the request must be recomputed
        loading = time.perf_counter()
        copied = self.load() if self.load is not None else False
        if ready is None and not copied:
            return 0.0
        now = time.perf_counter()
        exposed = now - started
        self.trail.exposed_promotion_s += exposed
        if copied:  # the copy out of device memory is promotion time too
            self.trail.promotion_s += now - loading
        return exposed


class TieredKV:
    """The device tier (K caches) over the lower tier stores, fastest first.

    ``device_tier`` holds the device-resident caches' bytes (default: a host stand-in
    labelled by ``device``)."""

    def __init__(
        self,
        config: TierConfig,
        stores: list[TierStore],
        device: TierSpec,
        device_tier: DeviceTier | None = None,
    ) -> None:
        self.config = config
        self.capacity = config.device_capacity
        self.device = device
        self.device_tier: DeviceTier = device_tier or HostStandIn(config.device_capacity, "")
        self.stores = {s.spec.name: s for s in stores}
        self.model = TierModel([device, *(s.spec for s in stores)], MonotonicClock())
        self.trails: dict[int, TierTrail] = {}
        self.counters: dict[str, int] = {
            "demotions": 0,
            "promotions": 0,
            "prefetches": 0,
            "failovers": 0,
            "refused": 0,
            "lost": 0,
            "over_capacity": 0,
            "device_full": 0,
        }
        self.bytes_moved: dict[tuple[str, str], int] = {}
        self.failures: dict[tuple[str, str], int] = {}
        self._entries: dict[int, _Entry] = {}
        self._queue: list[int] = []  # arrived, no decode asked yet, in arrival order
        self._requested: list[int] = []  # decode asked, engine not there yet, in order
        self._running: dict[int, int] = {}  # request -> tokens it decodes
        self._step_s = 0.01
        self._tokens = 16
        self._lock = threading.RLock()
        self._io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-tiers")

    # -- state the policy reads ----------------------------------------------------------------

    def _needed_in(self) -> dict[int, float]:
        running = [Running(r, n) for r, n in self._running.items()]
        waiting = self._requested + self._queue
        return next_use_s(
            running, waiting, slots=1, step_s=self._step_s, tokens_per_request=self._tokens
        )

    def _device_ids(self) -> list[int]:
        """Requests holding a device slot (a decoded one about to be released holds none)."""
        return [r for r, e in self._entries.items() if e.phase.holds_device_slot]

    def _resident(self, rid: int, e: _Entry) -> Resident:
        moving = e.phase is _Phase.DEMOTING or not e.idle
        return Resident(rid, e.tier, e.kv.layout.total_bytes, e.last_use_s, e.pinned or moving)

    def on_device(self) -> list[int]:
        with self._lock:
            return self._device_ids()

    def tier_of(self, request_id: int) -> str | None:
        with self._lock:
            e = self._entries.get(request_id)
            return None if e is None else e.tier

    # -- moves (on the tier I/O threads) -------------------------------------------------------

    def _chain(self, e: _Entry, job: Callable[[], None]) -> Future[None]:
        """Run ``job`` after the entry's previous move (one move at a time per request)."""
        prev = e.busy

        def run() -> None:
            if prev is not None:
                with contextlib.suppress(Exception):  # its failure was recorded by it
                    prev.result()
            job()

        e.busy = self._io.submit(run)
        return e.busy

    def _demote(self, rid: int, e: _Entry) -> bool:
        """Write the device copy to a lower tier, then free it; False when no tier took it."""
        kv = e.kv
        nbytes = kv.layout.total_bytes
        trail = self.trails[rid]
        try:
            loaded = self.device_tier.load(kv)  # a GPU-resident copy: to host for the write
        except TierKVLost as exc:
            self._record_lost(rid, e, DEVICE, exc)
            with self._lock:
                e.release()  # its decode fails (recompute)
            self.device_tier.drop(rid)
            return True
        with self._lock:
            needed = self._needed_in().get(rid, float("inf"))
        tried: list[str] = []
        specs = [s.spec for s in self.stores.values()]
        while True:
            disk = next((s.name for s in specs if s.kind == "disk"), None)
            allow_disk = disk is None or admit_to_disk(needed, nbytes, self.model, disk)
            free = {name: s.free_bytes for name, s in self.stores.items()}
            target = place(nbytes, specs, free, allow_disk=allow_disk, skip=tried)
            if target is None:
                if loaded:
                    self.device_tier.unload(kv)
                return False
            store = self.stores[target.name]
            started = time.perf_counter()
            try:
                with kv.use():
                    store.write(kv)
            except (TierFull, TierWriteFailed) as exc:
                kind = "full" if isinstance(exc, TierFull) else "write_failed"
                with self._lock:
                    self.failures[(target.name, kind)] = (
                        self.failures.get((target.name, kind), 0) + 1
                    )
                    self.counters["failovers"] += 1
                trail.failures.append(str(exc))
                log.warning("request %s: %s; trying the next tier", rid, exc)
                tried.append(target.name)
                continue
            self.model.record(target.name, "write", nbytes, time.perf_counter() - started)
            with kv.use():
                release, kv.release = kv.release, None
                kv.layers = []
            if release is not None:
                release()
            self.device_tier.drop(rid)
            with self._lock:
                e.demoted_to(target.name)
                self.counters["demotions"] += 1
                key = (DEVICE, target.name)
                self.bytes_moved[key] = self.bytes_moved.get(key, 0) + nbytes
            trail.tiers.append(target.name)
            return True

    def _promote(self, rid: int, e: _Entry, *, prefetch: bool, asked_s: float) -> None:
        """Bring ``e`` back to the device; ``asked_s``: when the promotion was asked for
        (its time counts from then: a move of the entry before it and the room made for
        it are part of it, as the decode waiting for it sees)."""
        with self._lock:
            e.reclaim_slot()
        try:
            if e.lost is not None:  # an earlier read found the copy gone: say so again
                raise TierKVLost(e.lost)
            if e.tier != DEVICE:
                self._promote_held(rid, e, prefetch=prefetch, asked_s=asked_s)
        finally:
            with self._lock:
                e.end_promotion()

    def _promote_held(self, rid: int, e: _Entry, *, prefetch: bool, asked_s: float) -> None:
        """Promote ``e`` (its device slot is already counted: ``PROMOTING``)."""
        if not self._demote_to_capacity():
            with self._lock:
                self.counters["over_capacity"] += 1
        tier = e.tier
        store = self.stores[tier]
        kv = e.kv
        started = time.perf_counter()
        try:
            layers = store.read(rid, kv.layout, kv.crcs)
        except TierKVLost as exc:
            self._record_lost(rid, e, tier, exc)
            raise
        seconds = time.perf_counter() - started
        self.model.record(tier, "read", kv.layout.total_bytes, seconds)
        with kv.use():
            kv.layers = layers
        store.drop(rid)
        self._make_room(kv)
        with self._lock:
            e.promoted()
            self.counters["promotions"] += 1
            self.counters["prefetches"] += int(prefetch)
            key = (tier, DEVICE)
            self.bytes_moved[key] = self.bytes_moved.get(key, 0) + kv.layout.total_bytes
        self._hold(rid, e)  # into device memory (GPU), where the device tier has its own
        trail = self.trails[rid]
        trail.promotion_s += time.perf_counter() - asked_s
        trail.tiers.append(DEVICE)

    def _record_lost(self, rid: int, e: _Entry, tier: str, exc: TierKVLost) -> None:
        with self._lock:
            e.lost = str(exc)
            self.counters["lost"] += 1
            self.failures[(tier, "lost")] = self.failures.get((tier, "lost"), 0) + 1
        trail = self.trails.get(rid)
        if trail is not None:
            trail.failures.append(str(exc))

    def _hold(self, rid: int, e: _Entry) -> None:
        """Move a device-resident KV's host bytes into the device tier's own memory (a GPU
        arena; nothing for the stand-in); a full arena keeps them in host memory, counted."""
        if e.tier != DEVICE or e.phase is _Phase.RELEASED or e.lost is not None:
            return
        nbytes = e.kv.layout.total_bytes
        started = time.perf_counter()
        why = self.device_tier.hold(e.kv)
        if why is None:
            if self.device_tier.holds(rid):
                self.model.record(DEVICE, "write", nbytes, time.perf_counter() - started)
            return
        with self._lock:
            self.counters["device_full"] += 1
            self.failures[(DEVICE, "full")] = self.failures.get((DEVICE, "full"), 0) + 1
        trail = self.trails.get(rid)
        if trail is not None:
            trail.failures.append(f"{why}; kept in host memory")
        log.warning("request %s: %s; kept in host memory", rid, why)

    def _load(self, rid: int) -> bool:
        """The engine takes the decode: host buffers of the device copy (GPU memory to the
        host buffers the engines decode from); True if a copy was made."""
        with self._lock:
            e = self._entries.get(rid)
        if e is None:
            raise TierKVLost(f"request {rid}: its KV was released before its decode")
        started = time.perf_counter()
        try:
            copied = self.device_tier.load(e.kv)
        except TierKVLost as exc:
            self._record_lost(rid, e, DEVICE, exc)
            raise
        if copied:
            self.model.record(
                DEVICE, "read", e.kv.layout.total_bytes, time.perf_counter() - started
            )
        return copied

    def _demote_to_capacity(self) -> bool:
        """Demote until the device holds at most K; False when one cannot be demoted."""
        return self._demote_until(lambda: len(self._device_ids()) <= self.capacity)

    def _make_room(self, kv: HeldKV) -> None:
        """Demote residents of the device tier's memory until it has room for ``kv`` (a GPU
        arena is bounded in bytes as well as in K caches); stops when none can move (``kv``
        then stays in host memory, counted by :meth:`_hold`) or ``kv`` left the device."""
        rid = kv.request_id

        def has_room() -> bool:
            e = self._entries.get(rid)
            left = e is None or (e.tier != DEVICE and e.phase is not _Phase.PROMOTING)
            return left or self.device_tier.fits(kv)

        self._demote_until(has_room, among=lambda r: r == rid or self.device_tier.holds(r))

    def _demote_until(
        self, has_room: Callable[[], bool], among: Callable[[int], bool] = lambda _: True
    ) -> bool:
        """Demote the least soon needed device residents that ``among`` admits, one at a
        time, until ``has_room()`` (asked under the lock); False when one cannot be demoted
        (none is movable, or no lower tier takes it)."""
        while True:
            with self._lock:
                if has_room():
                    return True
                ones = [
                    Resident(r.request_id, r.tier, 1, r.last_use_s, r.pinned)
                    for r in (
                        self._resident(x, self._entries[x]) for x in self._device_ids() if among(x)
                    )
                ]
                victims = choose_victims(ones, self._needed_in(), 1, 0)
                if not victims:
                    return False
                rid = victims[0].request_id
                entry = self._entries[rid]
                demotion = entry.start_demotion()
            try:
                ok = self._demote(rid, entry)
            finally:
                with self._lock:
                    entry.end_demotion(demotion)
            if not ok:
                return False

    # -- what the worker calls -----------------------------------------------------------------

    def admit(self, kv: HeldKV) -> None:
        """A verified copy arrived (call off the event loop): make room for it on the device.

        Raises :class:`CapacityExceeded` (and forgets it) when no lower tier can take the
        least soon needed cache."""
        rid = kv.request_id
        with self._lock:
            self._entries[rid] = _Entry(kv, last_use_s=time.monotonic())
            self.trails[rid] = TierTrail()
            self._queue.append(rid)
        if self._demote_to_capacity():
            self._make_room(kv)
            with self._lock:
                e = self._entries[rid]
                held = self._chain(e, functools.partial(self._hold, rid, e))
            held.result()
            return
        with self._lock:
            self.counters["refused"] += 1
            failures = self.trails[rid].failures
            self._forget_locked(rid)
            self.trails.pop(rid, None)
        raise CapacityExceeded(
            f"request {rid}: the device holds {self.capacity} KV caches and no lower tier "
            f"could take one ({'; '.join(failures) or 'every tier is full'})"
        )

    def begin_decode(self, kv: HeldKV, tokens: int) -> DecodeTicket:
        """A decode of ``kv`` was asked for: it is needed next after the decodes asked before
        it; a prefetch may bring it back before the engine takes it."""
        rid = kv.request_id
        with self._lock:
            e = self._entries.get(rid)
            if e is None:  # not admitted through the tiers (e.g. the worker's own prefill)
                return DecodeTicket(rid, TierTrail())
            if rid in self._queue:
                self._queue.remove(rid)
                self._requested.append(rid)
        self.prefetch()
        return DecodeTicket(
            rid,
            self.trails[rid],
            functools.partial(self._claim, rid, tokens),
            functools.partial(self._load, rid),
        )

    def _claim(self, rid: int, tokens: int) -> Future[None] | None:
        """The engine takes the decode: pin the KV; promote it now if it is not back yet."""
        with self._lock:
            e = self._entries.get(rid)
            if e is None:
                raise TierKVLost(f"request {rid}: its KV was released before its decode")
            if e.lost is not None:
                raise TierKVLost(e.lost)
            e.pinned = True
            if rid in self._requested:
                self._requested.remove(rid)
            self._running[rid] = tokens
            if e.tier == DEVICE and e.idle:  # not idle: e.g. a demotion is writing it down
                return None
            if e.phase is _Phase.PROMOTING and e.busy is not None and not e.idle:
                # a prefetch is bringing it back: wait for that one itself, not for a job
                # queued behind it on the I/O threads
                return _when_back(e.busy, e)
            if e.tier != DEVICE:
                e.start_promotion()
            promote = functools.partial(
                self._promote, rid, e, prefetch=False, asked_s=time.perf_counter()
            )
            return self._chain(e, promote)

    def end_decode(self, ticket: DecodeTicket, seconds: float, tokens: int) -> None:
        with self._lock:
            e = self._entries.get(ticket.request_id)
            self._running.pop(ticket.request_id, None)
            if ticket.request_id in self._requested:
                self._requested.remove(ticket.request_id)
            if e is not None:
                e.pinned = False
                if e.tier == DEVICE:
                    e.release()  # released next; its slot goes to a prefetch
                e.last_use_s = time.monotonic()
                if self.device_tier.holds(ticket.request_id):  # drop the engine's host copy
                    self._chain(e, functools.partial(self.device_tier.unload, e.kv))
            if tokens > 0 and seconds > 0:
                self._step_s = 0.7 * self._step_s + 0.3 * seconds / tokens
                self._tokens = max(1, round(0.7 * self._tokens + 0.3 * tokens))
        self.prefetch()

    def prefetch(self) -> None:
        """Promote the demoted caches needed soonest: into free device slots, or in place of
        a device resident needed later (which the promotion demotes first)."""
        with self._lock:
            free = self.capacity - len(self._device_ids())
            needed = self._needed_in()
            demoted = [
                self._resident(r, e)
                for r, e in self._entries.items()
                if e.phase is _Phase.DEMOTED and e.lost is None and e.idle
            ]
            # Free slots take the soonest needed; a swap only what is due within the lookahead.
            soonest = sorted(
                (r for r in demoted if r.request_id in needed), key=lambda r: needed[r.request_id]
            )
            chosen = soonest[: max(free, 0)]
            due = prefetch_order(
                soonest[len(chosen) :], needed, self.model, lookahead_s=self.config.lookahead_s
            )
            later = sorted(
                (needed.get(r, float("inf")) for r in self._device_ids()
                 if not self._entries[r].pinned),
                reverse=True,
            )  # fmt: skip
            for r in due:
                if not later or later[0] <= needed[r.request_id]:
                    break
                later.pop(0)  # that resident makes way (the promotion demotes it first)
                chosen.append(r)
            for r in chosen:
                entry = self._entries[r.request_id]
                entry.start_promotion()
                asked = time.perf_counter()
                self._chain(
                    entry, functools.partial(self._promote_quietly, r.request_id, entry, asked)
                )

    def _promote_quietly(self, rid: int, e: _Entry, asked_s: float) -> None:
        try:
            self._promote(rid, e, prefetch=True, asked_s=asked_s)
        except TierKVLost as exc:
            log.warning("prefetch of request %s failed: %s", rid, exc)

    def forget(self, request_id: int) -> TierTrail | None:
        """The KV is released: drop every copy of it (call off the event loop)."""
        with self._lock:
            e = self._entries.get(request_id)
        if e is not None and e.busy is not None:
            with contextlib.suppress(Exception):  # a failed move was recorded by it
                e.busy.result()
        with self._lock:
            trail = self.trails.pop(request_id, None)
            self._forget_locked(request_id)
        self.prefetch()
        return trail

    def _forget_locked(self, rid: int) -> None:
        self._entries.pop(rid, None)
        self._running.pop(rid, None)
        for waiting in (self._queue, self._requested):
            if rid in waiting:
                waiting.remove(rid)
        for store in self.stores.values():
            store.drop(rid)
        self.device_tier.drop(rid)

    def close(self) -> None:
        self._io.shutdown(wait=True)
        for store in self.stores.values():
            store.close()
        self.device_tier.close()


def open_tiered_kv(
    config: TierConfig,
    inventory: TierInventory | None = None,
    *,
    torch_device: str | None = None,
) -> TieredKV:
    """The worker's tiers: the lower stores checked against this host (refused with the
    numbers when they do not fit), under a device tier of ``config.device_capacity`` caches.

    The device tier (:func:`~topkv.service.tiers.device.open_device_tier`) is GPU memory
    where torch sees a GPU, else host memory standing in for it, labelled so;
    ``torch_device`` forces the GPU tier's code onto that torch device (``"cpu"``: tests)."""
    inventory = inventory or discover_tier_inventory(use_nvml=False)
    stores = build_tier_stores(config, inventory)
    try:
        device_tier = open_device_tier(config, torch_device)
    except BaseException:
        for store in stores:
            store.close()
        raise
    return TieredKV(config, stores, device_tier.spec, device_tier)


def _when_back(promotion: Future[None], e: _Entry) -> Future[None]:
    """A future done with ``promotion`` (a prefetch, which logs its own failure): it fails
    with :class:`TierKVLost` when the copy could not be read back."""
    back: Future[None] = Future()

    def finish(_done: Future[None]) -> None:
        if e.lost is not None:
            back.set_exception(TierKVLost(e.lost))
        else:
            back.set_result(None)

    promotion.add_done_callback(finish)
    return back
