"""Hypothesis fuzzing: the parsers raise only ParseError, whatever the input."""

from __future__ import annotations

import contextlib
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from topkv.topology.detect.errors import ParseError
from topkv.topology.detect.lspci import parse_lspci_listing, parse_lspci_tree
from topkv.topology.detect.nvidia_smi import (
    parse_fabric,
    parse_nvlink,
    parse_smi_query,
    parse_topo_matrix,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SEEDS = [
    p.read_text() for d in ("nvidia-smi-topo", "nvlink", "lspci") for p in (FIXTURES / d).iterdir()
]
PARSERS = [
    parse_topo_matrix,
    parse_nvlink,
    parse_smi_query,
    parse_fabric,
    parse_lspci_tree,
    parse_lspci_listing,
]
TOKENS = st.sampled_from(
    [
        "GPU0",
        "GPU1",
        "NIC0",
        "mlx5_0",
        " X ",
        "NV18",
        "PIX",
        "SYS",
        "\t",
        "  ",
        "\n",
        "0-3",
        "CPU Affinity",
        "Link 0: ",
        "26.5 GB/s",
        "Fabric",
        "    Status : Success",
        "+-",
        "\\-",
        "-[0000:00]-+-",
        "00.0",
        "-[01]--",
        "|",
        "01:00.0 3D controller: NVIDIA",
        "\x1b[4m",
        ":",
    ]
)


def _mutate(seed: str, cut: int, insert: str) -> str:
    cut = cut % (len(seed) + 1)
    return seed[:cut] + insert + seed[cut:]


def _only_parse_errors(text: str) -> None:
    for parser in PARSERS:
        with contextlib.suppress(ParseError):
            parser(text)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=400))
def test_random_text(text: str) -> None:
    _only_parse_errors(text)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(TOKENS, max_size=60).map("".join))
def test_token_soup(text: str) -> None:
    _only_parse_errors(text)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(SEEDS), st.integers(min_value=0), st.text(max_size=20), st.integers(0, 3))
def test_mutated_fixtures(seed: str, cut: int, insert: str, mode: int) -> None:
    if mode == 0:
        text = _mutate(seed, cut, insert)
    elif mode == 1:
        text = seed[: cut % (len(seed) + 1)]
    elif mode == 2:
        lines = seed.splitlines()
        if lines:
            del lines[cut % len(lines)]
        text = "\n".join(lines)
    else:
        text = seed.replace("\t", insert or " ")
    _only_parse_errors(text)
