"""Measured-bandwidth EMA with staleness decay, driven by a manual clock."""

from __future__ import annotations

import pytest

from topkv.policy import (
    BandwidthEstimator,
    CostPolicy,
    Endpoint,
    ManualClock,
    MonotonicClock,
    PairView,
    PathCandidate,
    PolicyInputError,
    TransferRequest,
)

GB = 10**9
RDMA = PathCandidate("rdma", 25.0, 5e-6, ("node0:nic0", "node1:nic0"))
TCP = PathCandidate("tcp", 10.0, 100e-6, ("node0:tcp", "node1:tcp"))


def test_unmeasured_path_reads_nominal() -> None:
    estimator = BandwidthEstimator(ManualClock())
    reading = estimator.reading(RDMA)
    assert (reading.gbps, reading.source, reading.samples) == (25.0, "nominal", 0)


def test_first_sample_sets_the_ema_with_setup_taken_out() -> None:
    estimator = BandwidthEstimator(ManualClock())
    # 1 GB in 0.1 s + 10 chunks of 5 us setup -> 10 GB/s of data rate
    reading = estimator.record(RDMA, GB, 0.1 + 10 * 5e-6, chunks=10)
    assert reading.source == "measured"
    assert reading.gbps == pytest.approx(10.0)
    assert reading.samples == 1


def test_later_samples_blend_with_alpha() -> None:
    estimator = BandwidthEstimator(ManualClock(), alpha=0.25)
    estimator.record(TCP, GB, 0.1 + 100e-6)  # 10 GB/s
    reading = estimator.record(TCP, GB, 0.2 + 100e-6)  # 5 GB/s
    assert reading.gbps == pytest.approx(0.25 * 5.0 + 0.75 * 10.0)
    assert reading.samples == 2


def test_stale_measurement_decays_back_to_nominal() -> None:
    clock = ManualClock(100.0)
    estimator = BandwidthEstimator(clock, half_life_s=10.0, min_weight=0.01)
    estimator.record(RDMA, GB, 0.1 + 5e-6)  # 10 GB/s against 25 nominal
    clock.advance(10.0)
    half = estimator.reading(RDMA)
    assert half.source == "measured"
    assert half.weight == pytest.approx(0.5)
    assert half.gbps == pytest.approx(25.0 + (10.0 - 25.0) * 0.5)
    clock.advance(60.0)  # weight 2**-7 < 0.01: forgotten
    stale = estimator.reading(RDMA)
    assert (stale.gbps, stale.source) == (25.0, "nominal")


def test_new_sample_after_a_gap_blends_with_the_decayed_value() -> None:
    clock = ManualClock()
    estimator = BandwidthEstimator(clock, alpha=0.5, half_life_s=10.0)
    estimator.record(RDMA, GB, 0.1 + 5e-6)  # 10 GB/s
    clock.advance(10.0)  # prior decays to 17.5
    reading = estimator.record(RDMA, GB, 0.05 + 5e-6)  # 20 GB/s
    assert reading.gbps == pytest.approx(0.5 * 20.0 + 0.5 * 17.5)


def test_paths_are_measured_separately() -> None:
    estimator = BandwidthEstimator(ManualClock())
    other_nic = PathCandidate("rdma", 25.0, 5e-6, ("node0:nic1", "node1:nic1"))
    estimator.record(RDMA, GB, 0.5)
    assert estimator.reading(other_nic).source == "nominal"
    estimator.forget(RDMA)
    assert estimator.reading(RDMA).source == "nominal"


def test_measured_slow_rdma_moves_cost_policy_to_tcp_until_it_is_stale() -> None:
    clock = ManualClock()
    estimator = BandwidthEstimator(clock, half_life_s=5.0)
    pair = PairView(
        Endpoint("node0", 0), Endpoint("node1", 0), False, False, True, True, (RDMA, TCP)
    )
    policy = CostPolicy(estimator)
    request = TransferRequest(GB)
    assert policy.select(pair, request).choice == "rdma"
    estimator.record(RDMA, GB, 0.5)  # the NIC delivers 2 GB/s, not 25
    selection = policy.select(pair, request)
    assert selection.choice == "tcp"
    rdma = selection.best_path("rdma")
    assert rdma is not None and rdma.source == "measured"
    clock.advance(60.0)
    assert policy.select(pair, request).choice == "rdma"


@pytest.mark.parametrize(
    ("nbytes", "duration", "chunks"), [(0, 1.0, 1), (GB, 0.0, 1), (GB, 1.0, 0)]
)
def test_bad_samples_are_refused(nbytes: int, duration: float, chunks: int) -> None:
    with pytest.raises(PolicyInputError):
        BandwidthEstimator(ManualClock()).record(RDMA, nbytes, duration, chunks=chunks)


def test_bad_settings_are_refused() -> None:
    for kwargs in ({"alpha": 0.0}, {"half_life_s": 0.0}, {"min_weight": 1.0}):
        with pytest.raises(PolicyInputError):
            BandwidthEstimator(ManualClock(), **kwargs)


def test_clocks() -> None:
    clock = ManualClock(5.0)
    assert clock.advance(2.5) == 7.5
    with pytest.raises(ValueError, match="backwards"):
        clock.advance(-1.0)
    with pytest.raises(ValueError, match="backwards"):
        clock.set(1.0)
    monotonic = MonotonicClock()
    first = monotonic.now()
    assert monotonic.now() >= first
