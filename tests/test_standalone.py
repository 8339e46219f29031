"""The repository stands alone: defaults come from the package, nothing reads the team folder."""

from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from topkv.cli.main import _typer_app
from topkv.demo.topology import find_fixture
from topkv.demo.workload import find_trace
from topkv.packaged import DATA_DIR, H100_TOPOLOGY, SAMPLE_TRACE, packaged_file
from topkv.traces import read_azure_csv

ROOT = Path(__file__).resolve().parents[1]
#: ``..`` then the team's folder name; assembled so that this file does not match itself.
OUTSIDE = re.compile(r"\.\./" + "shared" + r"|/ \"" + "shared" + r"\" /")


def test_packaged_sample_is_the_first_4000_azure_requests_with_its_license() -> None:
    workload = read_azure_csv(SAMPLE_TRACE)
    assert len(workload) == 4000
    first = workload.requests[0]
    assert (first.arrival_s, first.input_tokens, first.output_tokens) == (0.0, 374, 44)
    assert "Attribution 4.0 International" in (DATA_DIR / "LICENSE-azure-2023-CC-BY-4.0").read_text(
        encoding="utf-8-sig"
    )
    readme = (DATA_DIR / "README.md").read_text(encoding="utf-8")
    assert SAMPLE_TRACE.name in readme and H100_TOPOLOGY.name in readme and "CC-BY 4.0" in readme


def test_demo_defaults_are_packaged_files() -> None:
    assert find_trace() == SAMPLE_TRACE
    assert find_fixture() == H100_TOPOLOGY
    assert packaged_file("../README.md") is None
    assert packaged_file("no-such-file.txt") is None


def test_sim_without_trace_runs_the_packaged_sample() -> None:
    result = CliRunner().invoke(_typer_app, ["sim", "--limit", "40", "--policy", "paper", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout.strip().splitlines()[-1])
    assert doc["requests"] == 40


def test_no_project_file_reads_outside_the_repository() -> None:
    places = [ROOT / d for d in ("src", "tests", "benchmarks", "scripts", ".ci")]
    files = [
        p
        for d in places
        for p in d.rglob("*")
        if p.is_file() and p.suffix not in {".pyc", ".so"} and ".egg-info" not in str(p)
    ]
    files.append(ROOT / "Makefile")
    offenders = []
    for path in files:
        if "fixtures" in path.relative_to(ROOT).parts and path.name == "SOURCES.md":
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        offenders += [
            f"{path.relative_to(ROOT)}:{n}"
            for n, line in enumerate(text.splitlines(), 1)
            if OUTSIDE.search(line)
        ]
    assert offenders == []
