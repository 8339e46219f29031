"""Trace readers on slices of the real traces, malformed rows, synthetic arrivals."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from topkv.errors import ConfigError
from topkv.traces import (
    ServeGenOptions,
    TraceError,
    TraceFormatError,
    detect_format,
    load_trace,
    read_azure_csv,
    read_mooncake_jsonl,
    read_servegen,
    scale_rate,
    synthetic,
)

TRACES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"


def _slice(src: Path, dst: Path, lines: int) -> Path:
    with src.open(encoding="utf-8") as handle:
        dst.write_text("".join(islice(handle, lines)), encoding="utf-8")
    return dst


@pytest.mark.parametrize("name", ["code", "conv"])
def test_azure_slices_read(tmp_path: Path, name: str) -> None:
    src = TRACES / "azure_2023" / f"AzureLLMInferenceTrace_{name}.csv"
    w = load_trace(_slice(src, tmp_path / "a.csv", 301))
    assert detect_format(tmp_path / "a.csv") == "azure"
    assert len(w) == 300
    assert w.requests[0].arrival_s == 0.0
    arrivals = [r.arrival_s for r in w.requests]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 1.0
    assert all(r.input_tokens >= 1 and r.output_tokens >= 1 for r in w.requests)


def test_azure_first_rows_exact(tmp_path: Path) -> None:
    src = TRACES / "azure_2023" / "AzureLLMInferenceTrace_conv.csv"
    w = read_azure_csv(_slice(src, tmp_path / "a.csv", 3))
    # 18:15:46.6805900 -> 18:15:50.9951690
    assert w.requests[1].arrival_s == pytest.approx(4.314579, abs=1e-6)
    assert (w.requests[0].input_tokens, w.requests[0].output_tokens) == (374, 44)


def test_mooncake_slice_with_jitter(tmp_path: Path) -> None:
    src = TRACES / "mooncake" / "conversation_trace.jsonl"
    path = _slice(src, tmp_path / "m.jsonl", 400)
    plain = read_mooncake_jsonl(path, jitter_s=0.0)
    jittered = read_mooncake_jsonl(path, jitter_s=3.0, seed=1)
    assert len(plain) == len(jittered) == 400
    # quantized: many equal timestamps without jitter, none with it
    assert len({r.arrival_s for r in plain.requests}) < 400
    assert len({r.arrival_s for r in jittered.requests}) == 400
    assert jittered.duration_s == pytest.approx(plain.duration_s, abs=3.0)


def test_servegen_directory_slice(tmp_path: Path) -> None:
    src = TRACES / "servegen" / "m-large"
    folder = tmp_path / "sg"
    folder.mkdir()
    for name in ("chunk-0-trace.csv", "chunk-1-trace.csv", "chunk-5-trace.csv"):
        _slice(src / name, folder / name, 12)
    options = ServeGenOptions(start_s=0.0, duration_s=3600.0, seed=3)
    w = read_servegen(folder, options)
    assert detect_format(folder) == "servegen"
    # expected count: sum of rate * window over the hour, within sampling noise
    expected = 0.0
    for name in ("chunk-0-trace.csv", "chunk-1-trace.csv", "chunk-5-trace.csv"):
        for line in (folder / name).read_text().splitlines()[:6]:
            expected += float(line.split(",")[1]) * 600
    assert len(w) == pytest.approx(expected, rel=0.25)
    assert w.requests[-1].arrival_s < 3600.0


def test_servegen_renewal_rate_and_burstiness(tmp_path: Path) -> None:
    path = tmp_path / "c.csv"
    path.write_text("0,20.0,3.0,Gamma,0.1111,1.0\n600,0,0,,0,0\n", encoding="utf-8")
    w = read_servegen(path, ServeGenOptions(duration_s=600.0))
    assert len(w) == pytest.approx(20.0 * 600, rel=0.1)
    gaps = np.diff([r.arrival_s for r in w.requests])
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.2)


@pytest.mark.parametrize(
    ("content", "line", "needle"),
    [
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10,2\nbad,1,2\n",
            3,
            "timestamp",
        ),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,ten,2\n", 2, "integer"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10\n", 2, "3 fields"),
        ("time,a,b\n", 1, "header"),
    ],
)
def test_azure_malformed_rows_name_the_line(
    tmp_path: Path, content: str, line: int, needle: str
) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(TraceFormatError) as info:
        read_azure_csv(path)
    assert info.value.line == line
    assert needle in str(info.value)
    assert isinstance(info.value, ConfigError)


def test_mooncake_malformed_row(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"timestamp": 0, "input_length": 5, "output_length": 2})
    path.write_text(f'{good}\n{good}\n{{"timestamp": 1, "input_length": "x"}}\n')
    with pytest.raises(TraceFormatError, match=r"bad.jsonl:3: 'input_length'"):
        read_mooncake_jsonl(path)
    path.write_text(f"{good}\nnot json\n")
    with pytest.raises(TraceFormatError, match=r":2: invalid JSON"):
        read_mooncake_jsonl(path)


def test_servegen_malformed_row(tmp_path: Path) -> None:
    path = tmp_path / "c.csv"
    path.write_text("0,1.0,1.0,Gamma,1.0,1.0\n600,1.0,1.0,Lognormal,1.0,1.0\n")
    with pytest.raises(TraceFormatError, match=r"c.csv:2: distribution"):
        read_servegen(path)
    path.write_text("0,1.0,1.0,Gamma,1.0\n")
    with pytest.raises(TraceFormatError, match=r"c.csv:1: expected 6 fields"):
        read_servegen(path)


def test_unknown_format(tmp_path: Path) -> None:
    path = tmp_path / "x.txt"
    path.write_text("hello world\n")
    with pytest.raises(TraceError, match="cannot tell the trace format"):
        load_trace(path)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(0, 86_399_999_999), st.integers(1, 200_000), st.integers(1, 10_000)),
        min_size=1,
        max_size=30,
    )
)
def test_azure_round_trip_property(
    tmp_path_factory: pytest.TempPathFactory, rows: list[tuple[int, int, int]]
) -> None:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for micros_x10, inp, out in rows:
        seconds, frac = divmod(micros_x10, 10_000_000)
        h, rem = divmod(seconds, 3600)
        m, s = divmod(rem, 60)
        lines.append(f"2023-11-16 {h:02d}:{m:02d}:{s:02d}.{frac:07d},{inp},{out}")
    path = tmp_path_factory.mktemp("p") / "t.csv"
    path.write_text("\n".join(lines), encoding="utf-8")
    w = read_azure_csv(path)
    stamps = sorted(r[0] / 1e7 for r in rows)
    got = [r.arrival_s for r in w.requests]
    assert got == pytest.approx([t - stamps[0] for t in stamps], abs=1e-6)
    assert sorted((r.input_tokens, r.output_tokens) for r in w.requests) == sorted(
        (r[1], r[2]) for r in rows
    )


def test_synthetic_poisson_and_gamma() -> None:
    poisson = synthetic(20_000, rate_rps=50.0, seed=1)
    gaps = np.diff([r.arrival_s for r in poisson.requests])
    assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)
    bursty = synthetic(20_000, rate_rps=50.0, cv=4.0, seed=1)
    gaps = np.diff([r.arrival_s for r in bursty.requests])
    assert gaps.std() / gaps.mean() == pytest.approx(4.0, rel=0.15)


def test_rate_scaling() -> None:
    w = synthetic(100, rate_rps=10.0, seed=2)
    doubled = scale_rate(w, 2.0)
    assert doubled.duration_s == pytest.approx(w.duration_s / 2)
    with pytest.raises(TraceError):
        scale_rate(w, 0.0)
