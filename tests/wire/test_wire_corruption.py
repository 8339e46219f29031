"""Untrusted input: every single-byte corruption, truncation, forged fields and random bytes
must end in a specific WireError, and never in an allocation sized by the header."""

from __future__ import annotations

import contextlib
import inspect
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wire_helpers import forge_header, random_tensor

import topkv.wire as wire
from topkv.errors import TopKVError
from topkv.wire import (
    HEADER_SIZE,
    MAGIC,
    WIRE_VERSION,
    BadMagic,
    DType,
    FrameChecksumMismatch,
    HeaderCorrupt,
    SizeLimitExceeded,
    SizeMismatch,
    TruncatedFrame,
    UnsupportedVersion,
    WireError,
    WireLimits,
    crc64,
    decode_frame,
    decode_kv,
    decode_layer_frame,
    encode_kv,
    encode_layer_frame,
    expected_payload_bytes,
    unpack_header,
)

Decoder = Callable[[Any], object]


def _full_frame(mla: bool = False, shape: tuple[int, ...] = (1, 2, 1, 4)) -> bytes:
    rng = np.random.default_rng(42)
    k = random_tensor(rng, shape, DType.FP16)
    v = None if mla else random_tensor(rng, shape, DType.FP16)
    layers, seq_len, kv_heads, head_dim = shape
    return encode_kv(
        k,
        v,
        request_id="corrupt-me",
        model_id=5,
        dtype=DType.FP16,
        seq_len=seq_len,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
    ).to_bytes()


def _layer_frame(mla: bool = False) -> bytes:
    rng = np.random.default_rng(7)
    k = random_tensor(rng, (3, 2, 4), DType.FP32)
    v = None if mla else random_tensor(rng, (3, 2, 4), DType.FP32)
    return encode_layer_frame(
        k,
        v,
        request_id="layer",
        model_id=5,
        dtype=DType.FP32,
        seq_len=3,
        layers=4,
        layer_index=2,
        kv_heads=2,
        head_dim=4,
    ).to_bytes()


def _expected_error(position: int, k_bytes: int) -> tuple[type[WireError], str | None]:
    """Which error a corrupted byte at ``position`` must raise (and, for CRCs, which part)."""
    if position < 8:
        return BadMagic, None
    if position < 10:
        return UnsupportedVersion, None
    if position < HEADER_SIZE:
        return FrameChecksumMismatch, "header"
    if position < HEADER_SIZE + k_bytes:
        return FrameChecksumMismatch, "k"
    return FrameChecksumMismatch, "v"


def _assert_detected(
    frame: bytes, decoder: Decoder, position: int, mask: int, k_bytes: int
) -> None:
    corrupted = bytearray(frame)
    corrupted[position] ^= mask
    error, part = _expected_error(position, k_bytes)
    with pytest.raises(error) as info:
        decoder(bytes(corrupted))
    if part is not None:
        assert isinstance(info.value, FrameChecksumMismatch)
        assert info.value.part == part


def test_every_single_byte_change_of_a_small_frame_is_detected() -> None:
    frame = _full_frame()
    k_bytes = unpack_header(frame).k_bytes
    assert len(frame) == HEADER_SIZE + 2 * 16
    decode_kv(frame)  # the pristine frame decodes
    for position in range(len(frame)):
        for mask in range(1, 256):
            _assert_detected(frame, decode_kv, position, mask, k_bytes)


@pytest.mark.parametrize(
    ("frame", "decoder"),
    [
        (_full_frame(mla=True), decode_kv),
        (_layer_frame(), decode_layer_frame),
        (_layer_frame(mla=True), decode_layer_frame),
        (_layer_frame(), decode_frame),
    ],
    ids=["mla-full", "layer", "mla-layer", "layer-via-decode_frame"],
)
def test_every_byte_position_of_other_frame_kinds(frame: bytes, decoder: Decoder) -> None:
    k_bytes = unpack_header(frame).k_bytes
    decoder(frame)
    for position in range(len(frame)):
        for mask in (0x01, 0x80, 0xFF):
            _assert_detected(frame, decoder, position, mask, k_bytes)


_BIG_FRAME = _full_frame(shape=(3, 17, 2, 8))
_BIG_K_BYTES = unpack_header(_BIG_FRAME).k_bytes


@settings(max_examples=300, deadline=None)
@given(
    position=st.integers(min_value=0, max_value=len(_BIG_FRAME) - 1),
    mask=st.integers(min_value=1, max_value=255),
)
def test_random_byte_corruption_is_detected(position: int, mask: int) -> None:
    _assert_detected(_BIG_FRAME, decode_kv, position, mask, _BIG_K_BYTES)


@settings(max_examples=100, deadline=None)
@given(
    positions=st.lists(
        st.integers(min_value=HEADER_SIZE, max_value=len(_BIG_FRAME) - 1),
        min_size=2,
        max_size=8,
        unique=True,
    ),
    mask=st.integers(min_value=1, max_value=255),
)
def test_multi_byte_payload_corruption_is_detected(positions: list[int], mask: int) -> None:
    corrupted = bytearray(_BIG_FRAME)
    for position in positions:
        corrupted[position] ^= mask
    with pytest.raises(FrameChecksumMismatch):
        decode_kv(bytes(corrupted))


@pytest.mark.parametrize(
    ("frame", "decoder"),
    [(_full_frame(), decode_kv), (_layer_frame(mla=True), decode_layer_frame)],
    ids=["full", "mla-layer"],
)
def test_truncation_at_every_length(frame: bytes, decoder: Decoder) -> None:
    for length in range(len(frame)):
        with pytest.raises(TruncatedFrame):
            decoder(frame[:length])
        with pytest.raises(TruncatedFrame):
            decode_frame(memoryview(frame)[:length])


def test_trailing_bytes_are_a_size_mismatch() -> None:
    with pytest.raises(SizeMismatch, match="more"):
        decode_kv(_full_frame() + b"\x00")


def test_wrong_magic_and_version() -> None:
    frame = bytearray(_full_frame())
    with pytest.raises(BadMagic, match="KVCACHE1"):
        decode_kv(b"KVCACHE2" + bytes(frame[8:]))
    with pytest.raises(BadMagic):
        decode_kv(b"GET / HTTP/1.1\r\n" + bytes(200))
    for version in (0, 2, 0xFFFF):
        with pytest.raises(UnsupportedVersion, match=str(version)):
            unpack_header(forge_header(version=version))


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"layers": 1025, "k_bytes": 1025 * 16, "v_bytes": 1025 * 16}, SizeLimitExceeded, "layers"),
        ({"seq_len": 2**32 - 1}, SizeLimitExceeded, "seq_len"),
        ({"kv_heads": 5000}, SizeLimitExceeded, "kv_heads"),
        ({"head_dim": 9000}, SizeLimitExceeded, "head_dim"),
        ({"k_bytes": 2**64 - 1}, SizeLimitExceeded, "k_bytes"),
        ({"v_bytes": 2**40}, SizeLimitExceeded, "v_bytes"),
        ({"k_bytes": 18}, SizeMismatch, "K size"),
        ({"v_bytes": 14}, SizeMismatch, "V size"),
        ({"flags": 1}, SizeMismatch, "MLA"),  # MLA flag but a V size
        ({"flags": 1, "v_bytes": 0, "v_crc": 9}, HeaderCorrupt, "V CRC"),
        ({"flags": 0x8}, HeaderCorrupt, "flag"),
        ({"dtype": 0}, HeaderCorrupt, "dtype code"),
        ({"dtype": 6}, HeaderCorrupt, "dtype code"),
        ({"seq_len": 0, "k_bytes": 0, "v_bytes": 0}, HeaderCorrupt, "seq_len"),
        ({"layers": 0}, HeaderCorrupt, "layers"),
        ({"reserved0": b"\x00\x01\x00"}, HeaderCorrupt, "reserved"),
        ({"reserved1": b"\xff" * 32}, HeaderCorrupt, "reserved"),
        ({"layer_index": 1}, HeaderCorrupt, "layer index"),
        ({"flags": 2, "layers": 2, "layer_index": 2}, HeaderCorrupt, "layer index"),
    ],
)
def test_forged_header_fields(
    overrides: dict[str, Any], error: type[WireError], match: str
) -> None:
    header = forge_header(**overrides)
    with pytest.raises(error, match=match):
        unpack_header(header)
    with pytest.raises(error):
        expected_payload_bytes(header)
    with pytest.raises(error):
        decode_frame(header + bytes(64))


def test_limits_are_configurable() -> None:
    header = forge_header(seq_len=4096, k_bytes=4096 * 8, v_bytes=4096 * 8)
    assert expected_payload_bytes(header) == 2 * 4096 * 8
    with pytest.raises(SizeLimitExceeded, match="seq_len"):
        expected_payload_bytes(header, WireLimits(max_seq_len=4095))
    with pytest.raises(SizeLimitExceeded, match="k_bytes"):
        expected_payload_bytes(header, WireLimits(max_tensor_bytes=4096 * 8 - 1))
    with pytest.raises(WireError, match="positive"):
        WireLimits(max_layers=0)


def test_a_huge_announced_frame_is_refused_without_allocating() -> None:
    # Consistent dims announcing 2 x 1 TiB, accepted by deliberately generous limits: the
    # decoder must report truncation without ever allocating anything of that size.
    seq_len, kv_heads, head_dim, layers = 2**20, 2**8, 2**8, 2**4
    per_tensor = layers * seq_len * kv_heads * head_dim * 2
    header = forge_header(
        seq_len=seq_len,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        k_bytes=per_tensor,
        v_bytes=per_tensor,
    )
    generous = WireLimits(
        max_tensor_bytes=2**41, max_seq_len=2**21, max_kv_heads=2**9, max_head_dim=2**9
    )
    tracemalloc.start()
    try:
        assert expected_payload_bytes(header, generous) == 2 * per_tensor
        with pytest.raises(TruncatedFrame):
            decode_kv(header + bytes(1024), generous)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    with pytest.raises(SizeLimitExceeded):
        decode_kv(header + bytes(1024))  # default limits refuse it outright


def test_every_wire_error_is_a_topkv_error() -> None:
    error_types = [
        obj for obj in vars(wire).values() if inspect.isclass(obj) and issubclass(obj, Exception)
    ]
    assert len(error_types) >= 10
    for error_type in error_types:
        assert issubclass(error_type, WireError)
        assert issubclass(error_type, TopKVError)


_DECODERS: list[Decoder] = [decode_kv, decode_layer_frame, decode_frame, unpack_header]


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=400), which=st.integers(min_value=0, max_value=3))
def test_random_bytes_only_raise_wire_errors(data: bytes, which: int) -> None:
    with contextlib.suppress(WireError):
        _DECODERS[which](data)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    body=st.binary(min_size=108, max_size=108),
    flags=st.integers(min_value=0, max_value=3),
    payload=st.binary(max_size=300),
    which=st.integers(min_value=0, max_value=2),
)
def test_random_headers_with_valid_magic_version_and_crc(
    body: bytes, flags: int, payload: bytes, which: int
) -> None:
    """Reach the validation behind the CRC: random fields, correctly checksummed."""
    prefix = MAGIC + WIRE_VERSION.to_bytes(2, "little") + flags.to_bytes(2, "little") + body
    header = prefix + crc64(prefix).to_bytes(8, "little")
    assert len(header) == HEADER_SIZE
    with contextlib.suppress(WireError):
        _DECODERS[which](header + payload)


_u32 = st.one_of(
    st.integers(min_value=0, max_value=8), st.integers(min_value=0, max_value=2**32 - 1)
)


@settings(max_examples=400, deadline=None)
@given(
    flags=st.integers(min_value=0, max_value=7),
    dtype=st.integers(min_value=0, max_value=6),
    seq_len=_u32,
    layers=_u32,
    layer_index=_u32,
    kv_heads=_u32,
    head_dim=_u32,
    consistent_sizes=st.booleans(),
    k_bytes=st.integers(min_value=0, max_value=2**64 - 1),
    v_bytes=st.integers(min_value=0, max_value=2**64 - 1),
    payload=st.binary(max_size=600),
    which=st.integers(min_value=0, max_value=3),
)
def test_forged_fields_only_raise_wire_errors(
    flags: int,
    dtype: int,
    seq_len: int,
    layers: int,
    layer_index: int,
    kv_heads: int,
    head_dim: int,
    consistent_sizes: bool,
    k_bytes: int,
    v_bytes: int,
    payload: bytes,
    which: int,
) -> None:
    """Structured fuzz: plausible field values (often self-consistent) with a valid CRC."""
    if consistent_sizes and 1 <= dtype <= 5:
        per_layer = seq_len * kv_heads * head_dim * DType(dtype).itemsize
        k_bytes = per_layer if flags & 2 else per_layer * layers
        v_bytes = 0 if flags & 1 else k_bytes
    header = forge_header(
        flags=flags,
        dtype=dtype,
        seq_len=seq_len,
        layers=layers,
        layer_index=layer_index,
        kv_heads=kv_heads,
        head_dim=head_dim,
        k_bytes=min(k_bytes, 2**64 - 1),
        v_bytes=min(v_bytes, 2**64 - 1),
    )
    with contextlib.suppress(WireError):
        _DECODERS[which](header + payload)
