"""The one dtype table (topkv.dtypes) is what every layer reads, and it matches the spec."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from topkv import dtypes
from topkv.kv import UnknownDtypeError, dtype_bytes
from topkv.transport.base import KVLayout
from topkv.wire import DType, HeaderCorrupt, UnknownDType

WIRE_FORMAT_DOC = Path(__file__).resolve().parents[1] / "docs" / "wire-format.md"


def test_wire_codes_are_the_ones_the_spec_documents() -> None:
    row = next(
        line for line in WIRE_FORMAT_DOC.read_text().splitlines() if line.startswith("| 12 |")
    )
    documented = {int(code): name for code, name in re.findall(r"(\d+) ((?:fp|bf)\w+)", row)}
    assert documented == {t.wire_code: t.name for t in dtypes.ELEMENT_TYPES}
    assert documented == {1: "fp32", 2: "fp16", 3: "bf16", 4: "fp8_e4m3", 5: "fp8_e5m2"}


def test_codes_and_names_are_unique_and_never_zero() -> None:
    codes = [t.wire_code for t in dtypes.ELEMENT_TYPES]
    assert len(set(codes)) == len(codes) and 0 not in codes
    rows = [{t.name, t.kv_name, *t.aliases} - {None} for t in dtypes.ELEMENT_TYPES]
    assert sum(map(len, rows)) == len(set().union(*rows)) == len(dtypes.BY_NAME)


@pytest.mark.parametrize("element", dtypes.ELEMENT_TYPES, ids=lambda t: t.name)
def test_the_wire_dtype_is_the_table(element: dtypes.ElementType) -> None:
    dtype = DType.from_code(element.wire_code)
    assert int(dtype) == element.wire_code
    assert dtype.wire_name == element.name
    assert dtype.itemsize == element.itemsize == np.dtype(element.numpy_storage).itemsize
    assert DType.from_name(element.name) is dtype
    for alias in element.aliases:
        assert DType.from_name(alias) is dtype


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16", "fp8"])
def test_kv_sizing_transports_and_wire_agree_on_bytes_and_code(name: str) -> None:
    element = dtypes.KV_DTYPES[name]
    assert dtype_bytes(name) == element.itemsize
    assert KVLayout(1, 1, 1, 1, name).itemsize == element.itemsize
    assert DType.from_name(name).itemsize == element.itemsize
    assert int(DType.from_name(name)) == element.wire_code


def test_fp8_means_e4m3_everywhere() -> None:
    assert dtypes.KV_DTYPES["fp8"] is dtypes.FP8_E4M3
    assert DType.from_name("fp8") is DType.FP8_E4M3
    assert set(dtypes.KV_DTYPES) == {"fp32", "fp16", "bf16", "fp8"}


def test_unknown_names_and_codes_are_refused() -> None:
    with pytest.raises(UnknownDtypeError, match="fp16"):
        dtype_bytes("fp8_e5m2")  # carried by the wire format, not a KV layout dtype
    with pytest.raises(UnknownDType, match="fp8_e5m2"):
        DType.from_name("int4")
    with pytest.raises(HeaderCorrupt, match="5=fp8_e5m2"):
        DType.from_code(0)
