"""``summary.sim_check``: the simulator as the stand-in, on the demo's requests (issue #19)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
from demo_results import result

from topkv.demo.workload import find_trace, load_requests
from topkv.harness.sim_check import (
    NEGLIGIBLE,
    Medians,
    compare,
    effects_agree,
    sim_check,
    stand_in_compute,
    stand_in_workload,
)
from topkv.harness.stand_in import Deployment

REQUESTS = load_requests(find_trace(None), 12, seed=0, speedup=1.5)


RESULTS = [result(r.rid, r.prompt_len, r.arrival_s * 1e3) for r in REQUESTS]


def _summary(topo: tuple[float, float], rdma: tuple[float, float]) -> dict[str, Any]:
    """A demo summary's topology_vs_uniform_rdma p50s: (exposed, TTFT) each."""

    def side(exposed: float, ttft: float) -> dict[str, Any]:
        return {"exposed_ms": {"p50": exposed}, "ttft_ms": {"p50": ttft}}

    return {
        "topology_vs_uniform_rdma": {"topology_aware": side(*topo), "uniform_rdma": side(*rdma)}
    }


@pytest.mark.parametrize(
    ("demo", "sim", "agree"),
    [
        (0.001, 0.019, True),  # both under 2% of TTFT: topology does not matter in either
        (0.05, 0.04, True),  # same direction, within 2x
        (0.05, 0.026, True),
        (0.05, 0.024, False),  # same direction, more than 2x apart
        (0.05, -0.05, False),  # opposite directions
        (0.015, 0.05, False),  # one says nothing, the other a 5% effect
        (0.0, 0.02, False),
        (math.nan, 0.0, False),
    ],
)
def test_effects_agree_on_direction_and_size(demo: float, sim: float, agree: bool) -> None:
    assert effects_agree(demo, sim) is agree


def test_compare_needs_both_effects() -> None:
    sim = Medians(0.1, 1.3, 28.0, 29.2)  # uniform RDMA costs 4.3% of TTFT
    close = compare(Medians(5.0, 13.0, 200.0, 208.0), sim)  # 4% and 4%
    assert close["agree"] is True and close["agree_on"] == {"exposed": True, "ttft": True}
    assert close["demo_effect"] == {"exposed": 0.04, "ttft": 0.04}
    hidden = compare(Medians(5.0, 5.2, 200.0, 200.2), sim)  # 0.1%: no difference
    assert hidden["agree"] is False and hidden["agree_on"] == {"exposed": False, "ttft": False}
    ttft_only = compare(Medians(5.0, 13.0, 200.0, 240.0), sim)  # TTFT 20%: 4.7x the sim's
    assert ttft_only["agree_on"] == {"exposed": True, "ttft": False}
    assert ttft_only["agree"] is False


def _check(summary: dict[str, Any], pipelining: bool = True) -> dict[str, Any]:
    return sim_check(
        Deployment.parse("Llama-3-70B"),
        RESULTS,
        summary,
        pipelining=pipelining,
        decode_slots=2,
        new_tokens=8,
    )


def test_sim_check_keys_and_agreement_when_topology_does_not_matter() -> None:
    check = _check(_summary((5.0, 230.0), (5.5, 230.5)))  # the demo: 0.2% of TTFT
    for side in ("topology_aware", "uniform_rdma"):
        assert isinstance(check[side]["exposed_ms_p50"], float)
        assert isinstance(check[side]["ttft_ms_p50"], float)
        assert check[side]["ttft_ms_p50"] > check[side]["exposed_ms_p50"] >= 0
    assert check["uniform_rdma"]["transports"] == {"rdma": len(RESULTS)}
    assert "nvlink" in check["topology_aware"]["transports"]
    assert isinstance(check["agree"], bool) and check["agree"] is True
    # the pipelined transfer is hidden on the stand-in: under 1% of TTFT either way
    assert all(abs(v) < 0.01 for v in check["sim_effect"].values())
    # the stand-in prefills these prompts ~6x faster than the demo's 0.45 ms per token
    assert 0.05 < check["time_scale"] < 0.5
    assert check["requests"] == len(RESULTS) and check["pipelining"] is True


def test_sim_check_disagrees_with_a_demo_that_exaggerates_links() -> None:
    # what the 3,000x demo reported: exposed p50 5.6 vs 615 ms, TTFT p50 183 vs 792 ms
    check = _check(_summary((5.6, 183.0), (615.0, 792.0)))
    assert check["agree"] is False
    assert check["demo_effect"]["ttft"] > 3 and check["sim_effect"]["ttft"] < 0.01


def test_without_pipelining_topology_matters_on_the_stand_in() -> None:
    on = _check(_summary((5.0, 230.0), (5.5, 230.5)))
    off = _check(_summary((5.0, 230.0), (5.5, 230.5)), pipelining=False)
    assert off["pipelining"] is False
    assert off["sim_effect"]["exposed"] > NEGLIGIBLE > on["sim_effect"]["exposed"]
    assert off["uniform_rdma"]["exposed_ms_p50"] > 10 * off["topology_aware"]["exposed_ms_p50"]


def test_no_completed_request_is_no_check() -> None:
    failed = [result(0, 128, 0.0, error="timed out")]
    check = sim_check(Deployment.parse("Llama-3-70B"), failed, _summary((1, 1), (1, 1)),
                      pipelining=True, decode_slots=2, new_tokens=8)  # fmt: skip
    assert check["agree"] is False and check["requests"] == 0 and "error" in check


def test_the_stand_ins_decode_takes_as_long_as_the_demos_in_its_time() -> None:
    deployment = Deployment.parse("Llama-3-70B")
    _, scale = stand_in_workload(deployment, RESULTS, 8)
    compute, factor = stand_in_compute(deployment, RESULTS, 8, scale)

    def decode_s(model: Any, results: list[Any]) -> float:
        return sum(model.decode_step_s(1, r.prompt_len + t) for r in results for t in range(7))

    demo_s = sum(r.decode_ms for r in RESULTS) * 1e-3 * scale
    assert decode_s(compute, RESULTS) == pytest.approx(demo_s)
    assert factor == pytest.approx(demo_s / decode_s(deployment.compute, RESULTS))
    # the demo model decodes 8 tokens in 50 ms against a prefill of 0.45 ms per token:
    # relative to its prefill, much faster than Llama-3-70B's decode on DGX-H100
    assert 0 < factor < 1
    slower = [replace(r, decode_ms=2 * r.decode_ms) for r in RESULTS]
    assert stand_in_compute(deployment, slower, 8, scale)[1] == pytest.approx(2 * factor)
    check = _check(_summary((5.0, 230.0), (5.5, 230.5)))
    assert check["decode_scale"] == pytest.approx(factor, rel=1e-3)


def test_nothing_to_match_leaves_the_stand_ins_decode_alone() -> None:
    deployment = Deployment.parse("Llama-3-70B")
    undecoded = [replace(r, decode_ms=math.nan) for r in RESULTS]
    assert stand_in_compute(deployment, undecoded, 8, 0.1) == (deployment.compute, 1.0)
    assert stand_in_compute(deployment, RESULTS, 1, 0.1) == (deployment.compute, 1.0)
