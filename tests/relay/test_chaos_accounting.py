"""The chaos engine in process: faults really happen, and the accounting proves nothing was lost.

(The processes mode, the default, is tested in ``test_chaos_processes.py``.)
"""

from __future__ import annotations

import asyncio
import json

import pytest
from typer.testing import CliRunner

from topkv.cli.main import _typer_app
from topkv.errors import ConfigError
from topkv.harness.chaos import REPORT_KEYS, ChaosConfig, ChaosReport, run_chaos


def test_chaos_run_meets_every_condition_with_faults_injected() -> None:
    config = ChaosConfig(
        mode="inprocess",
        transfers=120,
        size_bytes=256 << 10,
        corrupt_rate=0.2,
        kill_decoder_after=30,
        limit=16,
    )
    report = asyncio.run(run_chaos(config))
    assert report.problems(config.limit) == []
    assert report.injected_corruptions > 0
    # Every detection was an injected flip; a flip in an attempt that the kill interrupted
    # first is never checked, so detections may be fewer than injections.
    assert 0 < report.corrupt_detected <= report.injected_corruptions
    assert report.killed == "decode-0"
    assert report.delivered + report.failed_clean == report.submitted == 120
    assert set(report.to_dict()) == set(REPORT_KEYS)


def test_problems_name_each_broken_condition() -> None:
    report = ChaosReport(submitted=3, delivered=1, lost=1, corrupt_delivered=1, max_in_flight=5)
    found = " ".join(report.problems(limit=4))
    for text in ("lost", "corrupt_delivered", "max_in_flight", "delivered + failed_clean"):
        assert text in found


def test_bad_chaos_options_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        ChaosConfig(corrupt_rate=1.5)
    with pytest.raises(ConfigError):
        ChaosConfig(decode_workers=1)
    with pytest.raises(ConfigError):
        ChaosConfig(mode="threads")  # type: ignore[arg-type]


def test_cli_prints_exactly_the_report_keys() -> None:
    result = CliRunner().invoke(
        _typer_app,
        [
            "chaos",
            "--mode",
            "inprocess",
            "--transfers",
            "40",
            "--size",
            "64KiB",
            "--kill-decoder-after",
            "10",
            "--limit",
            "8",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output.strip().splitlines()[-1])
    assert list(data) == list(REPORT_KEYS)
    assert data["submitted"] == 40 and data["lost"] == 0 and data["stranded_after"] == 0


def test_cli_rejects_an_unknown_mode() -> None:
    result = CliRunner().invoke(_typer_app, ["chaos", "--mode", "threads", "--json"])
    assert result.exit_code != 0
    assert isinstance(result.exception, ConfigError)
    assert "--mode must be processes or inprocess" in str(result.exception)
