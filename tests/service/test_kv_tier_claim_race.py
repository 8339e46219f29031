"""A decode taken while its KV is being demoted gets the KV whole (``TieredKV``, no worker).

A demotion runs on the thread that needs the room (here: a prefetch's promotion making its
slot); the engine may take the victim's decode while its write to the lower tier is under
way. The lower tier's write is held on an event, so the interleaving is forced, not timed.
"""

from __future__ import annotations

import threading

from topkv.policy.tiers import TierSpec
from topkv.service.kvstore import HeldKV, synthetic_kv
from topkv.service.tiers.arena import Arena
from topkv.service.tiers.config import TierConfig
from topkv.service.tiers.stores import MemoryTierStore
from topkv.service.tiers.tiered import DEVICE, DecodeTicket, TieredKV
from topkv.transport.base import KVLayout

LAYOUT = KVLayout(num_layers=4, seq_len=64, kv_heads=2, head_dim=64)  # 128 KiB
NBYTES = LAYOUT.total_bytes
WAIT_S = 10.0


def _kv(rid: int) -> HeldKV:
    kv = synthetic_kv(rid, "m", LAYOUT)
    kv.origin = "received"
    return kv


def _bytes(kv: HeldKV) -> list[bytes]:
    with kv.use():
        return [bytes(t) for la in kv.layers for t in la]


class _HeldBackStore(MemoryTierStore):
    """A host tier whose write of one request waits for :attr:`go` (set: writes pass)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(TierSpec("host", "host", capacity, 150e-9, 10.0), Arena(capacity))
        self.held_back: int | None = None
        self.writing = threading.Event()
        self.go = threading.Event()

    def write(self, kv: HeldKV) -> None:
        if kv.request_id == self.held_back:
            self.writing.set()
            assert self.go.wait(WAIT_S), "the held-back write was never let go"
        super().write(kv)


def _settle(tiers: TieredKV) -> None:
    """Wait until no move of any KV is queued or running."""
    for _ in range(10):
        moves = [e.busy for e in list(tiers._entries.values()) if e.busy is not None]
        if all(m.done() for m in moves):
            return
        for m in moves:
            m.exception(timeout=WAIT_S)
    raise AssertionError("the tiers kept moving")


def test_decode_taken_during_its_demotion_gets_the_kv_whole() -> None:
    store = _HeldBackStore(4 * NBYTES)
    tiers = TieredKV(
        TierConfig(1, host_bytes=4 * NBYTES), [store], TierSpec(DEVICE, "device", 0, 1e-7, 3350.0)
    )
    a, b = _kv(0), _kv(1)
    original_a, original_b = _bytes(a), _bytes(b)
    tiers.admit(a)
    tiers.admit(b)  # K = 1: b, the least soon needed, goes to the host tier
    assert tiers.on_device() == [0] and tiers.tier_of(1) == "host"

    store.held_back = 0
    ticket_b = tiers.begin_decode(b, 4)  # b is due first: its prefetch demotes a to make room
    assert store.writing.wait(WAIT_S), "a was not chosen as the victim"
    assert tiers.tier_of(0) == DEVICE  # a's write is under way, its device copy not freed

    ticket_a = tiers.begin_decode(a, 4)
    seen: dict[str, object] = {}

    def decode(ticket: DecodeTicket, kv: HeldKV) -> None:
        try:
            ticket.wait()  # the engine takes a's decode, then decodes from a.layers
            seen["let_go"] = store.go.is_set()
            seen["layers"] = _bytes(kv)
        except Exception as exc:  # reported by the assertions below
            seen["error"] = exc

    engine = threading.Thread(target=decode, args=(ticket_a, a), daemon=True)
    engine.start()
    engine.join(0.3)  # the decode must wait for the demotion; let it return if it does not
    store.go.set()
    engine.join(WAIT_S)
    assert not engine.is_alive()
    _settle(tiers)

    assert "error" not in seen, seen.get("error")
    assert seen["let_go"] is True  # the decode waited for the demotion to end
    assert seen["layers"] == original_a
    # a is decoding (pinned): its KV is back on the device, whole, and stays there.
    entry = tiers._entries[0]
    assert entry.pinned and entry.tier == DEVICE and entry.phase.value == "resident"
    assert 0 in tiers.on_device() and _bytes(a) == original_a
    assert tiers.trails[0].tiers == [DEVICE, "host", DEVICE]
    assert tiers.counters["lost"] == 0 and not store.holds(0)

    tiers.end_decode(ticket_a, 0.01, 4)
    ticket_b.wait()
    assert tiers.tier_of(1) == DEVICE and _bytes(b) == original_b
    tiers.end_decode(ticket_b, 0.01, 4)
    assert tiers.forget(0) is not None and tiers.forget(1) is not None
    assert tiers.counters["lost"] == 0 and store.used_bytes == 0
    tiers.close()
