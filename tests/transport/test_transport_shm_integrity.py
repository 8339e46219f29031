"""shm integrity is end to end: a copy that goes wrong inside the sender is caught."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from topkv.transport import copying, framing
from topkv.transport.base import KVLayout, TransferDescriptor
from topkv.transport.errors import ChecksumMismatch
from topkv.transport.shm import ShmSink, ShmSource, segments_of

SECRET = b"shm-integrity-secret"
# 2 MiB tensors: several fallback COPY_CHUNK steps per tensor.
LAYOUT = KVLayout(2, 2048, 8, 128, "fp8")


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    yield
    assert segments_of(os.getpid()) == []


def _layers(data: np.ndarray) -> list[list[memoryview]]:
    size, per = LAYOUT.tensor_bytes, LAYOUT.tensors_per_layer
    view = memoryview(data)
    return [
        [view[(layer * per + t) * size : (layer * per + t + 1) * size] for t in range(per)]
        for layer in range(LAYOUT.num_layers)
    ]


def _send(data: np.ndarray, rid: int, supply_crcs: bool) -> tuple[object, object]:
    sink = ShmSink(SECRET)
    source = ShmSource(SECRET, io_timeout=10, ack_timeout=10)
    try:
        out = source.open(TransferDescriptor(rid, "m", LAYOUT), sink.address)
        for layer, tensors in enumerate(_layers(data)):
            crcs = [framing.crc64(t) for t in tensors] if supply_crcs else None
            out.send_layer(layer, tensors, crcs)
        sent = out.finish().exception(30)
        received = sink.receive(rid).exception(30)
        return sent, received
    finally:
        source.close()
        sink.close()


def _flip_one_byte_of_a_late_chunk(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Fallback path (awscrt + numpy): the 4th chunk copy writes one wrong byte."""
    calls: list[int] = []
    honest_copy = copying._copy_chunk

    def faulty_copy(dst: np.ndarray, src: np.ndarray) -> None:
        honest_copy(dst, src)
        calls.append(dst.size)
        if len(calls) == 4:  # layer 0, tensor 1, second chunk: not the first of anything
            dst[7] ^= 0x5A

    monkeypatch.setattr(copying, "_native_copy_crc", None)
    monkeypatch.setattr(copying, "_copy_chunk", faulty_copy)
    return calls


def _flip_one_byte_after_the_native_copy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Native path: the 2nd fused copy (layer 0, tensor 1) leaves one wrong byte."""
    calls: list[int] = []
    honest = copying._native_copy_crc
    assert honest is not None

    def faulty(dst: memoryview, src: memoryview, prev: int) -> int:
        crc = honest(dst, src, prev)
        calls.append(len(dst))
        if len(calls) == 2:
            dst[COPY_FAULT_OFFSET] ^= 0x5A
        return crc

    monkeypatch.setattr(copying, "_native_copy_crc", faulty)
    return calls


COPY_FAULT_OFFSET = (1 << 20) + 7  # inside the tensor, away from its first bytes
FAULTS = [pytest.param(_flip_one_byte_of_a_late_chunk, id="fallback")]
if copying.NATIVE:
    FAULTS.append(pytest.param(_flip_one_byte_after_the_native_copy, id="native"))


@pytest.mark.parametrize("inject", FAULTS)
def test_a_corrupted_copy_is_caught_by_the_receiver(
    monkeypatch: pytest.MonkeyPatch, inject: Callable[[pytest.MonkeyPatch], list[int]]
) -> None:
    calls = inject(monkeypatch)
    data = np.random.default_rng(3).integers(0, 256, LAYOUT.total_bytes, dtype=np.uint8)
    sent, received = _send(data, 41, supply_crcs=False)
    assert len(calls) >= 2, "the fused copy did not go through the faulty seam"
    assert isinstance(received, ChecksumMismatch)
    assert "layer 0 tensor 1" in str(received)
    assert isinstance(sent, ChecksumMismatch)


def test_the_same_transfer_without_the_fault_is_bit_exact() -> None:
    data = np.random.default_rng(3).integers(0, 256, LAYOUT.total_bytes, dtype=np.uint8)
    sink = ShmSink(SECRET)
    source = ShmSource(SECRET, io_timeout=10, ack_timeout=10)
    try:
        out = source.open(TransferDescriptor(42, "m", LAYOUT), sink.address)
        for layer, tensors in enumerate(_layers(data)):
            out.send_layer(layer, tensors)
        assert out.finish().result(30).checksum_verified
        kv = sink.receive(42).result(30)
        got = b"".join(bytes(t) for layer in kv.layers for t in layer)
        assert got == data.tobytes()
        kv.release()
    finally:
        source.close()
        sink.close()


@pytest.mark.parametrize("inject", FAULTS)
def test_copy_with_crc_returns_the_source_crc_even_when_the_copy_is_wrong(
    monkeypatch: pytest.MonkeyPatch, inject: Callable[[pytest.MonkeyPatch], list[int]]
) -> None:
    inject(monkeypatch)
    src = np.random.default_rng(5).integers(0, 256, 5 * copying.COPY_CHUNK + 17, dtype=np.uint8)
    dst = np.zeros_like(src)
    crc = 0
    for piece in range(2):  # the native fault hits the second call
        half = src.size // 2 if piece == 0 else src.size
        start = 0 if piece == 0 else src.size // 2
        crc = copying.copy_with_crc(memoryview(dst)[start:half], memoryview(src)[start:half])
        assert crc == framing.crc64(src[start:half])
    assert not np.array_equal(dst, src)
