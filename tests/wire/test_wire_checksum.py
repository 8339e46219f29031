"""CRC-64/NVME: catalog check value, an independent bitwise reference, streaming, no copies."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import topkv.wire.checksum as checksum_module
from topkv.wire import CRC64_CHECK, BufferLayoutError, WireError, as_byte_view, crc64

_POLY_REFLECTED = 0x9A6C9329AC4BC9B5  # bit-reversal of 0xAD93D23594C93659


def reference_crc64_nvme(data: bytes, crc: int = 0) -> int:
    """Bit-at-a-time CRC-64/NVME straight from its catalog parameters (slow, tiny inputs)."""
    crc ^= 0xFFFFFFFFFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (_POLY_REFLECTED if crc & 1 else 0)
    return crc ^ 0xFFFFFFFFFFFFFFFF


def test_catalog_check_value() -> None:
    assert crc64(b"123456789") == CRC64_CHECK == 0xAE8B14860A799888
    assert reference_crc64_nvme(b"123456789") == CRC64_CHECK


@given(st.binary(max_size=300))
def test_matches_bitwise_reference(data: bytes) -> None:
    assert crc64(data) == reference_crc64_nvme(data)


@given(st.binary(max_size=300), st.integers(min_value=0, max_value=300))
def test_streaming_equals_one_shot(data: bytes, cut: int) -> None:
    cut = min(cut, len(data))
    assert crc64(data[cut:], crc64(data[:cut])) == crc64(data)


def test_numpy_and_memoryview_give_the_bytes_crc() -> None:
    arr = np.arange(1000, dtype=np.float32).reshape(10, 100)
    expected = crc64(arr.tobytes())
    assert crc64(arr) == expected
    assert crc64(arr.data) == expected
    assert crc64(arr.data.cast("B")[40:], crc64(arr.tobytes()[:40])) == expected
    big_endian = arr.astype(">f4")
    assert crc64(big_endian) == crc64(big_endian.tobytes())


def test_byte_view_shares_memory() -> None:
    arr = np.zeros((4, 8), dtype=np.float16)
    view = as_byte_view(arr)
    assert view.nbytes == arr.nbytes and view.format == "B"
    assert np.shares_memory(np.frombuffer(view, dtype=np.uint8), arr)


def test_non_contiguous_is_rejected_clearly() -> None:
    arr = np.zeros((8, 8), dtype=np.float32)
    with pytest.raises(BufferLayoutError, match="not C-contiguous"):
        crc64(arr[:, ::2])
    with pytest.raises(BufferLayoutError, match="not C-contiguous"):
        crc64(arr.T)


@pytest.mark.parametrize("bad", ["text", 12, None, [1, 2]])
def test_non_buffers_are_rejected(bad: object) -> None:
    with pytest.raises(BufferLayoutError):
        crc64(bad)


@pytest.mark.parametrize("bad_crc", [-1, 1 << 64])
def test_running_value_must_be_u64(bad_crc: int) -> None:
    with pytest.raises(WireError):
        crc64(b"x", bad_crc)


def test_chunked_path_equals_single_call(monkeypatch: pytest.MonkeyPatch) -> None:
    data = np.random.default_rng(1).integers(0, 256, size=10_000, dtype=np.uint8)
    expected = crc64(data)
    monkeypatch.setattr(checksum_module, "_CHUNK_BYTES", 333)
    assert crc64(data) == expected
