"""MoE in the simulator: EP placement, stragglers, routers, dispatch traffic, the CLI contract."""

from __future__ import annotations

import json

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from topkv.cli.sim import register
from topkv.kv.catalog import get_model
from topkv.packaged import SAMPLE_TRACE
from topkv.policy.moe.router import STRATEGIES
from topkv.sim.cluster import load_cluster_spec
from topkv.sim.errors import SimError
from topkv.sim.moe import MoESimOptions, run_moe_routers
from topkv.sim.moe_setup import ExpertSizes, load_profiles, place
from topkv.sim.runner import SimConfig
from topkv.traces import head, load_trace, scale_rate

MODEL = get_model("deepseek-v3")


def _app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    return app


def _workload(n: int = 200, scale: float = 20.0):  # type: ignore[no-untyped-def]
    return scale_rate(head(load_trace(SAMPLE_TRACE), n), scale)


def test_expert_sizes_match_deepseek_v3() -> None:
    sizes = ExpertSizes.of(MODEL)
    # 671 B total, 37 B active, 256 experts, top-8: 2.56 B per expert, 16.5 B dense.
    assert sizes.expert_params == pytest.approx(2.556e9, rel=1e-3)
    assert sizes.dense_params == pytest.approx(16.55e9, rel=1e-2)
    with pytest.raises(SimError, match="not a mixture-of-experts"):
        ExpertSizes.of(get_model("Llama-3-70B"))


def test_profiles_are_real_and_skewed() -> None:
    profiles = load_profiles(256)
    assert profiles.shape == (213, 256)
    assert np.allclose(profiles.sum(axis=1), 1.0)
    # Per-sequence skew: the hottest expert well above the mean in every sequence.
    assert (profiles.max(axis=1) * 256 > 1.1).all()
    # Fewer experts than the source's 64 fold (Mixtral: 8).
    assert load_profiles(8).shape == (213, 8)


def test_placement_balances_the_mean_load() -> None:
    from topkv.sim.cluster import SimCluster

    cluster = SimCluster.build(load_cluster_spec("2x-gb200-nvl72"), 4)
    mean = load_profiles(256).mean(axis=0)
    groups = place(cluster.decode, 2, mean)
    assert len(groups) == 2  # one full replica per NVL72 rack
    for g in groups:
        assert {h.gpus[0].domain for h in g.hosts} == {g.hosts[0].gpus[0].domain}
        load = np.bincount(g.host_of, weights=mean, minlength=len(g.hosts))
        assert load.max() / load.mean() < 1.05


def test_a_straggler_is_avoided_by_the_routers_that_see_it() -> None:
    config = SimConfig(model=MODEL, cluster=load_cluster_spec("2x-gb200-nvl72"))
    options = MoESimOptions(stragglers=1)
    out = run_moe_routers(config, _workload(), "cost", [*STRATEGIES, "least-loaded"], options)
    # The straggler sits in the first prefill instances' rack: cache affinity decodes there.
    assert out["cache-affinity"]["routed_to_straggler_group"] == 200
    assert out["cache-affinity"]["stragglers"] and out["cost"]["stragglers"]
    # load-balance leaves the straggler's group entirely; cost sends it only the requests
    # for which the healthy group's longer queue costs more than the straggler does.
    assert out["load-balance"]["routed_to_straggler_group"] == 0
    hit = out["cost"]["routed_to_straggler_group"]
    assert isinstance(hit, int) and 0 < hit < 50
    tpot = {name: out[name]["tpot_p99_ms"] for name in out}
    assert tpot["cost"] <= 1.02 * tpot["load-balance"]  # type: ignore[operator]
    assert tpot["cost"] < 0.5 * tpot["cache-affinity"]  # type: ignore[operator]
    for e in out.values():
        assert e["completed"] == 200
        dispatch = e["dispatch_bytes"]
        assert isinstance(dispatch, dict) and dispatch["nvswitch"] > 0


def test_dispatch_leaves_the_domain_when_the_group_spans_nodes() -> None:
    config = SimConfig(model=MODEL, cluster=load_cluster_spec("4x-dgx-h100"), tp=4)
    out = run_moe_routers(config, _workload(60, 5.0), "cost", ["cost"], MoESimOptions())
    dispatch = out["cost"]["dispatch_bytes"]
    assert isinstance(dispatch, dict)
    # One decode instance per node (P:D alternate inside a node at TP 4), the group over
    # all four: every dispatch to another host crosses the NICs.
    assert set(dispatch) == {"rdma"} and dispatch["rdma"] > 0


def test_cli_contract(tmp_path) -> None:  # type: ignore[no-untyped-def]
    args = ["sim", "--model", "deepseek-v3", "--cluster", "2x-gb200-nvl72", "--limit", "80"]
    result = CliRunner().invoke(
        _app(), [*args, "--policy", "cost", "--moe-router", "all", "--stragglers", "1", "--json"]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert set(doc["moe_routers"]) == set(STRATEGIES)
    for entry in doc["moe_routers"].values():
        for key in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
            assert entry[key] > 0
        assert entry["goodput_rps"] >= 0 and entry["dispatch_bytes"]
    assert set(doc["moe_baseline"]) == {"least-loaded"}
    assert doc["moe_stragglers"] == 1 and "cost" in doc["policies"]
    bad = CliRunner().invoke(_app(), [*args, "--moe-router", "nearest"])
    assert bad.exit_code != 0 and "--moe-router 'nearest'" in str(bad.exception)
    bad = CliRunner().invoke(_app(), [*args, "--stragglers", "2"])
    assert bad.exit_code != 0 and "--stragglers needs --moe-router" in str(bad.exception)
