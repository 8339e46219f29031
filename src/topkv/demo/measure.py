"""Per-request measurement: what the pipelined transfer cost, and what the model says.

From the workers' stamps on the host's one monotonic clock (see :mod:`topkv.demo.protocol`):
``prefill_ms``, ``transfer_ms``, ``exposed_ms``, ``serial_ms`` and ``ttft_ms``, and
``modelled_exposed_ms`` from :func:`topkv.planner.simulate_pipeline` fed with the request's
measured per-layer compute and the link times of its serial send
(:func:`link_times_from_serial`, so the model's input does not come from the run it
predicts). Definitions: docs/demo.md ("What it measures").
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from topkv.demo.errors import DemoError
from topkv.planner import simulate_pipeline


def link_times_from_serial(
    offered_s: Sequence[float], handed_s: Sequence[float], landed_s: Sequence[float]
) -> list[float]:
    """Per-layer transfer time measured on a send of the whole cache after prefill.

    Layer l's time is its slot on the link, ``handed_l - max(offered_l, handed_{l-1})``
    (when the paced link released it to the real medium), plus the medium's own time for
    one layer, ``landed - handed``, taken as the least over the send's layers: the layer
    that found nothing queued ahead of it on the medium. (A whole cache handed over at once
    queues the other layers behind it, the more so the faster the paced link, i.e. the lower
    the dilation; a stream spaced by prefill's compute does not queue.)
    """
    count = len(landed_s)
    if not count or len(offered_s) != count or len(handed_s) != count:
        raise DemoError("serial send: offered, handed and landed stamps do not match")
    if any(math.isnan(t) for t in landed_s):
        raise DemoError("serial send: a layer has no landing stamp")
    delivery = min(max(0.0, a - h) for a, h in zip(landed_s, handed_s, strict=True))
    times: list[float] = []
    previous = -math.inf
    for offered, handed in zip(offered_s, handed_s, strict=True):
        times.append(max(0.0, handed - max(offered, previous)) + delivery)
        previous = max(previous, handed)
    return times


def compute_times(
    forward_start_s: float, layer_ready_s: Sequence[float], forward_end_s: float
) -> list[float]:
    """Per-layer compute as intervals between ready stamps, plus the tail (no KV) at the end."""
    stamps = [forward_start_s, *layer_ready_s, forward_end_s]
    return [max(0.0, b - a) for a, b in itertools.pairwise(stamps)]


def modelled_exposed_s(
    forward_start_s: float,
    layer_ready_s: Sequence[float],
    forward_end_s: float,
    link_s: Sequence[float],
) -> float:
    """Exposed time the exact pipeline model predicts for this request."""
    compute = compute_times(forward_start_s, layer_ready_s, forward_end_s)
    if len(link_s) != len(layer_ready_s):
        raise DemoError(f"{len(link_s)} link times for {len(layer_ready_s)} layers")
    return simulate_pipeline(compute, [*link_s, 0.0]).exposed_s


def last_landed(landed_s: Sequence[float]) -> float:
    if not landed_s or any(math.isnan(t) for t in landed_s):
        raise DemoError("a layer has no landing stamp")
    return max(landed_s)


def exposed_after(prefill_end_s: float, landed_s: Sequence[float]) -> float:
    return max(0.0, last_landed(landed_s) - prefill_end_s)


@dataclass(frozen=True)
class Percentiles:
    mean: float
    p50: float
    p95: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        if not values:
            return cls(math.nan, math.nan, math.nan)
        ordered = sorted(values)
        return cls(sum(ordered) / len(ordered), quantile(ordered, 0.5), quantile(ordered, 0.95))

    def as_dict(self, digits: int = 3) -> dict[str, float]:
        return {k: round(v, digits) for k, v in vars(self).items()}


def quantile(ordered: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of sorted values."""
    if not ordered:
        return math.nan
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
