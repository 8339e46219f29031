"""Validation of the simulator against closed forms (M/M/c, fair-shared link, pipeline)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from topkv.kv.catalog import get_model
from topkv.planner.pipeline import simulate_pipeline
from topkv.sim.cluster import ClusterSpec, NodeGroup
from topkv.sim.compute import ComputeModel, get_gpu
from topkv.sim.events import HeapLoop
from topkv.sim.links import LinkNetwork
from topkv.sim.runner import SimConfig, run_policy
from topkv.traces import Request, Workload


def erlang_c_wait(arrival: float, service_rate: float, servers: int) -> float:
    """Mean waiting time in queue of an M/M/c queue (Erlang C)."""
    a = arrival / service_rate
    rho = a / servers
    tail = a**servers / math.factorial(servers) / (1 - rho)
    p_wait = tail / (sum(a**k / math.factorial(k) for k in range(servers)) + tail)
    return p_wait / (servers * service_rate - arrival)


def test_prefill_pool_matches_mmc_theory() -> None:
    servers, mean_service, rho, n = 4, 0.1, 0.6, 20_000
    arrival = rho * servers / mean_service
    rng = np.random.default_rng(7)
    times = np.cumsum(rng.exponential(1 / arrival, n))
    tokens_per_s = 100_000.0  # service = tokens / 1e5 s; mean 10,000 tokens = 0.1 s
    tokens = np.maximum(1, np.rint(rng.exponential(mean_service * tokens_per_s, n)))
    workload = Workload(
        "mmc",
        tuple(
            Request(i, float(t), int(k), 1)
            for i, (t, k) in enumerate(zip(times, tokens, strict=True))
        ),
    )
    model = get_model("Llama-3-8B")
    compute = ComputeModel(model, get_gpu("H200"), tp=1, prefill_s_per_token=1 / tokens_per_s)
    cluster = ClusterSpec(
        name="mmc",
        node_groups=[NodeGroup(count=1, gpu="H200", gpus_per_node=8, nics_per_node=8)],
    )
    config = SimConfig(
        model=model,
        cluster=cluster,
        pd_ratio=(1, 1),
        compute=compute,
        max_prefill_tokens=1,  # one request per prefill: a plain M/M/c server
    )
    result = run_policy(config, workload, "paper")
    assert result.completed == n
    service = result.prefill_s.mean()
    theory_wait = erlang_c_wait(arrival, 1 / service, servers)
    measured_sojourn = result.prefill_wait_s.mean() + service
    theory_sojourn = theory_wait + service
    assert measured_sojourn == pytest.approx(theory_sojourn, rel=0.02)
    assert result.prefill_wait_s.mean() == pytest.approx(theory_wait, rel=0.15)


@pytest.mark.parametrize("flows", [1, 2, 5, 16])
def test_equal_flows_share_one_link_fairly(flows: int) -> None:
    loop = HeapLoop()
    net = LinkNetwork(loop, bin_s=0.01)
    link = net.add_link("l", "rdma", 25e9)
    size = 1e9
    finished: list[float] = []
    net.start_flows([(size, (link,), lambda: finished.append(loop.now()))] * flows)
    loop.run()
    expected = flows * size / 25e9  # each gets C/N, all finish together
    assert finished == pytest.approx([expected] * flows, rel=0.02)
    series = net.utilization(expected)[0]
    assert series.utilization[0] == pytest.approx(1.0, rel=0.02)


def test_staggered_flows_closed_form() -> None:
    # A starts at 0 (2 GB), B at 0.04 s (1 GB) on a 25 GB/s link.
    loop = HeapLoop()
    net = LinkNetwork(loop)
    link = net.add_link("l", "rdma", 25e9)
    done: dict[str, float] = {}
    net.start_flows([(2e9, (link,), lambda: done.__setitem__("a", loop.now()))])
    loop.call_at(
        0.04,
        lambda: net.start_flows([(1e9, (link,), lambda: done.__setitem__("b", loop.now()))]),
    )
    loop.run()
    # A alone sends 1 GB by 0.04 s; then both at 12.5 GB/s: B and A (1 GB left each)
    # finish at 0.04 + 1/12.5 = 0.12 s.
    assert done["a"] == pytest.approx(0.12, rel=1e-6)
    assert done["b"] == pytest.approx(0.12, rel=1e-6)


def test_max_min_fairness_across_a_path() -> None:
    # Flow X crosses L1 (10) and L2 (30); Y uses L1; Z uses L2. Max-min: X=Y=5, Z=25.
    loop = HeapLoop()
    net = LinkNetwork(loop)
    l1 = net.add_link("l1", "pcie", 10.0)
    l2 = net.add_link("l2", "pcie", 30.0)
    x, y, z = net.start_flows(
        [(1e6, (l1, l2), lambda: None), (1e6, (l1,), lambda: None), (1e6, (l2,), lambda: None)]
    )
    assert (x.rate, y.rate, z.rate) == pytest.approx((5.0, 5.0, 25.0))
    capped = net.start_flows([(1e6, (l2,), lambda: None)], cap=1.0)[0]
    assert capped.rate == pytest.approx(1.0)
    assert z.rate == pytest.approx(24.0)


def _one_node_cluster(gpu: str = "L40S", nvlink: str = "none") -> ClusterSpec:
    return ClusterSpec(
        name="local",
        node_groups=[
            NodeGroup(
                count=1,
                gpu=gpu,
                gpus_per_node=2,
                nvlink=nvlink,  # type: ignore[arg-type]
                pcie_gb_s=31.5,
                nics_per_node=0,
                tcp_gb_s=10.0,
            )
        ],
    )


@pytest.mark.parametrize(
    ("policy", "bandwidth", "setup"), [("paper", 31.5, 2e-6), ("uniform-tcp", 10.0, 100e-6)]
)
@pytest.mark.parametrize("tokens", [512, 8000])
def test_calibrated_local_cluster_reproduces_hand_computed_ttft(
    policy: str, bandwidth: float, setup: float, tokens: int
) -> None:
    """A 2-GPU node, prefill on GPU0, decode on GPU1, calibrated to 2 ms per layer."""
    model = get_model("Llama-3-8B")
    compute = ComputeModel(model, get_gpu("L40S"), tp=1).calibrated(
        per_layer_ms=2.0, at_tokens=tokens
    )
    config = SimConfig(model=model, cluster=_one_node_cluster(), compute=compute)
    workload = Workload("one", (Request(0, 0.0, tokens, 1),))
    result = run_policy(config, workload, policy)
    layers = model.num_layers
    layer_bytes = model.kv_bytes(tokens) / layers
    hand = simulate_pipeline(
        [2e-3] * layers, [layer_bytes / (bandwidth * 1e9)] * layers, per_chunk_setup_s=setup
    )
    assert result.ttft_s[0] == pytest.approx(hand.last_byte_s, rel=1e-6)
    # and by hand for the compute-bound case: all layers, then the last layer's transfer
    if policy == "paper":
        by_hand = layers * 2e-3 + setup + layer_bytes / (bandwidth * 1e9)
        assert result.ttft_s[0] == pytest.approx(by_hand, rel=1e-6)
