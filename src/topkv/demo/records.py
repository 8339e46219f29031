"""What the demo records about each request, read from the workers' answers.

Every stamp is ``time.perf_counter()`` of the process that took it. On Linux that is
``CLOCK_MONOTONIC``, one clock for every process of the host, so stamps taken by the prefill
worker (layer ready), the decode worker (layer landed) and the demo (arrival) compare
directly; :func:`topkv.demo.cluster.check_shared_clock` refuses to run otherwise. A stamp a
worker could not take (a medium without per-layer arrivals) is NaN here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from topkv.service.messages import DecodeResult, GenerateResult, KVSummary, SendResult


def _stamps(values: Sequence[float | None]) -> tuple[float, ...]:
    return tuple(math.nan if v is None else v for v in values)


def _stamp(value: float | None) -> float:
    return math.nan if value is None else value


@dataclass(frozen=True)
class PrefillDone:
    """A prefill worker's forward pass of one request, from its KV summary."""

    worker_id: str
    rid: int
    first_token: int
    started_s: float  # the engine took the request
    forward_start_s: float
    forward_end_s: float
    layer_ready_s: tuple[float, ...]  # layer l's K/V stored and offered to sends

    @classmethod
    def of(cls, worker_id: str, summary: KVSummary) -> PrefillDone:
        timings = summary.timings
        if summary.first_token is None or timings.forward_start_s is None:
            raise ValueError(f"{worker_id}: request {summary.request_id} has no prefill stamps")
        start = timings.forward_start_s
        return cls(
            worker_id=worker_id,
            rid=summary.request_id,
            first_token=summary.first_token,
            started_s=start,
            forward_start_s=start,
            forward_end_s=_stamp(timings.forward_end_s),
            layer_ready_s=tuple(timings.layer_ready_s),
        )


@dataclass(frozen=True)
class SendDone:
    """One send of a request's KV (the streamed attempt, or a baseline copy)."""

    tag: str
    start_s: float
    end_s: float  # the destination acknowledged a verified copy
    offered_s: tuple[float, ...]  # layer l offered to the (paced) transport
    handed_s: tuple[float, ...]  # layer l left the paced link, handed to the medium
    nbytes: int
    transport: str
    emulated: bool
    dilation: float

    @classmethod
    def of(cls, tag: str, sent: SendResult) -> SendDone:
        return cls(
            tag=tag,
            start_s=sent.started_s,
            end_s=sent.ended_s,
            offered_s=tuple(sent.offered_s),
            handed_s=tuple(sent.handed_s),
            nbytes=sent.size_bytes,
            transport=sent.medium,
            emulated=sent.emulated,
            dilation=sent.dilation,
        )


@dataclass(frozen=True)
class Received:
    """A copy as its destination verified it: when each layer landed."""

    tag: str
    arrivals_s: tuple[float, ...]  # layer l landed and its CRC-64 matched
    verified_s: float  # the whole KV was acknowledged verified

    @classmethod
    def of(cls, tag: str, held: KVSummary) -> Received:
        return cls(tag, _stamps(held.timings.arrivals_s), _stamp(held.timings.verified_s))


@dataclass(frozen=True)
class Decoded:
    worker_id: str
    rid: int
    tokens: tuple[int, ...]
    arrivals_s: tuple[float, ...]
    kv_verified_s: float
    decode_start_s: float
    decode_end_s: float
    #: KV tiers (a decode worker with --device-kv-capacity): the tiers this KV visited,
    #: its promotion time and the part decode waited for (ms); None without tiers.
    tiers: tuple[str, ...] | None = None
    promotion_ms: float | None = None
    exposed_promotion_ms: float | None = None

    @classmethod
    def of(cls, worker_id: str, copy: Received, result: DecodeResult) -> Decoded:
        return cls(
            worker_id=worker_id,
            rid=result.request_id,
            tokens=tuple(result.tokens),
            arrivals_s=copy.arrivals_s,
            kv_verified_s=copy.verified_s,
            decode_start_s=result.started_s,
            decode_end_s=result.ended_s,
            tiers=tuple(result.tiers) if result.tiers is not None else None,
            promotion_ms=result.promotion_ms,
            exposed_promotion_ms=result.exposed_promotion_ms,
        )


@dataclass(frozen=True)
class ReferenceDone:
    worker_id: str
    rid: int
    tokens: tuple[int, ...]
    seconds: float

    @classmethod
    def of(cls, worker_id: str, rid: int, result: GenerateResult) -> ReferenceDone:
        return cls(worker_id, rid, tuple(result.tokens), result.seconds)
