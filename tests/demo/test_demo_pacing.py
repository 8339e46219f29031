"""The demo's paced link: a layer never lands before its slot on the modelled link ends."""

from __future__ import annotations

import secrets
import time

import pytest

from topkv.demo.errors import DemoError
from topkv.demo.pacing import PacedLink, PacedSource, _PacedOutgoing
from topkv.transport.base import KVLayout, TransferDescriptor
from topkv.transport.shm import ShmSink, ShmSource


def test_layers_leave_no_earlier_than_the_link_schedule() -> None:
    secret = secrets.token_bytes(16)
    link = PacedLink("rdma", 25.0, 5e-6, dilation=100.0)
    layout = KVLayout(num_layers=6, seq_len=256, kv_heads=2, head_dim=64, dtype="fp32")
    slot = link.chunk_wall_s(layout.layer_bytes)
    assert slot == pytest.approx(100 * (5e-6 + layout.layer_bytes / 25e9))
    inner, sink = ShmSource(secret), ShmSink(secret)
    source = PacedSource(inner, link)
    try:
        out = source.open(TransferDescriptor(7, "m", layout), sink.address)
        received = sink.receive(7)
        payload = bytes(range(256)) * (layout.tensor_bytes // 256)
        offered: list[float] = []
        for layer in range(layout.num_layers):
            if layer == 3:
                time.sleep(3 * slot)  # a late layer: the link idles, then serves it at once
            offered.append(time.perf_counter())
            out.send_layer(layer, (payload, payload))
        result = out.finish().result(30)
        kv = received.result(30)
        assert all(bytes(t) == payload for tensors in kv.layers for t in tensors)
        kv.release()
    finally:
        inner.close()
        sink.close()
    assert isinstance(out, _PacedOutgoing)
    handed = out.handed_to_medium
    due = -float("inf")
    for layer, at in enumerate(offered):
        due = max(at, due) + slot
        assert handed[layer] >= due - 1e-4, f"layer {layer} left the link early"
    assert result.emulated and result.dilation == 100.0
    assert result.transport == "emulated-rdma"
    assert result.wall_seconds is not None and result.seconds == pytest.approx(
        result.wall_seconds / 100.0
    )


@pytest.mark.parametrize(
    ("bandwidth", "setup", "dilation", "match"),
    [(0.0, 0.0, 1.0, "bandwidth"), (1.0, -1.0, 1.0, "setup"), (1.0, 0.0, 0.5, "dilation")],
)
def test_bad_link_models_are_refused(
    bandwidth: float, setup: float, dilation: float, match: str
) -> None:
    with pytest.raises(DemoError, match=match):
        PacedLink("rdma", bandwidth, setup, dilation)
