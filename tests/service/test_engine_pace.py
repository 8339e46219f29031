"""Paced compute (``topkv worker --compute-pace C``): each engine turn lasts C x its CPU time.

The pacer's arithmetic runs on injected clocks (exact); one real turn that burns CPU checks
the lower bound only (a loaded host may make it longer, never shorter).
"""

from __future__ import annotations

import math
import threading
import time

import pytest
import typer
from prometheus_client import CollectorRegistry, generate_latest
from typer.testing import CliRunner

from topkv.cli.services import register
from topkv.errors import ConfigError
from topkv.service.compute.engines import EngineSpec, EngineTurns
from topkv.service.compute.pace import (
    ComputePacer,
    PaceCollector,
    PaceStats,
    check_pace,
    check_torch_threads,
)


class FakeClocks:
    """A wall clock, a CPU clock and a sleep the test moves by hand."""

    def __init__(self) -> None:
        self.wall = 100.0
        self.cpu = 7.0
        self.slept: list[float] = []

    def compute(self, seconds: float, contention: float = 1.0) -> None:
        """``seconds`` of CPU, taking ``contention`` times as long on the wall."""
        self.cpu += seconds
        self.wall += seconds * contention

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.wall += seconds

    def pacer(self, pace: float) -> ComputePacer:
        return ComputePacer(
            pace, cpu_clock=lambda: self.cpu, wall_clock=lambda: self.wall, sleep=self.sleep
        )


def test_a_turn_is_held_until_pace_times_its_cpu_time() -> None:
    clocks = FakeClocks()
    pacer = clocks.pacer(2.5)
    mark = pacer.start()
    clocks.compute(0.4)  # uncontended: 0.4 s on the wall
    pacer.end(mark)
    assert clocks.wall == pytest.approx(100.0 + 2.5 * 0.4)
    assert pacer.stats() == PaceStats(
        turns=1, overruns=0, overrun_s=0.0, held_s=pytest.approx(0.6), busy_s=pytest.approx(1.0)
    )


def test_a_contended_turn_is_held_only_for_what_is_left() -> None:
    clocks = FakeClocks()
    pacer = clocks.pacer(3.0)
    mark = pacer.start()
    clocks.compute(0.5, contention=2.0)  # another process took half the core: 1 s
    pacer.end(mark)
    assert clocks.wall == pytest.approx(101.5)  # 3 x 0.5, whatever the contention
    assert pacer.stats().overruns == 0 and pacer.stats().held_s == pytest.approx(0.5)


def test_a_turn_past_pace_times_cpu_is_an_overrun_and_not_held() -> None:
    clocks = FakeClocks()
    pacer = clocks.pacer(2.0)
    mark = pacer.start()
    clocks.compute(0.1)
    clocks.wall += 0.5  # waited without computing (a core, the GIL): 0.6 s > 2 x 0.1
    pacer.end(mark)
    assert clocks.slept == []
    stats = pacer.stats()
    assert (stats.turns, stats.overruns) == (1, 1)
    assert stats.overrun_s == pytest.approx(0.4) and stats.held_s == 0.0
    mark = pacer.start()  # the next turn is paced again
    clocks.compute(0.1)
    pacer.end(mark)
    assert pacer.stats().as_json() == {"turns": 2, "overruns": 1, "overrun_s": 0.4,
                                       "held_s": 0.1, "busy_s": 0.8}  # fmt: skip


def test_a_layer_is_held_until_pace_times_the_cpu_so_far() -> None:
    clocks = FakeClocks()
    pacer = clocks.pacer(2.0)
    mark = pacer.start()
    clocks.compute(0.2)
    pacer.hold(mark)  # a layer published at 2 x 0.2
    assert clocks.wall == pytest.approx(100.4)
    clocks.compute(0.3)
    pacer.end(mark)
    assert clocks.wall == pytest.approx(101.0)  # 2 x 0.5 in all
    assert pacer.stats().turns == 1 and pacer.stats().held_s == pytest.approx(0.5)


def test_a_short_sleep_is_slept_again() -> None:
    clocks = FakeClocks()
    short = ComputePacer(
        2.0,
        cpu_clock=lambda: clocks.cpu,
        wall_clock=lambda: clocks.wall,
        sleep=lambda s: clocks.sleep(s / 2),  # wakes half-way each time
    )
    mark = short.start()
    clocks.compute(1.0)
    short.end(mark)
    assert clocks.wall >= 102.0 - 1e-9 and len(clocks.slept) > 1


def test_the_turns_pace_each_span_the_model_is_held() -> None:
    clocks = FakeClocks()
    turns = EngineTurns(clocks.pacer(2.0))
    ran: list[str] = []
    with turns.turn("decode"):
        clocks.compute(0.1)
        waiter = threading.Thread(target=lambda: _one_turn(turns, ran))
        waiter.start()
        while not turns.waiting("prefill"):
            time.sleep(0.001)
        turns.yield_to("prefill", "decode")  # the decode's first span ends: one turn
        clocks.compute(0.1)
    waiter.join()
    assert ran == ["prefill"]
    assert turns.pacer is not None and turns.pacer.stats().turns == 3


def _one_turn(turns: EngineTurns, ran: list[str]) -> None:
    with turns.turn("prefill"):
        ran.append("prefill")


def _burn(seconds: float) -> float:
    """Burn at least ``seconds`` of this thread's CPU; the CPU seconds burnt."""
    start = time.thread_time()
    x = 0
    while time.thread_time() - start < seconds:
        x += sum(range(1000))
    return time.thread_time() - start


def test_a_real_turn_lasts_at_least_pace_times_its_cpu_time() -> None:
    turns = EngineTurns(ComputePacer(3.0))
    began = time.perf_counter()
    with turns.turn("prefill"):
        burnt = _burn(0.03)
    wall = time.perf_counter() - began
    assert wall >= 3.0 * burnt  # a lower bound only: a loaded host may add, never take
    assert turns.pacer is not None and turns.pacer.stats().turns == 1


def test_without_a_pace_no_turn_is_held(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    turns = EngineTurns()
    with turns.turn("prefill"):
        _burn(0.01)
        turns.pace_layer()
    assert turns.pacer is None and slept == []
    assert EngineSpec(kind="hf", demo_seed=0).compute_pace is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0.5, "--compute-pace must be >= 1"),
        (0.0, "--compute-pace must be >= 1"),
        (-2.0, "--compute-pace must be >= 1"),
        (math.nan, "--compute-pace must be a number >= 1, got nan"),
        (math.inf, "--compute-pace must be finite, got inf"),
        (-math.inf, "--compute-pace must be finite, got -inf"),
    ],
)
def test_a_bad_pace_is_named(value: float, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_pace(value)
    with pytest.raises(ConfigError, match=message):
        EngineSpec(kind="hf", demo_seed=0, torch_threads=1, compute_pace=value)


def test_the_pace_needs_a_model_on_one_torch_thread() -> None:
    assert check_pace(None) is None and check_pace(1) == 1.0
    with pytest.raises(ConfigError, match="needs --engine hf"):
        EngineSpec(compute_pace=2.0)
    with pytest.raises(ConfigError, match="give --torch-threads 1 \\(got 0\\)"):
        EngineSpec(kind="hf", demo_seed=0, compute_pace=2.0)
    with pytest.raises(ConfigError, match="it runs 4"):
        check_torch_threads(4)
    spec = EngineSpec(kind="hf", demo_seed=0, torch_threads=1, compute_pace=2.0)
    assert spec.cli_args()[-2:] == ["--compute-pace", "2.0"]
    assert "--compute-pace" not in EngineSpec(kind="hf", demo_seed=0).cli_args()


def test_the_worker_flag_is_checked_before_the_worker_starts() -> None:
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    base = ["worker", "--role", "prefill", "--engine", "hf", "--demo-model", "0"]
    for value, message in (
        ("nan", "must be a number >= 1, got nan"),
        ("inf", "must be finite, got inf"),
        ("0.9", "must be >= 1"),
    ):
        result = CliRunner().invoke(app, [*base, "--torch-threads", "1", "--compute-pace", value])
        assert isinstance(result.exception, ConfigError), result.output
        assert message in str(result.exception)
    result = CliRunner().invoke(app, [*base, "--compute-pace", "2"])
    assert "give --torch-threads 1" in str(result.exception)


def test_the_metrics_count_turns_and_overruns() -> None:
    clocks = FakeClocks()
    pacer = clocks.pacer(2.0)
    for extra_wait in (0.0, 1.0):
        mark = pacer.start()
        clocks.compute(0.25)
        clocks.wall += extra_wait
        pacer.end(mark)
    registry = CollectorRegistry()
    registry.register(PaceCollector(pacer))
    text = generate_latest(registry).decode()
    assert "topkv_engine_compute_pace 2.0" in text
    assert "topkv_engine_paced_turns_total 2.0" in text
    assert "topkv_engine_pace_overruns_total 1.0" in text
    assert "topkv_engine_pace_overrun_seconds_total 0.75" in text
    assert pacer.describe() == {"pace": 2.0, "clock": "thread_time", "turns": 2,
                                "overruns": 1, "overrun_s": 0.75, "held_s": 0.25,
                                "busy_s": 1.75}  # fmt: skip
    assert PaceStats.of(pacer.stats().as_json()) == pacer.stats()
    with pytest.raises(ValueError, match="compute pace stats"):
        PaceStats.of({"turns": 1})


@pytest.mark.model
def test_a_paced_model_engine_counts_its_turns_and_keeps_its_tokens() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from topkv.engine import DemoModelConfig
    from topkv.service.compute.engines import HfEngine
    from topkv.service.kvstore import HeldKV
    from topkv.service.messages import PrefillRequest

    small = DemoModelConfig(layers=4, hidden_size=64, heads=4, kv_heads=2, head_dim=16,
                            intermediate_size=128, vocab_size=512, init_std=0.25)  # fmt: skip
    threads = torch.get_num_threads()
    try:
        tokens = []
        for pace in (None, 1.5):
            spec = EngineSpec("hf", demo_seed=5, demo_config=small, torch_threads=1,
                              compute_pace=pace)  # fmt: skip
            engine = HfEngine.build(spec)
            plan = engine.plan(1, PrefillRequest(prompt_seed=1, prompt_tokens=40))
            kv = HeldKV.producing(1, plan.model_id, plan.layout)
            kv.finish(engine.prefill(plan, kv.publish))
            assert kv.first_token is not None
            tokens.append(engine.decode(kv, kv.first_token, 4))
        assert engine.turns.pacer is not None
        assert engine.turns.pacer.stats().turns == 2  # the prefill's pass, the decode's steps
        described = engine.describe()["compute_pace"]
        assert isinstance(described, dict) and described["pace"] == 1.5
        assert described["turns"] == 2
        assert tokens[0] == tokens[1]
    finally:
        torch.set_num_threads(threads)
