"""Real transports between two real processes: bytes, corruption, dead peers, leaks."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from topkv.transport.base import KVLayout, TransferDescriptor, TransferSink
from topkv.transport.errors import ChecksumMismatch, PeerDied
from topkv.transport.shm import ShmSink, ShmSource, segments_of
from topkv.transport.tcp import TcpSink, TcpSource

PEER = Path(__file__).resolve().parent / "transport_peer.py"
SECRET = b"test-shared-secret"
LAYOUTS = [
    KVLayout(4, 64, 4, 64, "fp16"),
    KVLayout(3, 33, 2, 128, "fp32"),
    KVLayout(5, 100, 1, 576, "bf16", latent=True),
    KVLayout(2, 128, 8, 64, "fp8"),
]
TRANSPORTS = ["shm", "tcp", "tcp2"]

sys.path.insert(0, str(PEER.parent))
from transport_peer import kv_bytes  # noqa: E402


def make_sink(transport: str, **kw: object) -> TransferSink:
    return ShmSink(SECRET, **kw) if transport == "shm" else TcpSink(SECRET, **kw)  # type: ignore[arg-type]


def start_sender(
    transport: str, address: str, seed: int, layout: KVLayout, mode: str = "ok"
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            str(PEER),
            "send",
            transport,
            address,
            SECRET.hex(),
            str(seed),
            json.dumps(dataclasses.asdict(layout)),
            mode,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    yield
    assert segments_of(os.getpid()) == []


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"{x.dtype}-{x.tensors_per_layer}t")
def test_moves_random_kv_bit_exactly(transport: str, layout: KVLayout) -> None:
    sink = make_sink(transport)
    layers_seen: list[int] = []
    try:
        seed = 11 + LAYOUTS.index(layout)
        proc = start_sender(transport, sink.address, seed, layout)
        kv = sink.receive(seed).result(30)
        out, _ = proc.communicate(timeout=30)
        assert json.loads(out.splitlines()[-1])["ok"] is True
        expected = kv_bytes(layout, seed)
        got = b"".join(bytes(t) for layer in kv.layers for t in layer)
        assert got == expected.tobytes()
        assert kv.descriptor == TransferDescriptor(seed, "test-model", layout)
        layers_seen.extend(range(len(kv.layers)))
        kv.release()
    finally:
        sink.close()
    assert layers_seen == list(range(layout.num_layers))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_corruption_is_caught_on_both_sides(transport: str) -> None:
    sink = make_sink(transport)
    layout = LAYOUTS[0]
    try:
        proc = start_sender(transport, sink.address, 5, layout, "corrupt")
        with pytest.raises(ChecksumMismatch, match="CRC-64"):
            sink.receive(5).result(30)
        out, _ = proc.communicate(timeout=30)
        report = json.loads(out.splitlines()[-1])
        assert report == {"ok": False, "error": "ChecksumMismatch", "message": report["message"]}
    finally:
        sink.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_sender_killed_mid_transfer_fails_fast(transport: str) -> None:
    arrived = threading.Event()
    sink = make_sink(transport, on_layer=lambda d, layer, t: layer == 1 and arrived.set())
    try:
        proc = start_sender(transport, sink.address, 9, LAYOUTS[0], "hang-after-2")
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "SENT2"
        future = sink.receive(9)
        assert arrived.wait(10)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        start = time.monotonic()
        with pytest.raises(PeerDied, match="layers"):
            future.result(10)
        assert time.monotonic() - start < 5
        if transport == "shm":
            deadline = time.monotonic() + 5
            while segments_of(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert segments_of(proc.pid) == []
    finally:
        sink.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_receiver_killed_mid_transfer_fails_fast(transport: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(PEER), "sink", transport, SECRET.hex()],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    address = proc.stdout.readline().strip()
    source = ShmSource(SECRET) if transport == "shm" else TcpSource(SECRET, io_timeout=5)
    layout = KVLayout(8, 2048, 8, 128, "fp16")  # 64 MiB: larger than socket buffers
    data = np.zeros(layout.total_bytes, dtype=np.uint8)
    size = layout.tensor_bytes
    try:
        out = source.open(TransferDescriptor(3, "m", layout), address)
        out.send_layer(0, [data.data[:size], data.data[size : 2 * size]])
        time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        for layer in range(1, layout.num_layers):
            start = 2 * layer * size
            out.send_layer(
                layer, [data.data[start : start + size], data.data[start + size : start + 2 * size]]
            )
        started = time.monotonic()
        with pytest.raises(PeerDied):
            out.finish().result(15)
        assert time.monotonic() - started < 10
    finally:
        source.close()
        proc.kill()
        proc.wait()
