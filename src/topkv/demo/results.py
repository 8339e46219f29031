"""One demo request's state and figures: :class:`RequestState` while it runs,
:class:`RequestResult` (:func:`request_result`) at the end, :class:`Progress` for the live
view."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from topkv.demo import measure
from topkv.demo.errors import DemoError
from topkv.demo.records import Decoded, PrefillDone, Received, ReferenceDone, SendDone
from topkv.demo.topology import LinkChoice
from topkv.demo.workload import DemoRequest

#: The copies of a request's KV: streamed by the relay, sent whole after prefill, replayed
#: over emulated RDMA, and replayed the same way over the request's own path (the control).
STREAM, SERIAL, REPLAY, CONTROL = "stream", "serial", "replay", "control"


def baseline_copies(link_mode: str, pipelined: bool) -> tuple[str, ...]:
    """The measurement copies a request's KV gets after its stream, in order.

    Every request gets the serial copy. A request whose path is not RDMA also gets the
    RDMA copy and its control: a copy over its own path sent the same way, so that what the
    sending method adds by itself (a sleeping thread replaying the layer schedule on a busy
    host) cancels out of the comparison. With pipelining the control is a second replay;
    without it the RDMA copy is a serial send, and the serial copy is its control.
    """
    if link_mode == "rdma":
        return (SERIAL,)
    return (SERIAL, REPLAY, CONTROL) if pipelined else (SERIAL, REPLAY)


@dataclass(frozen=True)
class RequestResult:
    """One request's figures (milliseconds of wall clock on this host)."""

    id: int
    transport: str
    medium: str
    prefill_worker: str
    decode_worker: str
    prompt_len: int
    trace_prompt_tokens: int
    bytes: int
    arrival_ms: float
    queue_ms: float
    decode_ms: float
    prefill_ms: float
    transfer_ms: float
    exposed_ms: float
    modelled_exposed_ms: float
    serial_ms: float
    ttft_ms: float
    uniform_rdma_exposed_ms: float
    uniform_rdma_ttft_ms: float
    tokens_identical: bool
    emulated: bool
    dilation: float
    attempts: int = 0
    error: str | None = None
    #: With --device-kv-capacity: the tiers the KV visited, promotion and its exposed part.
    tiers: list[str] | None = None
    promotion_ms: float | None = None
    exposed_promotion_ms: float | None = None


@dataclass
class RequestState:
    """Where one request is, and everything measured about it so far."""

    request: DemoRequest
    stage: str = "waiting"
    arrival_s: float = 0.0
    prefill_worker: str = ""
    decode_worker: str = ""
    link: LinkChoice | None = None
    rdma_link: LinkChoice | None = None
    prefill: PrefillDone | None = None
    sends: dict[str, SendDone] = field(default_factory=dict)
    received: dict[str, Received] = field(default_factory=dict)
    decoded: Decoded | None = None
    reference: ReferenceDone | None = None
    wires: dict[str, int] = field(default_factory=dict)
    attempts: int = 0
    baselines_released: bool = False
    error: str | None = None

    @property
    def rid(self) -> int:
        return self.request.rid

    def fail(self, message: str) -> None:
        if self.error is None:
            self.error = message
        self.stage = "failed"


@dataclass(frozen=True)
class Progress:
    """A snapshot for the live view."""

    phase: str
    elapsed_s: float
    total: int
    stages: dict[str, int]
    by_transport: dict[str, int]
    finished: list[RequestResult]


ProgressCallback = Callable[[Progress], None]


def request_result(
    state: RequestState,
    layer_bytes_per_token: int,
    layers: int,
    dilation: float,
    *,
    pipelined: bool = True,
) -> RequestResult:
    """``state``'s figures; a measurement that cannot be made is the request's error.
    ``pipelined`` false: the relay's send and the RDMA baseline waited for the whole KV."""
    link = state.link
    request = state.request
    nbytes = request.prompt_len * layer_bytes_per_token * layers
    nan = math.nan
    figures: dict[str, Any] = dict(
        queue_ms=nan, decode_ms=nan,
        prefill_ms=nan, transfer_ms=nan, exposed_ms=nan, modelled_exposed_ms=nan,
        serial_ms=nan, ttft_ms=nan, uniform_rdma_exposed_ms=nan, uniform_rdma_ttft_ms=nan,
    )  # fmt: skip
    error = state.error
    try:
        figures.update(_figures(state, pipelined))
    except DemoError as exc:
        error = error or str(exc)
    except (KeyError, AssertionError) as exc:
        error = error or f"incomplete measurement (stage {state.stage}): {exc!r}"
    identical = (
        error is None
        and state.decoded is not None
        and state.reference is not None
        and state.decoded.tokens == state.reference.tokens
    )
    result = RequestResult(
        id=request.rid,
        transport=link.mode if link else "",
        medium=link.medium if link else "",
        prefill_worker=state.prefill_worker,
        decode_worker=state.decode_worker,
        prompt_len=request.prompt_len,
        trace_prompt_tokens=request.trace_prompt_tokens,
        bytes=nbytes,
        arrival_ms=request.arrival_s * 1e3,
        attempts=state.attempts,
        tokens_identical=bool(identical),
        emulated=True,
        dilation=dilation,
        error=error,
        **figures,
    )
    return replace(result, **_tier_figures(state.decoded))


def _copy_exposed(state: RequestState, tag: str, compute_s: float) -> float:
    """How long copy ``tag``'s last layer landed after its own (replayed) prefill ended:
    ``compute_s`` after the copy started."""
    return measure.exposed_after(
        state.sends[tag].start_s + compute_s, state.received[tag].arrivals_s
    )


def _tier_figures(decoded: Decoded | None) -> dict[str, Any]:
    if decoded is None or decoded.tiers is None:
        return {}
    return {
        "tiers": list(decoded.tiers),
        "promotion_ms": decoded.promotion_ms,
        "exposed_promotion_ms": decoded.exposed_promotion_ms,
    }


def _figures(state: RequestState, pipelined: bool) -> dict[str, float]:
    prefill, decoded = state.prefill, state.decoded
    stream, serial_send = state.sends[STREAM], state.sends[SERIAL]
    serial_recv = state.received[SERIAL]
    assert prefill is not None and decoded is not None
    prefill_end = prefill.forward_end_s
    exposed = measure.exposed_after(prefill_end, decoded.arrivals_s)
    link_s = measure.link_times_from_serial(
        serial_send.offered_s, serial_send.handed_s, serial_recv.arrivals_s
    )
    # without pipelining every layer is offered once the forward pass ended
    ready = prefill.layer_ready_s if pipelined else (prefill_end,) * len(prefill.layer_ready_s)
    modelled = measure.modelled_exposed_s(prefill.forward_start_s, ready, prefill_end, link_s)
    ttft = decoded.decode_start_s - state.arrival_s
    if REPLAY in state.received:
        # a replay starts at its forward start, a serial copy once its KV is whole
        compute_s = prefill_end - prefill.forward_start_s if pipelined else 0.0
        over_rdma = _copy_exposed(state, REPLAY, compute_s)
        control = _copy_exposed(state, CONTROL if pipelined else SERIAL, compute_s)
        rdma_exposed = max(0.0, exposed + over_rdma - control)
    else:
        rdma_exposed = exposed
    ms = 1e3
    return {
        "queue_ms": (prefill.started_s - state.arrival_s) * ms,
        "decode_ms": (decoded.decode_end_s - decoded.decode_start_s) * ms,
        "prefill_ms": (prefill_end - prefill.forward_start_s) * ms,
        "transfer_ms": (measure.last_landed(decoded.arrivals_s) - stream.offered_s[0]) * ms,
        "exposed_ms": exposed * ms,
        "modelled_exposed_ms": modelled * ms,
        "serial_ms": (measure.last_landed(serial_recv.arrivals_s) - serial_send.start_s) * ms,
        "ttft_ms": ttft * ms,
        "uniform_rdma_exposed_ms": rdma_exposed * ms,
        "uniform_rdma_ttft_ms": (ttft - exposed + rdma_exposed) * ms,
    }
