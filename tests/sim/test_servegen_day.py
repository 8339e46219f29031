"""The packaged ServeGen day (``topkv/data/servegen_m_large_day1.csv.gz``): a rate table of
all 162 m-large clients over the first day, read like the release's per-client rate files."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from topkv.errors import TopKVError
from topkv.packaged import SERVEGEN_DAY
from topkv.traces import (
    SERVEGEN_TABLE_HEADER,
    ServeGenOptions,
    detect_format,
    load_trace,
    read_servegen,
    servegen_clients,
    servegen_profile,
)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "servegen" / "m-large"


def test_the_day_is_144_windows_of_162_clients() -> None:
    assert detect_format(SERVEGEN_DAY) == "servegen"
    assert SERVEGEN_DAY.stat().st_size < 200_000  # well under 1 MB in the package
    clients = servegen_clients(SERVEGEN_DAY)
    assert len(clients) == 162
    starts = [600.0 * i for i in range(144)]
    assert all([w[0] for w in windows] == starts for windows in clients)
    totals = [rate for _, rate in servegen_profile(SERVEGEN_DAY)]
    # what the data README states: 151 to 583 req/s, a mean of 279 (diurnal: 3.9x)
    assert min(totals) == pytest.approx(151.17, abs=0.01)
    assert max(totals) == pytest.approx(582.99, abs=0.01)
    assert sum(totals) / len(totals) == pytest.approx(279.3, abs=0.05)
    assert totals.index(max(totals)) != totals.index(min(totals))


def test_the_fixture_slice_is_the_same_data() -> None:
    """The test slice (the first 2 hours of clients 0, 1 and 5, as released) matches the
    packaged day's windows for those clients exactly."""
    day = servegen_clients(SERVEGEN_DAY)
    for number, index in (("0", 0), ("1", 1), ("5", 5)):
        (released,) = servegen_clients(FIXTURE / f"chunk-{number}-trace.csv")
        assert day[index][: len(released)] == released


def _table(tmp_path: Path, gz: bool) -> Path:
    """The fixture's three rate files as one rate table (the packaged format)."""
    lines = [",".join(SERVEGEN_TABLE_HEADER)]
    for number in ("0", "1", "5"):
        for row in (FIXTURE / f"chunk-{number}-trace.csv").read_text().splitlines():
            start, rate, _cv, dist, shape, _scale = row.split(",")
            lines.append(",".join((number, start, rate, dist, shape)))
    text = "\n".join(lines) + "\n"
    if gz:
        path = tmp_path / "table.csv.gz"
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path = tmp_path / "table.csv"
        path.write_text(text)
    return path


@pytest.mark.parametrize("gz", [False, True])
def test_a_rate_table_reads_as_the_per_client_files(tmp_path: Path, gz: bool) -> None:
    options = ServeGenOptions(start_s=0.0, duration_s=7200.0, seed=3)
    from_files = read_servegen(FIXTURE, options)
    from_table = load_trace(_table(tmp_path, gz), servegen=options)
    assert len(from_files) > 1000
    assert from_table.requests == from_files.requests


def test_the_rate_scale_thins_every_client() -> None:
    """At 1% of the rates, each hour of the day carries 1% of its requests: the diurnal
    shape is kept (each window's process starts at a random phase within one mean gap, a
    few percent more arrivals when a window holds only a handful per client)."""
    expected = [0.0] * 24
    for start, rate in servegen_profile(SERVEGEN_DAY):
        expected[int(start // 3600)] += rate * 600.0 * 0.01
    options = ServeGenOptions(start_s=0.0, duration_s=86400.0, rate_scale=0.01, seed=0)
    workload = read_servegen(SERVEGEN_DAY, options)
    assert workload.name.endswith("x0.01")
    assert len(workload) == pytest.approx(sum(expected), rel=0.06)
    hours = [0] * 24
    for r in workload.requests:
        hours[min(23, int(r.arrival_s // 3600))] += 1
    for got, want in zip(hours, expected, strict=True):
        assert got == pytest.approx(want, rel=0.2)
    assert hours.index(min(hours)) in (3, 4, 5, 12) and max(hours) > 1.7 * min(hours)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(TopKVError, match="rate scale"):
            read_servegen(SERVEGEN_DAY, ServeGenOptions(rate_scale=bad))


def test_a_malformed_table_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    header = ",".join(SERVEGEN_TABLE_HEADER)
    path.write_text(f"{header}\n0,0,1.0,Gamma,0.5\n0,600,1.0,Gamma\n")
    with pytest.raises(TopKVError, match=r"bad\.csv:3: expected 5 fields"):
        read_servegen(path)
    path.write_text(f"{header}\n0,600,1.0,Gamma,0.5\n0,0,1.0,Gamma,0.5\n")
    with pytest.raises(TopKVError, match=r"bad\.csv:3: window starts must increase"):
        read_servegen(path)
    path.write_text(f"{header}\n0,0,1.0,Poisson,0.5\n")
    with pytest.raises(TopKVError, match=r"bad\.csv:2: distribution 'Poisson'"):
        read_servegen(path)
    broken = tmp_path / "broken.csv.gz"
    broken.write_bytes(gzip.compress(f"{header}\n0,0,1.0,Gamma,0.5\n".encode())[:-12])
    with pytest.raises(TopKVError, match=r"broken\.csv\.gz: not a readable gzip file"):
        read_servegen(broken)
