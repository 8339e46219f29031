"""Decode memory tiers in the simulator: lower tiers raise concurrency and cost bandwidth."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from topkv.kv import get_model
from topkv.policy.tiers import PAPER_TIERS
from topkv.sim.cluster import load_cluster_spec
from topkv.sim.errors import SimError
from topkv.sim.runner import SimConfig
from topkv.sim.tiers import (
    DecodePool,
    calibrated,
    compare_layouts,
    instance_tiers,
    parse_layouts,
    run_tier_layout,
)
from topkv.traces import Request, Workload

CONFIG = SimConfig(model=get_model("Llama-3-70B"), cluster=load_cluster_spec("4x-dgx-h100"))
COMPUTE = CONFIG.compute_model(CONFIG.resolved_tp())
ONE = DecodePool()  # one decode instance, the default SLOs


def _burst(n: int, prompt: int = 4000, out: int = 200) -> Workload:
    """``n`` long requests arriving within a second: more KV than one instance's HBM."""
    return Workload("burst", tuple(Request(i, i / n, prompt, out) for i in range(n)))


def test_paper_figures_per_instance() -> None:
    hbm, cxl, nvme = instance_tiers(COMPUTE, "hbm+cxl+nvme", dict(PAPER_TIERS))
    assert hbm.capacity_bytes == int(COMPUTE.kv_capacity_bytes)
    share = COMPUTE.tp / 8  # of the node's 4 x 128 GB, 64 GB/s endpoints
    assert cxl.capacity_bytes == int(share * 4 * 128e9) and cxl.bandwidth_gbps == share * 4 * 64
    assert (nvme.latency_s, nvme.bandwidth_gbps) == (13e-6, 7.0)


def test_cxl_holds_more_sequences_without_losing_throughput() -> None:
    work = _burst(300)
    hbm = run_tier_layout(COMPUTE, work, "hbm", ONE)
    cxl = run_tier_layout(COMPUTE, work, "hbm+cxl", ONE)
    assert hbm.completed == cxl.completed == 300
    # decode memory is no hard limit: almost the whole burst is held at once
    assert cxl.concurrency_max > 2 * hbm.concurrency_max
    assert cxl.tokens_per_s >= 0.99 * hbm.tokens_per_s  # in-place CXL reads only if they pay
    hd, cd = hbm.to_dict(), cxl.to_dict()
    assert cd["decode_wait_p99_s"] <= 1.01 * hd["decode_wait_p99_s"]
    assert cd["bytes_moved"]["cxl->hbm"] > 0 and hd["bytes_moved"] == {}
    assert cd["tpot_p99_ms"] <= 100.0  # the batch stays within the TPOT SLO


def test_batch_reads_cxl_in_place_when_hbm_is_the_bottleneck_no_more() -> None:
    # Few, short sequences: one step is weight-bound, so a CXL read adds little and the
    # SLO leaves room: nothing waits once admitted.
    work = Workload("short", tuple(Request(i, 0.0, 200, 50) for i in range(20)))
    cxl = run_tier_layout(COMPUTE, work, "hbm+cxl", ONE)
    assert cxl.completed == 20 and max(cxl.queue_s) == 0.0


def test_nvme_takes_what_cxl_cannot_and_promotes_it() -> None:
    small = dict(PAPER_TIERS)
    small["cxl"] = replace(small["cxl"], capacity_bytes=50 * 10**9)
    work = _burst(400)
    two = run_tier_layout(COMPUTE, work, "hbm+cxl", DecodePool(paper=small))
    three = run_tier_layout(COMPUTE, work, "hbm+cxl+nvme", DecodePool(paper=small))
    assert three.concurrency_max > two.concurrency_max
    moved = three.to_dict()["bytes_moved"]
    assert any(k.startswith("nvme->") for k in moved), moved


def test_calibration_replaces_measured_figures() -> None:
    tiers = calibrated({"disk_read_gbps": 1.5, "host_get_gbps": 9.0, "other": "x"})
    assert tiers["nvme"].bandwidth_gbps == 1.5 and tiers["dram"].bandwidth_gbps == 9.0
    assert tiers["cxl"] == PAPER_TIERS["cxl"]
    assert calibrated({"disk_read_gbps": "fast"})["nvme"] == PAPER_TIERS["nvme"]


def test_layout_names() -> None:
    assert parse_layouts("all") == ["hbm", "hbm+cxl", "hbm+cxl+nvme"]
    assert parse_layouts(" hbm , hbm+cxl") == ["hbm", "hbm+cxl"]
    with pytest.raises(SimError, match="'dram'"):
        parse_layouts("dram")


def test_compare_layouts_over_the_decode_pool() -> None:
    report = compare_layouts(CONFIG, _burst(200), ["hbm", "hbm+cxl"])
    assert report["decode_instances"] >= 1 and report["tier_figures"] == "paper Table 3"
    assert [r["layout"] for r in report["layouts"]] == ["hbm", "hbm+cxl"]


def test_cli_contract() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "from topkv.cli.main import app; app()", "sim", "--tiers",
         "hbm,hbm+cxl,hbm+cxl+nvme", "--limit", "300", "--json"],
        capture_output=True, text=True, check=True, timeout=300,
    ).stdout  # fmt: skip
    runs = json.loads(out)["tiers"]["layouts"]
    assert [r["layout"] for r in runs] == ["hbm", "hbm+cxl", "hbm+cxl+nvme"]
    for run in runs:
        for key in ("concurrency_mean", "goodput_rps", "tpot_p50_ms", "tpot_p99_ms", "bytes_moved"):
            assert key in run
