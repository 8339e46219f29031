"""``topkv demo --compute real|paced``: the pace derived from the host, and one paced run."""

from __future__ import annotations

import os

import pytest

from topkv.demo.adp import PairedRun, pairs_json
from topkv.demo.compute import (
    PACED_LABEL,
    REAL_LABEL,
    ComputeEmulation,
    compute_json,
    compute_text,
)
from topkv.demo.errors import DemoError
from topkv.jsonout import loads_strict
from topkv.service.compute.pace import PaceStats


@pytest.mark.parametrize(
    ("workers", "threads", "cores", "pace"),
    [(4, 1, 2, 2.0), (4, 1, 3, 4 / 3), (4, 1, 4, 1.0), (4, 1, 16, 1.0), (4, 2, 2, 4.0)],
)
def test_the_pace_is_the_oversubscription_of_the_cores(
    workers: int, threads: int, cores: int, pace: float
) -> None:
    compute = ComputeEmulation.choose("paced", workers, threads, cores)
    assert compute.pace == pytest.approx(pace)
    assert compute.derivation() == f"{workers} workers x {threads} threads / {cores} cores"


def test_real_compute_has_no_pace_and_the_host_gives_the_cores() -> None:
    assert ComputeEmulation.choose("real", 4).pace is None
    assert ComputeEmulation().pace is None
    assert ComputeEmulation.choose("paced", 4).cores == len(os.sched_getaffinity(0))
    with pytest.raises(DemoError, match="--compute 'fast': use real or paced"):
        ComputeEmulation.choose("fast", 4)
    with pytest.raises(DemoError, match="workers, threads and cores >= 1"):
        ComputeEmulation("paced", 4, 1, 0)


def test_the_summary_counts_every_workers_turns() -> None:
    assert compute_json(ComputeEmulation(), {}) == {"mode": "real", "label": REAL_LABEL}
    assert compute_text({"mode": "real", "label": REAL_LABEL}) == []
    compute = ComputeEmulation.choose("paced", 4, 1, 2)
    turns = {
        "prefill0": PaceStats(10, 1, 0.25, 2.0, 8.0),
        "decode0": PaceStats(5, 0, 0.0, 1.0, 2.0),
    }
    doc = compute_json(compute, turns)
    assert doc["mode"] == "paced" and doc["pace"] == 2.0 and doc["label"] == PACED_LABEL
    assert doc["derivation"] == "4 workers x 1 threads / 2 cores"
    assert (doc["turns"], doc["overruns"], doc["overrun_s"]) == (15, 1, 0.25)
    assert doc["busy_s"] == 10.0 and doc["overrun_share"] == 0.025
    assert set(doc["per_worker"]) == {"prefill0", "decode0"}
    (line,) = compute_text(doc)
    assert "pace 2x (4 workers x 1 threads / 2 cores); 15 turns, 1 overrun(s)" in line
    run = PairedRun(0, False, [], None, 50.0, 1e6, (1.0, 2.0), doc)
    (listed,) = pairs_json([run])["pairs"]
    assert listed["runs"][0]["compute"] == {"pace": 2.0, "turns": 15, "overruns": 1,
                                            "overrun_s": 0.25, "busy_s": 10.0,
                                            "overrun_share": 0.025}  # fmt: skip


@pytest.mark.model
def test_a_small_paced_demo_holds_every_worker_to_the_derived_pace() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from test_demo_cli import _run_demo

    process, stdout, stderr = _run_demo(
        "--compute", "paced", "--requests", "4", "--json", "--speedup", "4"
    )
    assert process.returncode == 0, stderr[-2000:]
    summary = loads_strict(stdout)["summary"]
    assert summary["all_tokens_identical"] is True and summary["tokens_identical"] == 4
    emulation = summary["emulation"]
    compute = emulation["compute"]
    cores = len(os.sched_getaffinity(0))
    assert compute["mode"] == "paced" and compute["label"] == PACED_LABEL
    assert compute["pace"] == pytest.approx(max(1.0, 4 / cores), abs=1e-4)
    assert compute["derivation"] == f"4 workers x 1 threads / {cores} cores"
    assert compute["turns"] > 0 and 0 <= compute["overruns"] <= compute["turns"]
    assert set(compute["per_worker"]) == {"prefill0", "prefill1", "decode0", "decode1"}
    # the warm-up ran on the paced workers and set the dilation: the links keep the
    # stand-in's link-to-compute ratio at the paced KV rate
    ratios = emulation["derivation"]["link_to_compute"]["cross_node"]
    assert ratios["demo"] == pytest.approx(ratios["stand_in"], rel=0.01)
    assert emulation["dilation_derived"] is True
