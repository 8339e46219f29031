"""rocm-smi --showtopo parser: both AMD fixtures, other section forms, JSON, fuzzing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fuzzing import fuzz_arbitrary_text, fuzz_mutated_fixtures
from hypothesis import strategies as st

from topkv.topology.detect.errors import ParseError
from topkv.topology.detect.rocm import RocmTopology, parse_rocm_smi_showtopo

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SHOWTOPO = FIXTURES / "nvidia-smi-topo" / "rocm-smi-lib-108-4gpu-pcie-showtopo-partial.txt"
SHOWTOPONUMA = FIXTURES / "numa" / "rocm-legacy-4740-8gpu-rocm-smi-showtoponuma.txt"


def test_showtopo_four_gpus_all_pcie() -> None:
    topo = parse_rocm_smi_showtopo(SHOWTOPO.read_text())
    assert topo.gpus == (0, 1, 2, 3)
    pairs = {(a, b) for a in range(4) for b in range(4) if a != b}
    assert set(topo.link_types) == pairs and set(topo.link_types.values()) == {"PCIE"}
    assert topo.hops == dict.fromkeys(pairs, 3)
    assert topo.weights == dict.fromkeys(pairs, 52)
    assert topo.numa == {}  # the Numa Nodes section was cut from this copy


def test_showtoponuma_eight_gpus_two_nodes() -> None:
    topo = parse_rocm_smi_showtopo(SHOWTOPONUMA.read_text())
    assert topo == RocmTopology(
        gpus=tuple(range(8)),
        link_types={},
        hops={},
        weights={},
        numa={0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1, 7: 1},
    )


XGMI_TEXT = """
============================ ROCm System Management Interface ============================
================================ Weight between two GPUs =================================
       GPU0         GPU1         GPU2
GPU0   0            15           15
GPU1   15           0            15
GPU2   15           15           0

================================= Hops between two GPUs ==================================
       GPU0         GPU1         GPU2
GPU0   0            1            1
GPU1   1            0            1
GPU2   1            1            0

=============================== Link Type between two GPUs ===============================
       GPU0         GPU1         GPU2
GPU0   0            XGMI         XGMI
GPU1   XGMI         0            XGMI
GPU2   XGMI         XGMI         0

======================================= Numa Nodes =======================================
GPU[0]          : (Topology) Numa Node: 0
GPU[0]          : (Topology) Numa Affinity: 0
GPU[1]          : (Topology) Numa Node: 0
GPU[1]          : (Topology) Numa Affinity: -1
GPU[2]          : (Topology) Numa Node: 1
GPU[2]          : (Topology) Numa Affinity: 1
================================== End of ROCm SMI Log ===================================
"""


def test_full_showtopo_with_xgmi_and_numa() -> None:
    topo = parse_rocm_smi_showtopo(XGMI_TEXT)
    assert topo.gpus == (0, 1, 2)
    assert topo.link_types[(0, 2)] == "XGMI" and len(topo.link_types) == 6
    assert topo.hops[(2, 1)] == 1 and topo.weights[(1, 0)] == 15
    assert topo.numa == {0: 0, 1: 0, 2: 1}


def test_tabs_ansi_and_crlf() -> None:
    text = "\x1b[1m" + XGMI_TEXT.replace("         ", "\t").replace("\n", "\r\n") + "\x1b[0m"
    assert parse_rocm_smi_showtopo(text) == parse_rocm_smi_showtopo(XGMI_TEXT)


def test_json_form() -> None:
    doc = {
        "card0": {"(Topology) Numa Node": "0", "(Topology) Numa Affinity": "0"},
        "card1": {"(Topology) Numa Node": "1", "(Topology) Numa Affinity": "1"},
        "system": {
            "(Topology) Weight between DRM devices 0 and 1": "15",
            "(Topology) Hops between DRM devices 0 and 1": "1",
            "(Topology) Link type between DRM devices 0 and 1": "XGMI",
        },
    }
    topo = parse_rocm_smi_showtopo(json.dumps(doc))
    assert topo.gpus == (0, 1)
    assert (topo.link_types, topo.hops, topo.weights) == (
        {(0, 1): "XGMI"},
        {(0, 1): 1},
        {(0, 1): 15},
    )
    assert topo.numa == {0: 0, 1: 1}


@pytest.mark.parametrize(
    "text",
    ["", "   \n", "GPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV18\t0-63\n", "hello\n"],
)
def test_non_rocm_text_raises(text: str) -> None:
    with pytest.raises(ParseError, match="rocm-smi"):
        parse_rocm_smi_showtopo(text)


ALL_TEXTS = [SHOWTOPO.read_text(), SHOWTOPONUMA.read_text(), XGMI_TEXT]
ALPHABET = st.sampled_from(list("GPU[]0123456789 \t\n:=-XGMIPCENumaNodeTopology()\x1b"))


def _only_parse_errors(text: str) -> None:
    try:
        topo = parse_rocm_smi_showtopo(text)
    except ParseError:
        return
    assert topo.gpus == tuple(sorted(set(topo.gpus)))
    assert all(a in topo.gpus and b in topo.gpus for a, b in topo.link_types)


@fuzz_arbitrary_text(ALPHABET)
def test_fuzz_arbitrary_text(text: str) -> None:
    _only_parse_errors(text)


@fuzz_mutated_fixtures(ALL_TEXTS, ALPHABET)
def test_fuzz_mutated_fixtures(text: str) -> None:
    _only_parse_errors(text)
