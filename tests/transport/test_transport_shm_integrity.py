"""shm integrity is end to end: a copy that goes wrong inside the sender is caught."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest

from topkv.transport import framing, shm
from topkv.transport.base import KVLayout, TransferDescriptor
from topkv.transport.errors import ChecksumMismatch
from topkv.transport.shm import ShmSink, ShmSource, segments_of

SECRET = b"shm-integrity-secret"
# 2 MiB tensors: several COPY_CHUNK steps per tensor.
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
    calls: list[int] = []
    honest_copy = shm._copy_chunk

    def faulty_copy(dst: np.ndarray, src: np.ndarray) -> None:
        honest_copy(dst, src)
        calls.append(dst.size)
        if len(calls) == 4:  # layer 0, tensor 1, second chunk: not the first of anything
            dst[7] ^= 0x5A

    monkeypatch.setattr(shm, "_copy_chunk", faulty_copy)
    return calls


def test_a_corrupted_copy_is_caught_by_the_receiver(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _flip_one_byte_of_a_late_chunk(monkeypatch)
    data = np.random.default_rng(3).integers(0, 256, LAYOUT.total_bytes, dtype=np.uint8)
    sent, received = _send(data, 41, supply_crcs=False)
    assert len(calls) >= 3, "the fused copy did not go through the chunk copy"
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


def test_copy_with_crc_returns_the_source_crc_even_when_the_copy_is_wrong(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _flip_one_byte_of_a_late_chunk(monkeypatch)
    src = np.random.default_rng(5).integers(0, 256, 5 * shm.COPY_CHUNK + 17, dtype=np.uint8)
    dst = np.zeros_like(src)
    crc = shm.copy_with_crc(memoryview(dst), memoryview(src))
    assert crc == framing.crc64(src)
    assert crc != framing.crc64(dst)
