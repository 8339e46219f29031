"""Layer-by-layer pipelined transfer: the paper's Eq. 3 and an exact per-layer model.

Setting: prefill computes layers 1..L one after another; as soon as layer l is computed
its KV can be sent, over one link that carries one layer at a time. What matters for
time-to-first-token is how long after prefill ends the last byte lands (the *exposed*
transfer time).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from topkv.planner.errors import PlannerInputError


def eq3_exposed_s(
    transfer_s: float, last_layer_compute_s: float, remaining_compute_s: float
) -> float:
    """Paper Eq. 3, literally: ``T_eff = max(T_last, T_xfer - T_rem)``.

    ``T_last`` is the last layer's compute time, ``T_xfer`` the whole transfer time and
    ``T_rem`` the compute that remains after the first layer finishes (``(L-1) * t`` for
    uniform layers). Note that the floor ``T_last`` is compute, not transfer: when the
    transfer hides completely the formula still reports one layer's compute time. The
    exact model (:func:`simulate_pipeline`) reports the last layer's own transfer instead.
    """
    for name, value in (
        ("transfer_s", transfer_s),
        ("last_layer_compute_s", last_layer_compute_s),
        ("remaining_compute_s", remaining_compute_s),
    ):
        _check_time(name, value)
    return max(last_layer_compute_s, transfer_s - remaining_compute_s)


def eq3_hidden_fraction(transfer_s: float, remaining_compute_s: float) -> float:
    """Fraction of the transfer Eq. 3 hides behind compute: ``min(1, T_rem / T_xfer)``."""
    _check_time("transfer_s", transfer_s)
    _check_time("remaining_compute_s", remaining_compute_s)
    if transfer_s == 0:
        return 1.0
    return min(1.0, remaining_compute_s / transfer_s)


@dataclass(frozen=True)
class PipelineResult:
    """Outcome of :func:`simulate_pipeline`; all times in seconds from prefill start.

    * ``prefill_end_s``: when the last layer finishes computing;
    * ``last_byte_s``: when the last layer's transfer completes;
    * ``exposed_s``: ``max(0, last_byte_s - prefill_end_s)``, the transfer time added to
      TTFT;
    * ``serial_s``: exposed time without pipelining (every layer sent after prefill, one
      after another, with the same per-chunk setup);
    * ``hidden_fraction``: ``1 - exposed_s / serial_s`` (1.0 when nothing is sent);
    * ``layer_finish_s``: when each layer's transfer completes.
    """

    prefill_end_s: float
    last_byte_s: float
    exposed_s: float
    serial_s: float
    hidden_fraction: float
    layer_finish_s: tuple[float, ...]


def simulate_pipeline(
    layer_compute_s: Sequence[float],
    layer_transfer_s: Sequence[float],
    per_chunk_setup_s: float = 0.0,
) -> PipelineResult:
    """Exact per-layer pipeline: layer l's transfer starts when layer l is computed *and*
    the link has finished layer l-1; it takes ``layer_transfer_s[l] + per_chunk_setup_s``.

    ``layer_transfer_s`` excludes setup (use :func:`~topkv.planner.transports.wire_time_s`
    per layer); each layer is one chunk.
    """
    if len(layer_compute_s) != len(layer_transfer_s):
        raise PlannerInputError(
            f"layer_compute_s has {len(layer_compute_s)} entries but layer_transfer_s has "
            f"{len(layer_transfer_s)}"
        )
    if not layer_compute_s:
        raise PlannerInputError("simulate_pipeline needs at least one layer")
    _check_time("per_chunk_setup_s", per_chunk_setup_s)
    computed = 0.0
    link_free = 0.0
    finishes: list[float] = []
    for compute, transfer in zip(layer_compute_s, layer_transfer_s, strict=True):
        _check_time("layer compute time", compute)
        _check_time("layer transfer time", transfer)
        computed += compute
        link_free = max(computed, link_free) + transfer + per_chunk_setup_s
        finishes.append(link_free)
    prefill_end = computed
    last_byte = link_free
    exposed = max(0.0, last_byte - prefill_end)
    serial = math.fsum(layer_transfer_s) + per_chunk_setup_s * len(layer_transfer_s)
    hidden = 1.0 if serial == 0 else max(0.0, 1.0 - exposed / serial)
    return PipelineResult(
        prefill_end_s=prefill_end,
        last_byte_s=last_byte,
        exposed_s=exposed,
        serial_s=serial,
        hidden_fraction=hidden,
        layer_finish_s=tuple(finishes),
    )


def _check_time(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise PlannerInputError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
