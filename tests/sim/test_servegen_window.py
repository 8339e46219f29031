"""ServeGen rate files whose first windows are idle start at the first active window."""

from __future__ import annotations

from pathlib import Path

import pytest

from topkv.errors import TopKVError
from topkv.traces import ServeGenOptions, read_servegen

ROWS = [
    "0,0,0,,0,0",
    "600,0,0,,0,0",
    "1200,5.0,1.0,Gamma,1.0,0.2",
    "1800,5.0,1.0,Gamma,1.0,0.2",
]


def _write(tmp_path: Path) -> Path:
    path = tmp_path / "chunk-1-trace.csv"
    path.write_text("\n".join(ROWS) + "\n")
    return path


def test_default_window_is_the_first_active_one(tmp_path: Path) -> None:
    workload = read_servegen(_write(tmp_path), ServeGenOptions(duration_s=600, seed=1))
    # 5 req/s for 600 s: about 3000 requests (Poisson-like, cv 1).
    assert 2500 < len(workload.requests) < 3500


def test_an_explicit_idle_window_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TopKVError, match="no requests between 0 s and 600 s"):
        read_servegen(_write(tmp_path), ServeGenOptions(start_s=0, duration_s=600))
