"""One request's figures from its copies: the uniform-RDMA baseline against its control."""

from __future__ import annotations

import math

import pytest

from topkv.demo.records import Decoded, PrefillDone, Received, SendDone
from topkv.demo.results import (
    CONTROL,
    REPLAY,
    SERIAL,
    STREAM,
    RequestResult,
    RequestState,
    baseline_copies,
    request_result,
)
from topkv.demo.topology import LinkChoice
from topkv.demo.workload import DemoRequest

LAYERS = 3


def _send(tag: str, start_s: float, handed_s: tuple[float, ...]) -> SendDone:
    return SendDone(tag, start_s, handed_s[-1], handed_s, handed_s, 1, "tcp", True, 40.0)


def _state(control_last_s: float | None) -> RequestState:
    """A request whose stream exposed 2 ms after its 100 ms forward pass (10-110 ms), whose
    RDMA replay's last layer landed 9 ms after its replayed forward pass ended, and whose
    control replay's ``control_last_s`` after its start (None: no control copy)."""
    state = RequestState(DemoRequest(7, 0.0, 300, 300, 8, 1))
    state.link = LinkChoice("nvlink", 450.0, 1e-6, "shm")
    state.prefill = PrefillDone("prefill0", 7, 11, 0.01, 0.01, 0.11, (0.04, 0.07, 0.10))
    state.decoded = Decoded("decode0", 7, (1, 2), (0.05, 0.08, 0.112), 0.113, 0.12, 0.2)
    state.sends[STREAM] = _send(STREAM, 0.04, (0.04, 0.07, 0.10))
    state.sends[SERIAL] = _send(SERIAL, 0.2, (0.21, 0.22, 0.23))
    state.received[SERIAL] = Received(SERIAL, (0.211, 0.221, 0.231), 0.232)
    replay_last = 0.3 + 0.109
    state.sends[REPLAY] = _send(REPLAY, 0.3, (0.34, 0.37, 0.40))
    state.received[REPLAY] = Received(REPLAY, (0.35, 0.38, replay_last), replay_last)
    if control_last_s is not None:
        last = 0.5 + control_last_s
        state.sends[CONTROL] = _send(CONTROL, 0.5, (0.54, 0.57, 0.60))
        state.received[CONTROL] = Received(CONTROL, (0.55, 0.58, last), last)
    return state


def _result(state: RequestState, pipelined: bool = True) -> RequestResult:
    return request_result(state, 64, LAYERS, 40.0, pipelined=pipelined)


def test_the_control_replay_takes_the_replays_own_delay_out() -> None:
    # the RDMA replay exposed 9 ms, the control over the request's own path 4 ms: the
    # replay itself adds 4, RDMA 5 more than the 2 ms the stream exposed
    figures = _result(_state(0.104))
    assert figures.error is None
    assert figures.exposed_ms == pytest.approx(2.0)
    assert figures.uniform_rdma_exposed_ms == pytest.approx(2.0 + 9.0 - 4.0)
    assert figures.ttft_ms == pytest.approx(120.0)
    assert figures.uniform_rdma_ttft_ms == pytest.approx(120.0 - 2.0 + 7.0)


def test_a_control_slower_than_the_rdma_copy_exposes_nothing_more_than_zero() -> None:
    figures = _result(_state(0.115))  # control 15 ms: RDMA 6 ms faster than the own path
    assert figures.error is None
    assert figures.uniform_rdma_exposed_ms == 0.0
    assert figures.uniform_rdma_ttft_ms == pytest.approx(120.0 - 2.0)


def test_without_pipelining_the_serial_copy_is_the_control() -> None:
    # both sent whole from their start: RDMA's last layer landed 109 ms after it, serial's 31
    figures = _result(_state(None), pipelined=False)
    assert figures.error is None
    assert figures.uniform_rdma_exposed_ms == pytest.approx(2.0 + 109.0 - 31.0)


def test_a_missing_control_is_an_incomplete_measurement_not_a_figure() -> None:
    figures = _result(_state(None))
    assert figures.error is not None and "incomplete measurement" in figures.error
    assert math.isnan(figures.uniform_rdma_exposed_ms)


@pytest.mark.parametrize(
    ("mode", "pipelined", "copies"),
    [
        ("nvlink", True, (SERIAL, REPLAY, CONTROL)),
        ("pcie", True, (SERIAL, REPLAY, CONTROL)),
        ("nvlink", False, (SERIAL, REPLAY)),
        ("rdma", True, (SERIAL,)),
        ("rdma", False, (SERIAL,)),
    ],
)
def test_baseline_copies(mode: str, pipelined: bool, copies: tuple[str, ...]) -> None:
    assert baseline_copies(mode, pipelined) == copies
