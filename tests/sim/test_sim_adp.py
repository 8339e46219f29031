"""The Adaptive Decoder Pool in the simulator: pools follow a step load and convert back;
``topkv sim --adp`` and ``--pd-ratio sweep`` keep the JSON contract of issue #15."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from topkv.cli.sim import register
from topkv.kv.catalog import get_model
from topkv.policy.adp.pool import ADPConfig
from topkv.sim.cluster import load_cluster_spec
from topkv.sim.report import SimReport, pool_series, rush_spans
from topkv.sim.result import PolicyResult
from topkv.sim.runner import SimConfig, run_policy
from topkv.traces import Request, Workload

TRACES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
STEP = (60.0, 150.0)  # the high-rate part of the step load, simulated seconds
BASE_KEYS = {
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "goodput_rps",
    "transfer_ms_p50",
    "bytes_by_transport",
    "rejected",
}
ADP_KEYS = {"ttft_p90_ms", "conversions", "prefill_workers_max", "prefill_workers_min"}


def _step_load(low: float = 2.0, high: float = 20.0, end: float = 300.0) -> Workload:
    """Evenly spaced 4,000-token prompts: ``low`` req/s, ``high`` inside STEP, then low.

    On 4x DGX H100 (Llama-3-70B, TP 4: 4 prefill + 4 decode instances at 1:1) one prefill
    takes ~0.3 s, so 4 prefill instances serve ~13 req/s: 2 req/s is calm, 20 a rush."""
    reqs = []
    t = 0.0
    while t < end:
        reqs.append(Request(len(reqs), t, 4000, 64))
        t += 1.0 / (high if STEP[0] <= t < STEP[1] else low)
    return Workload("step", tuple(reqs))


def _config(adp: bool, **over: object) -> SimConfig:
    return SimConfig(
        model=get_model("Llama-3-70B"),
        cluster=load_cluster_spec("4x-dgx-h100"),
        adp=ADPConfig() if adp else None,
        **over,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def step_runs() -> tuple[PolicyResult, PolicyResult]:
    load = _step_load()
    return run_policy(_config(False), load, "paper"), run_policy(_config(True), load, "paper")


def test_pools_follow_a_step_load_and_convert_back(
    step_runs: tuple[PolicyResult, PolicyResult],
) -> None:
    off, on = step_runs
    assert off.completed == on.completed == len(_step_load())
    assert (off.conversions, off.prefill_workers_min, off.prefill_workers_max) == (0, 4, 4)
    assert off.pool_series == [] and off.rush_periods == []
    assert on.adp and on.label == "paper+adp"
    series = on.pool_series
    before = [n for t, n, _ in series if t < STEP[0]]
    during = [n for t, n, _ in series if STEP[0] + 30 <= t < STEP[1]]
    assert set(before) == {4}  # calm: static pools
    assert max(during) > 4  # the rush: decode workers serve prefill
    assert on.prefill_workers_max == 6  # the cap: half of the 4 decode workers
    assert on.prefill_workers_min == 4
    assert series[-1][1] == 4  # converted back after the step
    back = next(t for t, n, _ in series if t > STEP[1] and n == 4)
    assert back < STEP[1] + 120
    # one rush, starting inside the step and ending after it
    assert len(on.rush_periods) == 1
    start, end = on.rush_periods[0]
    assert STEP[0] <= start < STEP[0] + 20
    assert end is not None and end > STEP[1]
    assert on.conversions == 4  # 2 to prefill, 2 back
    # and it helps: a lower TTFT tail than the static 1:1 split on the same load
    assert on.pct(on.ttft_s, 90) < 0.7 * off.pct(off.ttft_s, 90)


def test_no_conversion_on_a_calm_load() -> None:
    load = _step_load(low=2.0, high=2.0, end=120.0)
    on = run_policy(_config(True), load, "paper")
    assert on.conversions == 0 and on.rush_periods == []
    assert on.prefill_workers_min == on.prefill_workers_max == 4
    # and without a conversion the ADP changes nothing: same routes, transports, figures
    off = run_policy(_config(False), load, "paper")
    assert on.count_by_transport == off.count_by_transport == {"nvlink": len(load)}
    assert on.summary() == off.summary()


def test_adp_off_is_unchanged_by_the_adp_code() -> None:
    """With ``adp=None`` no tick runs: the same events and figures as a plain config."""
    load = _step_load(end=90.0)
    plain = SimConfig(model=get_model("Llama-3-70B"), cluster=load_cluster_spec("4x-dgx-h100"))
    a = run_policy(plain, load, "paper")
    b = run_policy(_config(False), load, "paper")
    assert a.events == b.events
    assert a.summary() == b.summary()


def test_tpot_of_residents_on_a_converted_worker_stays_bounded(
    step_runs: tuple[PolicyResult, PolicyResult],
) -> None:
    off, on = step_runs
    # chunked prefill slows the decode steps of the sequences kept on converted workers
    # and the smaller decode pool batches more, but the median stays close
    assert on.pct(on.tpot_s, 50) <= 1.2 * off.pct(off.tpot_s, 50)


# -- CLI ---------------------------------------------------------------------------------


def _app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def _group() -> None:
        """topkv (only the sim command)."""

    register(app)
    return app


def _slice(src: Path, dst: Path, lines: int) -> Path:
    with src.open(encoding="utf-8") as handle:
        dst.write_text("".join(islice(handle, lines)), encoding="utf-8")
    return dst


def _sim(*args: str) -> dict[str, object]:
    result = CliRunner().invoke(_app(), ["sim", *args, "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout.strip().splitlines()[-1])
    assert isinstance(doc, dict)
    return doc


def test_cli_adp_both_has_p_and_p_plus_adp(tmp_path: Path) -> None:
    trace = _slice(TRACES / "mooncake/conversation_trace.jsonl", tmp_path / "m.jsonl", 200)
    doc = _sim("--trace", str(trace), "--adp", "both")
    policies = doc["policies"]
    assert isinstance(policies, dict)
    names = {"uniform-rdma", "paper", "cost"}
    assert set(policies) == names | {f"{p}+adp" for p in names}
    for summary in policies.values():
        assert set(summary) == BASE_KEYS | ADP_KEYS
    for p in names:
        off, on = policies[p], policies[f"{p}+adp"]
        assert off["conversions"] == 0
        assert off["prefill_workers_min"] == off["prefill_workers_max"] == 4
        assert on["prefill_workers_min"] == 4 <= on["prefill_workers_max"] <= 6
        assert on["conversions"] >= 0
        assert off["ttft_p50_ms"] <= off["ttft_p90_ms"] <= off["ttft_p99_ms"]
    # this slice (long prompts) makes a rush at 1:1
    assert policies["paper+adp"]["conversions"] > 0
    assert "sweep" not in doc and "best_static" not in doc


def test_cli_adp_on_and_default_off(tmp_path: Path) -> None:
    trace = _slice(TRACES / "azure_2023/AzureLLMInferenceTrace_conv.csv", tmp_path / "a.csv", 80)
    on = _sim("--trace", str(trace), "--policy", "paper", "--adp", "on")
    assert set(on["policies"]) == {"paper+adp"}  # type: ignore[arg-type]
    off = _sim("--trace", str(trace), "--policy", "paper")
    assert set(off["policies"]) == {"paper"}  # type: ignore[arg-type]
    assert set(off) == {
        "requests",
        "rejected",
        "sim_seconds",
        "wall_seconds",
        "speed_x_realtime",
        "policies",
    }
    bad = CliRunner().invoke(_app(), ["sim", "--trace", str(trace), "--adp", "maybe"])
    assert bad.exit_code != 0 and "--adp 'maybe'" in str(bad.exception)


def test_cli_pd_ratio_sweep_names_the_best_static_split(tmp_path: Path) -> None:
    trace = _slice(TRACES / "mooncake/conversation_trace.jsonl", tmp_path / "m.jsonl", 200)
    doc = _sim("--trace", str(trace), "--policy", "paper", "--pd-ratio", "sweep", "--adp", "both")
    sweep = doc["sweep"]
    assert isinstance(sweep, list)
    # every split of the 8 instances, in lowest terms
    assert [e["pd_ratio"] for e in sweep] == ["1:7", "1:3", "3:5", "1:1", "5:3", "3:1", "7:1"]
    for e in sweep:
        assert {"pd_ratio", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms"} <= set(e)
        assert e["ttft_p50_ms"] <= e["ttft_p90_ms"] <= e["ttft_p99_ms"]
    best = doc["best_static"]
    assert best == min(sweep, key=lambda e: e["ttft_p99_ms"])
    assert best["pd_ratio"] != "1:7"  # one prefill instance is the worst on long prompts
    # the policies ran at 1:1 (the ADP's starting point)
    policies = doc["policies"]
    assert isinstance(policies, dict)
    assert policies["paper"]["prefill_workers_max"] == 4
    assert policies["paper"]["ttft_p99_ms"] == pytest.approx(
        next(e for e in sweep if e["pd_ratio"] == "1:1")["ttft_p99_ms"]
    )


def test_report_plots_pools_and_queue_with_rushes_shaded(
    step_runs: tuple[PolicyResult, PolicyResult], tmp_path: Path
) -> None:
    off, on = step_runs
    series = pool_series(on)
    assert len(series["t"]) == len(on.pool_series) > 0
    assert max(series["prefill_workers"]) == on.prefill_workers_max > 4
    assert max(series["queue_depth"]) > 0
    spans = rush_spans(on)
    assert spans and all(0 <= s < e <= on.sim_seconds for s, e in spans)
    # the rush covers the step's start; shading ends where the detector said it did
    assert any(s <= STEP[0] + 30 and e > STEP[0] for s, e in spans)
    report = SimReport("step", "4x-dgx-h100", "Llama-3-70B", 1, [off, on], 1.0)
    written = {p.name for p in report.write(tmp_path)}
    assert "adp_pools.png" in written
    assert (tmp_path / "adp_pools.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "adp_pools.png" in (tmp_path / "index.html").read_text()
    # without an ADP run, no pool plot
    plain = SimReport("step", "4x-dgx-h100", "Llama-3-70B", 1, [off], 1.0)
    assert "adp_pools.png" not in {p.name for p in plain.write(tmp_path / "plain")}
