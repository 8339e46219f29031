"""Prefix affinity: send a request where its prompt's prefix is probably still cached.

The policy cannot see the engines' prefix caches, so it remembers what it sent where:
:func:`prefix_hashes` turns a prompt into chained hashes of its whole blocks,
:meth:`PrefixAffinity.record` notes an instance's blocks (held for a while, bounded per
instance: :class:`AffinityConfig`), and :meth:`PrefixAffinity.choose` picks the candidate
holding the longest prefix unless it is too busy. Pure: time comes from the injected clock,
and nothing here does I/O. Why and the rules: docs/policies.md ("Prefix affinity").
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from topkv.policy.clock import Clock
from topkv.policy.errors import PolicyInputError


@dataclass(frozen=True)
class AffinityConfig:
    #: Units (tokens, or bytes of a text prompt) per block; vLLM's block size.
    block_units: int = 32
    #: A block counts as held for this long after its last use on an instance (s).
    ttl_s: float = 600.0
    #: Blocks remembered per instance (least recently used are forgotten first).
    capacity_blocks: int = 65_536
    #: A holder is preferred only while its load is at most the lowest load plus this.
    max_load_gap: float = 2.0

    def __post_init__(self) -> None:
        if self.block_units < 1:
            raise PolicyInputError(f"block_units must be >= 1, got {self.block_units}")
        if not self.ttl_s > 0:
            raise PolicyInputError(f"ttl_s must be > 0, got {self.ttl_s}")
        if self.capacity_blocks < 1:
            raise PolicyInputError(f"capacity_blocks must be >= 1, got {self.capacity_blocks}")
        if not self.max_load_gap >= 0:
            raise PolicyInputError(f"max_load_gap must be >= 0, got {self.max_load_gap}")


def prefix_hashes(units: Sequence[int], block_units: int) -> tuple[bytes, ...]:
    """Chained hashes of the whole blocks of ``units`` (a partial last block is left out:
    engines cache whole blocks only)."""
    if block_units < 1:
        raise PolicyInputError(f"block_units must be >= 1, got {block_units}")
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, len(units) - block_units + 1, block_units):
        block = units[start : start + block_units]
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(b",".join(str(int(u)).encode() for u in block))
        previous = digest.digest()
        hashes.append(previous)
    return tuple(hashes)


@dataclass(frozen=True)
class Candidate:
    instance_id: str
    load: float


@dataclass(frozen=True)
class AffinityChoice:
    instance_id: str
    #: Leading blocks of the request the chosen instance is believed to hold.
    matched_blocks: int
    rationale: str


class PrefixAffinity:
    """What each instance was last sent, and the choice it implies (see the module)."""

    def __init__(self, clock: Clock, config: AffinityConfig | None = None) -> None:
        self.clock = clock
        self.config = config or AffinityConfig()
        self._held: dict[str, OrderedDict[bytes, float]] = {}  # instance -> block -> last use

    def matched(self, instance_id: str, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` ``instance_id`` holds (fresh ones only)."""
        held = self._held.get(instance_id)
        if not held:
            return 0
        oldest = self.clock.now() - self.config.ttl_s
        count = 0
        for block in hashes:
            used = held.get(block)
            if used is None or used < oldest:
                break
            count += 1
        return count

    def record(self, instance_id: str, hashes: Iterable[bytes]) -> None:
        """``instance_id`` now holds ``hashes`` (it just served a prompt made of them)."""
        held = self._held.setdefault(instance_id, OrderedDict())
        now = self.clock.now()
        for block in hashes:
            held[block] = now
            held.move_to_end(block)
        while len(held) > self.config.capacity_blocks:
            held.popitem(last=False)

    def forget(self, instance_id: str) -> None:
        """``instance_id`` is gone (or restarted): it holds nothing."""
        self._held.pop(instance_id, None)

    def choose(
        self, candidates: Sequence[Candidate], hashes: Sequence[bytes]
    ) -> AffinityChoice | None:
        """The candidate holding the longest prefix within the load gap; None when no
        eligible candidate holds any of it."""
        if not candidates or not hashes:
            return None
        lowest = min(c.load for c in candidates)
        eligible = [c for c in candidates if c.load <= lowest + self.config.max_load_gap]
        scored = [(self.matched(c.instance_id, hashes), c) for c in eligible]
        matched, chosen = min(scored, key=lambda s: (-s[0], s[1].load, s[1].instance_id))
        if matched == 0:
            return None
        return AffinityChoice(
            chosen.instance_id,
            matched,
            f"holds {matched}/{len(hashes)} prefix blocks (load {chosen.load:g}, "
            f"lowest {lowest:g})",
        )
