"""Emulated links pace a real transport by the occupancy of a modelled link."""

from __future__ import annotations

import secrets
import threading
import time

import numpy as np
import pytest

from topkv.transport.base import KVLayout, TransferDescriptor, TransferSink, TransportMode
from topkv.transport.emulated import (
    EmulatedSource,
    LinkModel,
    LinkSlots,
    Slot,
    _EmulatedOutgoing,
    dilation_for,
)
from topkv.transport.errors import FrameRejected, TransferCancelled, TransportError
from topkv.transport.shm import ShmSink, ShmSource
from topkv.transport.tcp import TcpSink, TcpSource

SECRET = b"s"
LAYOUT = KVLayout(8, 256, 4, 128, "fp16")  # 2 MiB


class ManualClock:
    """A clock only the test moves; ``sleep`` returns once the clock reached its target."""

    def __init__(self) -> None:
        self._now = 0.0
        self._cond = threading.Condition()

    def __call__(self) -> float:
        with self._cond:
            return self._now

    def sleep(self, seconds: float) -> None:
        with self._cond:
            target = self._now + seconds
            self._cond.wait_for(lambda: self._now >= target, timeout=30)

    def set(self, now: float) -> None:
        with self._cond:
            self._now = now
            self._cond.notify_all()


def _layers(rid: int) -> tuple[np.ndarray, list[tuple[memoryview, memoryview]]]:
    data = np.random.default_rng(rid).integers(0, 256, LAYOUT.total_bytes, dtype=np.uint8)
    size = LAYOUT.tensor_bytes
    tensors = [data.data[i * size : (i + 1) * size] for i in range(2 * LAYOUT.num_layers)]
    return data, [(tensors[2 * i], tensors[2 * i + 1]) for i in range(LAYOUT.num_layers)]


def _check_received(sink: TransferSink, rid: int, data: np.ndarray) -> None:
    kv = sink.receive(rid).result(30)
    assert b"".join(bytes(t) for layer in kv.layers for t in layer) == data.tobytes()
    kv.release()


def _send(source: EmulatedSource, sink: TcpSink, rid: int) -> tuple[float, float, bool, float]:
    data, layers = _layers(rid)
    future = sink.receive(rid)
    out = source.open(TransferDescriptor(rid, "m", LAYOUT), sink.address)
    for layer, tensors in enumerate(layers):
        out.send_layer(layer, tensors)
    result = out.finish().result(30)
    kv = future.result(10)
    assert b"".join(bytes(t) for layer in kv.layers for t in layer) == data.tobytes()
    kv.release()
    assert result.wall_seconds is not None
    return result.seconds, result.wall_seconds, result.emulated, result.dilation


# -- the booking policy -----------------------------------------------------------------


def test_link_slots_book_back_to_back_and_after_readiness() -> None:
    slots = LinkSlots()
    assert slots.book(10.0, 2.0) == Slot(10.0, 12.0)  # idle link: starts when ready
    assert slots.book(10.5, 2.0) == Slot(12.0, 14.0)  # busy: queues behind the last slot
    assert slots.book(20.0, 2.0) == Slot(20.0, 22.0)  # ready late: the link idled meanwhile
    assert slots.free_at == 22.0
    assert not slots.give_back(14.0, 15.0)  # someone booked after 14: nothing to give back
    assert slots.give_back(22.0, 21.0)
    assert slots.book(0.0, 1.0) == Slot(21.0, 22.0)


# -- pacing with an injected clock ------------------------------------------------------


def test_streamed_layers_get_their_own_slot_after_they_are_ready() -> None:
    clock = ManualClock()
    link = LinkModel(TransportMode.RDMA, bandwidth_gbps=1.0, setup_latency_s=1e-3)
    chunk = 2.0 * link.seconds(LAYOUT.layer_bytes)
    secret = secrets.token_bytes(16)
    inner, sink = ShmSource(secret), ShmSink(secret)
    source = EmulatedSource(inner, link, dilation=2.0, clock=clock, sleep=clock.sleep)
    data, layers = _layers(5)
    try:
        out = source.open(TransferDescriptor(5, "m", LAYOUT), sink.address)
        assert isinstance(out, _EmulatedOutgoing)
        for layer in range(3):  # offered at t=0, all at once: they queue on the link
            out.send_layer(layer, layers[layer])
        # send_layer never waits for the link: the clock has not moved, nothing was handed
        assert out.handed_to_medium == {}
        clock.set(100.0)  # the layers 3.. become ready long after the link went idle
        for layer in range(3, LAYOUT.num_layers):
            out.send_layer(layer, layers[layer])
        future = out.finish()
        clock.set(1000.0)
        result = future.result(30)
        _check_received(sink, 5, data)
    finally:
        inner.close()
        sink.close()
    expected = [Slot(i * chunk, (i + 1) * chunk) for i in range(3)] + [
        Slot(100.0 + i * chunk, 100.0 + (i + 1) * chunk) for i in range(LAYOUT.num_layers - 3)
    ]
    booked = [out.slots[i] for i in range(LAYOUT.num_layers)]
    assert [s.start for s in booked] == pytest.approx([s.start for s in expected])
    assert [s.end for s in booked] == pytest.approx([s.end for s in expected])
    for layer, slot in out.slots.items():
        assert out.handed_to_medium[layer] >= slot.end, f"layer {layer} left the link early"
    assert result.emulated and result.dilation == 2.0
    assert result.medium == "emulated-rdma" and result.mode == TransportMode.RDMA
    assert result.wall_seconds == 1000.0 and result.seconds == pytest.approx(500.0)


def test_transfers_through_one_source_share_its_link() -> None:
    clock = ManualClock()
    link = LinkModel(TransportMode.PCIE, bandwidth_gbps=2.0, setup_latency_s=0.0)
    chunk = link.seconds(LAYOUT.layer_bytes)
    secret = secrets.token_bytes(16)
    inner, sink = ShmSource(secret), ShmSink(secret)
    source = EmulatedSource(inner, link, clock=clock, sleep=clock.sleep)
    try:
        outs = [source.open(TransferDescriptor(rid, "m", LAYOUT), sink.address) for rid in (1, 2)]
        sent = [_layers(1), _layers(2)]
        for layer in range(LAYOUT.num_layers):  # interleaved offers, as two streams would
            for out, (_, layers) in zip(outs, sent, strict=True):
                out.send_layer(layer, layers[layer])
        futures = [out.finish() for out in outs]
        clock.set(1000.0)
        for future in futures:
            assert future.result(30).emulated
        for rid, (data, _) in zip((1, 2), sent, strict=True):
            _check_received(sink, rid, data)
    finally:
        inner.close()
        sink.close()
    every = [s for out in outs for s in out.slots.values()]  # type: ignore[attr-defined]
    ends = [s.end for s in sorted(every, key=lambda s: s.start)]
    assert ends == pytest.approx([(i + 1) * chunk for i in range(2 * LAYOUT.num_layers)])


def test_cancel_fails_at_once_and_gives_the_unused_slots_back() -> None:
    clock = ManualClock()
    link = LinkModel(TransportMode.RDMA, bandwidth_gbps=1.0, setup_latency_s=0.0)
    chunk = link.seconds(LAYOUT.layer_bytes)
    secret = secrets.token_bytes(16)
    inner, sink = TcpSource(secret), TcpSink(secret)
    source = EmulatedSource(inner, link, clock=clock, sleep=clock.sleep)
    try:
        received = sink.receive(9)
        out = source.open(TransferDescriptor(9, "m", LAYOUT), sink.address)
        _, layers = _layers(9)
        for layer, tensors in enumerate(layers):
            out.send_layer(layer, tensors)
        future = out.finish()
        out.cancel()
        with pytest.raises(TransferCancelled):
            future.result(10)
        with pytest.raises(TransferCancelled):
            received.result(30)
        assert out.handed_to_medium == {}  # type: ignore[attr-defined]
        # the link is idle again: the next transfer starts when it is offered
        assert source.slots.free_at == 0.0
        again = source.open(TransferDescriptor(10, "m", LAYOUT), sink.address)
        again.send_layer(0, layers[0])
        assert again.slots[0] == Slot(0.0, chunk)  # type: ignore[attr-defined]
        again.cancel()
    finally:
        clock.set(1e9)
        inner.close()
        sink.close()


# -- pacing in real time ----------------------------------------------------------------


def test_bulk_transfer_is_paced_to_the_model_without_dilation() -> None:
    link = LinkModel(TransportMode.TCP, bandwidth_gbps=0.05, setup_latency_s=0.005)
    model = LAYOUT.num_layers * link.seconds(LAYOUT.layer_bytes)  # ~0.08 s
    sink = TcpSink(SECRET)
    source = EmulatedSource(TcpSource(SECRET), link)
    try:
        seconds, wall, emulated, dilation = _send(source, sink, 1)
    finally:
        source.close()
        sink.close()
    assert emulated and dilation == 1.0
    assert seconds >= model * 0.999  # never faster than the model
    assert seconds == pytest.approx(wall)


def test_dilation_stretches_wall_time_and_is_reported() -> None:
    link = LinkModel(TransportMode.RDMA, bandwidth_gbps=1.0, setup_latency_s=5e-6)
    model = LAYOUT.num_layers * link.seconds(LAYOUT.layer_bytes)  # ~2.1 ms
    sink = TcpSink(SECRET)
    source = EmulatedSource(TcpSource(SECRET), link, dilation=40.0)
    try:
        seconds, wall, emulated, dilation = _send(source, sink, 2)
    finally:
        source.close()
        sink.close()
    assert emulated and dilation == 40.0
    assert wall >= 40.0 * model * 0.999
    assert seconds == pytest.approx(wall / 40.0)
    assert source.name == "emulated-rdma"


def test_a_late_layer_never_crosses_the_link_before_its_own_slot() -> None:
    secret = secrets.token_bytes(16)
    link = LinkModel(TransportMode.RDMA, 25.0, 5e-6)
    layout = KVLayout(num_layers=6, seq_len=256, kv_heads=2, head_dim=64, dtype="fp32")
    inner, sink = ShmSource(secret), ShmSink(secret)
    source = EmulatedSource(inner, link, dilation=100.0)
    slot = 100.0 * link.seconds(layout.layer_bytes)
    try:
        out = source.open(TransferDescriptor(7, "m", layout), sink.address)
        received = sink.receive(7)
        payload = bytes(range(256)) * (layout.tensor_bytes // 256)
        offered: list[float] = []
        for layer in range(layout.num_layers):
            if layer == 3:
                time.sleep(3 * slot)  # a late layer: the link idles, then serves it after
            offered.append(time.perf_counter())
            out.send_layer(layer, (payload, payload))
        result = out.finish().result(30)
        kv = received.result(30)
        assert all(bytes(t) == payload for tensors in kv.layers for t in tensors)
        kv.release()
    finally:
        inner.close()
        sink.close()
    assert isinstance(out, _EmulatedOutgoing)
    due = -float("inf")
    for layer, at in enumerate(offered):
        due = max(at, due) + slot
        assert out.handed_to_medium[layer] >= due - 1e-4, f"layer {layer} left the link early"
    assert result.emulated and result.dilation == 100.0
    assert result.wall_seconds is not None
    assert result.seconds == pytest.approx(result.wall_seconds / 100.0)


def test_a_dead_receiver_fails_the_transfer() -> None:
    secret = secrets.token_bytes(16)
    inner, sink = TcpSource(secret), TcpSink(secret)
    source = EmulatedSource(inner, LinkModel(TransportMode.RDMA, 25.0, 0.0))
    try:
        address = sink.address
        sink.close()
        _, layers = _layers(3)
        with pytest.raises(TransportError):  # at open, or when the pacer hands a layer on
            out = source.open(TransferDescriptor(3, "m", LAYOUT), address)
            for layer, tensors in enumerate(layers):
                out.send_layer(layer, tensors)
            out.finish().result(30)
    finally:
        source.close()


# -- bad input --------------------------------------------------------------------------


def test_bad_layers_are_refused_when_offered() -> None:
    secret = secrets.token_bytes(16)
    inner, sink = ShmSource(secret), ShmSink(secret)
    source = EmulatedSource(inner, LinkModel(TransportMode.NVLINK, 450.0, 1e-6))
    try:
        out = source.open(TransferDescriptor(4, "m", LAYOUT), sink.address)
        _, layers = _layers(4)
        with pytest.raises(FrameRejected, match="out of range"):
            out.send_layer(LAYOUT.num_layers, layers[0])
        with pytest.raises(FrameRejected, match="bytes"):
            out.send_layer(0, (b"x", b"y"))
        out.finish()
        with pytest.raises(TransportError, match="after finish"):
            out.send_layer(0, layers[0])
        out.cancel()
    finally:
        inner.close()
        sink.close()


@pytest.mark.parametrize(
    ("bandwidth", "setup", "match"),
    [(0.0, 0.0, "bandwidth"), (float("nan"), 0.0, "bandwidth"), (1.0, -1.0, "setup")],
)
def test_bad_link_models_are_refused(bandwidth: float, setup: float, match: str) -> None:
    with pytest.raises(TransportError, match=match):
        LinkModel(TransportMode.RDMA, bandwidth, setup)


def test_reference_links_and_dilation_choice() -> None:
    nvlink = LinkModel.default("nvlink")
    assert nvlink.bandwidth_gbps == 450.0
    assert dilation_for(nvlink, real_gbps=9.0) == pytest.approx(100.0)
    assert dilation_for(LinkModel.default("tcp"), real_gbps=100.0) == 1.0
    with pytest.raises(TransportError, match="dilation"):
        EmulatedSource(TcpSource(SECRET), nvlink, dilation=0.5)
