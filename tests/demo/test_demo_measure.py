"""Pure pieces of the demo: workload scaling, per-request measurement, the model check."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from topkv.demo.errors import DemoError
from topkv.demo.measure import (
    compute_times,
    exposed_after,
    link_times_from_serial,
    modelled_exposed_s,
    quantile,
)
from topkv.demo.workload import load_requests, scale_length
from topkv.planner import simulate_pipeline

TRACE = (
    Path(__file__).resolve().parents[1]
    / "fixtures"
    / "traces"
    / "azure_2023"
    / "AzureLLMInferenceTrace_conv.csv"
)


@given(st.integers(1, 10_000), st.integers(1, 10_000), st.integers(1, 10_000), st.integers(1, 512))
def test_scaled_lengths_stay_in_range_and_keep_order(a: int, b: int, c: int, low: int) -> None:
    lo, hi = min(a, b, c), max(a, b, c)
    mid = sorted((a, b, c))[1]
    high = low * 8
    scaled = [scale_length(x, lo, hi, low, high) for x in (lo, mid, hi)]
    assert all(low <= s <= high for s in scaled)
    assert scaled == sorted(scaled)
    if hi > lo:
        assert scaled[0] == low and scaled[-1] == high


def test_requests_from_the_azure_trace() -> None:
    requests = load_requests(TRACE, 50, seed=3, speedup=2.0)
    assert len(requests) == 50
    assert [r.rid for r in requests] == list(range(50))
    assert requests[0].arrival_s == 0.0
    assert all(b.arrival_s >= a.arrival_s for a, b in itertools.pairwise(requests))
    assert {r.prompt_len for r in requests} >= {128, 1024}  # the window's extremes
    assert all(128 <= r.prompt_len <= 1024 for r in requests)
    # the trace's first row is 374 context tokens, 44 generated
    assert (requests[0].trace_prompt_tokens, requests[0].trace_output_tokens) == (374, 44)
    assert len({r.prompt_seed for r in requests}) == 50


def test_bad_workload_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(DemoError, match="requests"):
        load_requests(TRACE, 0, seed=0)
    with pytest.raises(DemoError, match="speedup"):
        load_requests(TRACE, 4, seed=0, speedup=0.0)
    bad = tmp_path / "trace.csv"
    bad.write_text("time,tokens\n1,2\n")
    with pytest.raises(DemoError, match="cannot read the trace"):
        load_requests(bad, 4, seed=0)


def test_compute_times_are_ready_intervals_plus_tail() -> None:
    assert compute_times(10.0, [11.0, 13.0, 16.0], 16.5) == [1.0, 2.0, 3.0, 0.5]


def test_link_times_from_a_serial_send() -> None:
    # all layers offered at t=0; the paced link released them at 1, 3, 6; each landed 0.5 later
    times = link_times_from_serial([0.0, 0.0, 0.0], [1.0, 3.0, 6.0], [1.5, 3.5, 6.5])
    assert times == [1.5, 2.5, 3.5]  # slot + delivery latency
    # the medium queued layers 1 and 2 behind layer 0 (landed 1.5 and 2.0 s after release):
    # the medium's own time per layer is still 0.5 s
    assert link_times_from_serial([0.0] * 3, [1.0, 3.0, 6.0], [1.5, 4.5, 8.0]) == times
    with pytest.raises(DemoError, match="landing"):
        link_times_from_serial([0.0], [1.0], [math.nan])
    with pytest.raises(DemoError, match="match"):
        link_times_from_serial([0.0], [1.0, 2.0], [1.0, 2.0])


def test_modelled_exposed_matches_the_planner_pipeline() -> None:
    # compute 10 ms per layer, link 15 ms per layer: the link is the bottleneck
    ready = [0.010, 0.020, 0.030]
    exposed = modelled_exposed_s(0.0, ready, 0.031, [0.015, 0.015, 0.015])
    expected = simulate_pipeline([0.010, 0.010, 0.010, 0.001], [0.015, 0.015, 0.015, 0.0])
    assert exposed == pytest.approx(expected.exposed_s)
    assert exposed == pytest.approx(0.010 + 0.045 - 0.031)
    # a fast link hides everything but the last layer, and the tail hides part of it
    assert modelled_exposed_s(0.0, ready, 0.031, [0.002] * 3) == pytest.approx(0.001)


def test_exposed_is_never_negative() -> None:
    assert exposed_after(5.0, [1.0, 4.0]) == 0.0
    assert exposed_after(5.0, [1.0, 7.5]) == 2.5


def test_quantile() -> None:
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert math.isnan(quantile([], 0.5))
