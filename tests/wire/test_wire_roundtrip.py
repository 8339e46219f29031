"""Encode/decode round trips, zero-copy behaviour, header codec and encoder validation."""

from __future__ import annotations

import socket

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wire_helpers import random_tensor

from topkv.wire import (
    HEADER_SIZE,
    BufferLayoutError,
    DType,
    FrameChecksumMismatch,
    HeaderCorrupt,
    KVHeader,
    LayerFrameHeader,
    SizeLimitExceeded,
    SizeMismatch,
    UnknownDType,
    WireLimits,
    checksum_tensors,
    crc64,
    decode_frame,
    decode_kv,
    decode_layer_frame,
    decode_payload,
    encode_kv,
    encode_layer_frame,
    expected_payload_bytes,
    model_id_for,
    request_key,
    unpack_header,
    verify_payload,
)

dtypes = st.sampled_from(list(DType))
small = st.integers(min_value=1, max_value=6)


@settings(max_examples=60, deadline=None)
@given(
    dtype=dtypes,
    layers=small,
    seq_len=st.integers(min_value=1, max_value=40),
    kv_heads=small,
    head_dim=st.integers(min_value=1, max_value=20),
    mla=st.booleans(),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_full_frame_round_trip(
    dtype: DType, layers: int, seq_len: int, kv_heads: int, head_dim: int, mla: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    shape = (layers, seq_len, kv_heads, head_dim)
    k = random_tensor(rng, shape, dtype)
    v = None if mla else random_tensor(rng, shape, dtype)
    frame = encode_kv(
        k,
        v,
        request_id=f"req-{seed}",
        model_id=seed % 1000,
        dtype=dtype,
        seq_len=seq_len,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
    )
    wire = frame.to_bytes()
    assert len(wire) == frame.nbytes == HEADER_SIZE + k.nbytes * (1 if mla else 2)
    decoded = decode_kv(wire)
    assert decoded.header == frame.header
    assert decoded.header.request_key == request_key(f"req-{seed}")
    assert decoded.header.mla is mla
    np.testing.assert_array_equal(decoded.k_array(), k)
    assert decoded.k_array().shape == shape
    assert decoded.k_array().dtype == dtype.numpy_storage
    if v is None:
        assert decoded.v is None and decoded.v_array() is None
    else:
        np.testing.assert_array_equal(decoded.v_array(), v)


@settings(max_examples=40, deadline=None)
@given(
    dtype=dtypes,
    layers=small,
    seq_len=st.integers(min_value=1, max_value=30),
    kv_heads=small,
    head_dim=st.integers(min_value=1, max_value=16),
    mla=st.booleans(),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_layer_frames_rebuild_the_cache(
    dtype: DType, layers: int, seq_len: int, kv_heads: int, head_dim: int, mla: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    shape = (layers, seq_len, kv_heads, head_dim)
    k = random_tensor(rng, shape, dtype)
    v = random_tensor(rng, shape, dtype)
    rebuilt_k = np.zeros_like(k)
    rebuilt_v = np.zeros_like(v)
    for layer in range(layers):
        frame = encode_layer_frame(
            k[layer],
            None if mla else v[layer],
            request_id="stream",
            model_id=9,
            dtype=dtype,
            seq_len=seq_len,
            layers=layers,
            layer_index=layer,
            kv_heads=kv_heads,
            head_dim=head_dim,
        )
        decoded = decode_layer_frame(frame.to_bytes())
        assert decoded.header.layer_index == layer and decoded.header.layers == layers
        rebuilt_k[decoded.header.layer_index] = decoded.k_array()
        v_layer = decoded.v_array()
        if not mla:
            assert v_layer is not None
            rebuilt_v[decoded.header.layer_index] = v_layer
    np.testing.assert_array_equal(rebuilt_k, k)
    if not mla:
        np.testing.assert_array_equal(rebuilt_v, v)


def _small_frame(mla: bool = False) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    shape = (2, 3, 2, 4)
    return random_tensor(rng, shape, DType.FP16), random_tensor(rng, shape, DType.FP16)


def _encode_small(k: np.ndarray, v: np.ndarray | None) -> bytes:
    return encode_kv(
        k, v, request_id="r", model_id=1, dtype="fp16", seq_len=3, layers=2, kv_heads=2, head_dim=4
    ).to_bytes()


def test_encode_does_not_copy_tensors() -> None:
    k, v = _small_frame()
    frame = encode_kv(
        k, v, request_id="r", model_id=1, dtype="fp16", seq_len=3, layers=2, kv_heads=2, head_dim=4
    )
    header_buf, k_buf, v_buf = frame.buffers
    assert header_buf.nbytes == HEADER_SIZE
    assert np.shares_memory(np.frombuffer(k_buf, np.uint8), k)
    assert np.shares_memory(np.frombuffer(v_buf, np.uint8), v)


def test_decode_returns_views_into_the_received_buffer() -> None:
    k, v = _small_frame()
    received = bytearray(_encode_small(k, v))
    decoded = decode_frame(received)
    backing = np.frombuffer(received, np.uint8)
    assert np.shares_memory(decoded.k_array(), backing)
    v_arr = decoded.v_array()
    assert v_arr is not None and np.shares_memory(v_arr, backing)


def test_frame_survives_a_real_socket_with_scatter_gather_send() -> None:
    k, v = _small_frame()
    frame = encode_kv(
        k, v, request_id="r", model_id=1, dtype="fp16", seq_len=3, layers=2, kv_heads=2, head_dim=4
    )
    left, right = socket.socketpair()
    with left, right:
        left.sendmsg(frame.buffers)
        header = unpack_header(right.recv(HEADER_SIZE, socket.MSG_WAITALL))
        payload = bytearray(expected_payload_bytes(header))
        right.recv_into(payload, len(payload), socket.MSG_WAITALL)
    decoded = decode_payload(header, payload)
    np.testing.assert_array_equal(decoded.k_array(), k)


def test_header_pack_unpack_round_trip() -> None:
    header = LayerFrameHeader(
        request_key=request_key("abc"),
        model_id=model_id_for("llama-3-70b"),
        dtype=DType.BF16,
        seq_len=4096,
        layers=80,
        layer_index=79,
        kv_heads=8,
        head_dim=128,
        k_bytes=4096 * 8 * 128 * 2,
        v_bytes=4096 * 8 * 128 * 2,
        k_crc=0x1234,
        v_crc=2**64 - 1,
    )
    packed = header.pack()
    assert len(packed) == HEADER_SIZE
    assert LayerFrameHeader.unpack(packed) == header
    assert unpack_header(packed) == header
    assert expected_payload_bytes(packed) == 2 * 4096 * 8 * 128 * 2
    with pytest.raises(HeaderCorrupt, match="LayerFrameHeader"):
        KVHeader.unpack(packed)


def test_paper_sized_header_llama_70b_4k() -> None:
    per_tensor = 80 * 4096 * 8 * 128 * 2
    header = KVHeader(
        request_key=request_key("x"),
        model_id=1,
        dtype=DType.FP16,
        seq_len=4096,
        layers=80,
        kv_heads=8,
        head_dim=128,
        k_bytes=per_tensor,
        v_bytes=per_tensor,
        k_crc=0,
        v_crc=0,
    )
    assert header.payload_bytes == 1_342_177_280
    assert expected_payload_bytes(header) == 1_342_177_280
    with pytest.raises(SizeLimitExceeded, match="k_bytes"):
        expected_payload_bytes(header, WireLimits(max_tensor_bytes=per_tensor - 1))


def test_two_step_receive_with_separate_buffers() -> None:
    k, v = _small_frame()
    wire = _encode_small(k, v)
    header = unpack_header(wire[:HEADER_SIZE])
    k_buf = bytearray(header.k_bytes)
    v_buf = bytearray(header.v_bytes)
    k_buf[:] = wire[HEADER_SIZE : HEADER_SIZE + header.k_bytes]
    v_buf[:] = wire[HEADER_SIZE + header.k_bytes :]
    verify_payload(header, k_buf, v_buf)
    v_buf[0] ^= 1
    with pytest.raises(FrameChecksumMismatch) as info:
        verify_payload(header, k_buf, v_buf)
    assert info.value.part == "v"
    with pytest.raises(SizeMismatch):
        verify_payload(header, k_buf, None)
    with pytest.raises(SizeMismatch):
        verify_payload(header, k_buf[:-1], v_buf)


def test_precomputed_checksums_are_used() -> None:
    k, v = _small_frame()
    k_crc, v_crc = checksum_tensors(k, v)
    assert (k_crc, v_crc) == (crc64(k.tobytes()), crc64(v.tobytes()))
    frame = encode_kv(
        k,
        v,
        request_id="r",
        model_id=1,
        dtype="fp16",
        seq_len=3,
        layers=2,
        kv_heads=2,
        head_dim=4,
        k_crc=k_crc,
        v_crc=v_crc ^ 1,  # a wrong precomputed CRC must surface at the receiver
    )
    with pytest.raises(FrameChecksumMismatch) as info:
        decode_kv(frame.to_bytes())
    assert info.value.part == "v"


def test_encoder_rejects_bad_tensors() -> None:
    k, v = _small_frame()
    dims = {"seq_len": 3, "layers": 2, "kv_heads": 2, "head_dim": 4}
    with pytest.raises(BufferLayoutError, match="C-contiguous"):
        encode_kv(np.swapaxes(k, 0, 1), v, request_id="r", model_id=1, dtype="fp16", **dims)
    with pytest.raises(SizeMismatch, match="bytes"):
        encode_kv(k[:1], v, request_id="r", model_id=1, dtype="fp16", **dims)
    with pytest.raises(SizeMismatch, match="element"):
        encode_kv(
            np.ascontiguousarray(k.astype(np.float32)[:, :, :, :2]),
            v,
            request_id="r",
            model_id=1,
            dtype="fp16",
            **dims,
        )
    with pytest.raises(UnknownDType, match="fp9"):
        encode_kv(k, v, request_id="r", model_id=1, dtype="fp9", **dims)
    with pytest.raises(HeaderCorrupt, match="head_dim"):
        encode_kv(k, v, request_id="r", model_id=1, dtype="fp16", **{**dims, "head_dim": 0})
    with pytest.raises(HeaderCorrupt, match="request id"):
        encode_kv(k, v, request_id="", model_id=1, dtype="fp16", **dims)
    with pytest.raises(HeaderCorrupt, match="model_id"):
        encode_kv(k, v, request_id="r", model_id=2**32, dtype="fp16", **dims)
    with pytest.raises(HeaderCorrupt, match="layer index"):
        encode_layer_frame(
            k[0], v[0], request_id="r", model_id=1, dtype="fp16", layer_index=2, **dims
        )


def test_uint8_byte_views_are_accepted_for_any_dtype() -> None:
    k, v = _small_frame()
    frame = encode_kv(
        k.view(np.uint8),
        memoryview(v.tobytes()),
        request_id="r",
        model_id=1,
        dtype=DType.BF16,
        seq_len=3,
        layers=2,
        kv_heads=2,
        head_dim=4,
    )
    decoded = decode_kv(frame.to_bytes())
    assert decoded.k_array().dtype == np.uint16
    assert decoded.k_array().tobytes() == k.tobytes()


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("fp32", DType.FP32),
        ("float16", DType.FP16),
        ("torch.bfloat16", DType.BF16),
        ("fp8", DType.FP8_E4M3),
        ("fp8_e5m2", DType.FP8_E5M2),
    ],
)
def test_dtype_names(name: str, expected: DType) -> None:
    assert DType.from_name(name) is expected
