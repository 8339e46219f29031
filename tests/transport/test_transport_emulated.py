"""Emulated links pace a real transport to the modelled bandwidth and setup latency."""

from __future__ import annotations

import numpy as np
import pytest

from topkv.transport.base import KVLayout, TransferDescriptor, TransportMode
from topkv.transport.emulated import EmulatedSource, LinkModel, dilation_for
from topkv.transport.errors import TransportError
from topkv.transport.tcp import TcpSink, TcpSource

SECRET = b"s"
LAYOUT = KVLayout(8, 256, 4, 128, "fp16")  # 2 MiB


def _send(source: EmulatedSource, sink: TcpSink, rid: int) -> tuple[float, float, bool, float]:
    data = np.random.default_rng(rid).integers(0, 256, LAYOUT.total_bytes, dtype=np.uint8)
    size = LAYOUT.tensor_bytes
    future = sink.receive(rid)
    out = source.open(TransferDescriptor(rid, "m", LAYOUT), sink.address)
    for layer in range(LAYOUT.num_layers):
        base = 2 * layer * size
        out.send_layer(
            layer, [data.data[base : base + size], data.data[base + size : base + 2 * size]]
        )
    result = out.finish().result(30)
    kv = future.result(10)
    assert b"".join(bytes(t) for layer in kv.layers for t in layer) == data.tobytes()
    kv.release()
    assert result.wall_seconds is not None
    return result.seconds, result.wall_seconds, result.emulated, result.dilation


def test_paced_to_model_without_dilation() -> None:
    link = LinkModel(TransportMode.TCP, bandwidth_gbps=0.05, setup_latency_s=0.05)
    model = link.seconds(LAYOUT.total_bytes)  # ~0.092 s
    sink = TcpSink(SECRET)
    source = EmulatedSource(TcpSource(SECRET), link)
    try:
        seconds, wall, emulated, dilation = _send(source, sink, 1)
    finally:
        source.close()
        sink.close()
    assert emulated and dilation == 1.0
    assert seconds >= model * 0.99  # never faster than the model
    assert seconds < model + 2.0  # generous: a loaded 2-core box may be slow, never fast
    assert seconds == pytest.approx(wall)


def test_dilation_stretches_wall_time_and_is_reported() -> None:
    link = LinkModel(TransportMode.RDMA, bandwidth_gbps=1.0, setup_latency_s=5e-6)
    model = link.seconds(LAYOUT.total_bytes)  # ~2.1 ms
    sink = TcpSink(SECRET)
    source = EmulatedSource(TcpSource(SECRET), link, dilation=40.0)
    try:
        seconds, wall, emulated, dilation = _send(source, sink, 2)
    finally:
        source.close()
        sink.close()
    assert emulated and dilation == 40.0
    assert wall >= 40.0 * model * 0.99
    assert seconds == pytest.approx(wall / 40.0)
    assert source.name == "emulated-rdma"


def test_layers_are_released_on_the_modelled_schedule() -> None:
    now = [0.0]
    sleeps: list[float] = []

    def sleep(dt: float) -> None:
        sleeps.append(dt)
        now[0] += dt

    link = LinkModel(TransportMode.RDMA, bandwidth_gbps=1.0, setup_latency_s=1e-3)
    sink = TcpSink(SECRET)
    source = EmulatedSource(
        TcpSource(SECRET), link, dilation=2.0, clock=lambda: now[0], sleep=sleep
    )
    try:
        _send(source, sink, 3)
    finally:
        source.close()
        sink.close()
    per_layer = LAYOUT.layer_bytes / 1e9
    expected = [2.0 * (1e-3 + per_layer)] + [2.0 * per_layer] * (LAYOUT.num_layers - 1)
    assert sleeps == pytest.approx(expected)


def test_reference_links_and_dilation_choice() -> None:
    nvlink = LinkModel.default("nvlink")
    assert nvlink.bandwidth_gbps == 450.0
    assert dilation_for(nvlink, real_gbps=9.0) == pytest.approx(100.0)
    assert dilation_for(LinkModel.default("tcp"), real_gbps=100.0) == 1.0
    with pytest.raises(TransportError):
        EmulatedSource(TcpSource(SECRET), nvlink, dilation=0.5)
