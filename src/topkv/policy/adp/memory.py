"""Adaptive Decoder Pool: the rules that weigh decode KV memory (paper §3.5, issue #15).

Pure functions that :func:`topkv.policy.adp.pool.plan_conversions` calls: the KV projection
(:func:`kv_fits`), the decode-bound return (:func:`decode_bound`) and the projected return
(:func:`kv_runs_out`). They read the decode workers' :attr:`WorkerView.kv_used` and
:attr:`WorkerView.kv_capacity`; a caller that reports no capacity gets the slot rules alone.
Why and what they measured: docs/adp.md ("The decode KV memory rules").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar


class WorkerView(Protocol):
    """The fields of :class:`topkv.policy.adp.pool.WorkerView` these rules read (a protocol, so
    this module does not import the one that calls it)."""

    @property
    def worker_id(self) -> str: ...
    @property
    def native(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def active_decode(self) -> int: ...
    @property
    def unacked_kv(self) -> int: ...
    @property
    def prefilling(self) -> bool: ...
    @property
    def healthy(self) -> bool: ...
    @property
    def fenced(self) -> bool: ...
    @property
    def kv_used(self) -> float: ...
    @property
    def kv_capacity(self) -> float: ...


W = TypeVar("W", bound=WorkerView)


def kv_known(workers: Sequence[WorkerView]) -> bool:
    """Whether the caller reports decode KV memory (a native decode worker with capacity)."""
    return any(w.native == "decode" and w.kv_capacity > 0 for w in workers)


def prefill_serving(workers: Sequence[WorkerView]) -> int:
    """Workers serving prefill now (native and converted), healthy."""
    return sum(1 for w in workers if w.role == "prefill" and w.healthy)


def serving_decode(workers: Sequence[W]) -> list[W]:
    """The native decode workers still serving decode (fenced ones too): the decode pool."""
    return [w for w in workers if w.native == "decode" and w.role == "decode"]


def open_decode(workers: Sequence[W]) -> list[W]:
    """The decode pool's workers taking new sequences now: healthy and not fenced."""
    return [w for w in serving_decode(workers) if w.healthy and not w.fenced]


def decode_kv_used(workers: Sequence[WorkerView]) -> float:
    """KV held on the native decode workers still serving decode (fenced ones too)."""
    return sum(w.kv_used for w in serving_decode(workers))


def decode_kv_open(workers: Sequence[WorkerView]) -> float:
    """KV capacity of the decode workers taking new sequences (healthy, not fenced)."""
    return sum(w.kv_capacity for w in open_decode(workers))


def kv_fits(
    workers: Sequence[WorkerView],
    removed_capacity: float,
    added_prefill: int,
    growth: float = 0.0,
) -> bool:
    """Whether the decode KV in use (plus ``growth``, its projected rise over one conversion),
    projected to ``added_prefill`` more prefill workers, fits the open capacity less
    ``removed_capacity`` (the workers to convert). True when the caller reports no KV
    memory."""
    if not kv_known(workers):
        return True
    used = decode_kv_used(workers) + max(0.0, growth)
    serving = prefill_serving(workers)
    projected = used * (serving + added_prefill) / serving if serving else used
    return projected <= decode_kv_open(workers) - removed_capacity


def kv_runs_out(workers: Sequence[WorkerView], growth: float) -> bool:
    """Whether the decode KV in use, grown by ``growth`` (its projected rise over one
    conversion), exceeds the open decode capacity while a worker is converted: turn one
    back now (module docstring). False when the caller reports no KV memory or nothing
    is converted."""
    if not kv_known(workers) or not any(
        w.native == "decode" and w.role == "prefill" for w in workers
    ):
        return False
    return decode_kv_used(workers) + max(0.0, growth) > decode_kv_open(workers)


def decode_bound(converted: Sequence[W]) -> W | None:
    """The converted worker to turn back while decode is the bottleneck: an idle one (no
    prefill in progress, its KV acknowledged), fewest resident sequences first, then id;
    None if none is idle."""
    idle = [w for w in converted if w.unacked_kv == 0 and not w.prefilling]
    return min(idle, key=lambda w: (w.active_decode, w.worker_id), default=None)
