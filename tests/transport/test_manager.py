"""TransferManager over real shm and tcp sinks in another process: failover, cancel, timeout.

The receiver is this file run as a script (``python test_manager.py sink SECRET_HEX``): it
listens with a real ShmSink and TcpSink and answers ``recv RID TIMEOUT SINKS`` lines with the
SHA-256 of the verified bytes (or the error) it got.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from topkv.transport import framing
from topkv.transport.base import (
    Buffer,
    KVLayout,
    OutgoingTransfer,
    TransferDescriptor,
    TransferResult,
    TransferSink,
    TransferSource,
)
from topkv.transport.errors import (
    ChecksumMismatch,
    PeerDied,
    TransferCancelled,
    TransferTimeout,
    TransportError,
)
from topkv.transport.manager import (
    TransferFailed,
    TransferManager,
    TransferOutcome,
    TransferPlan,
    receive_first,
)
from topkv.transport.shm import ShmSink, ShmSource, segments_of
from topkv.transport.tcp import TcpSink

SECRET = b"manager-test-secret"
LAYOUT = KVLayout(6, 96, 4, 64, "fp16")


def kv_data(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, LAYOUT.total_bytes, dtype=np.uint8)


def layer_tensors(data: np.ndarray) -> list[list[memoryview]]:
    size = LAYOUT.tensor_bytes
    view = data.data
    return [
        [view[(2 * layer + t) * size : (2 * layer + t + 1) * size] for t in range(2)]
        for layer in range(LAYOUT.num_layers)
    ]


class Receiver:
    """The receiving process."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "sink", SECRET.hex()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.addresses: dict[str, str] = json.loads(self.proc.stdout.readline())
        self._pending: list[Future[dict[str, Any]]] = []

    def expect(self, request_id: int, timeout: float = 20, sinks: str = "shm,tcp") -> Any:
        """Ask the receiver for ``request_id``; returns a future of its JSON answer."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"recv {request_id} {timeout} {sinks}\n")
        self.proc.stdin.flush()
        future: Future[dict[str, Any]] = Future()
        stdout = self.proc.stdout
        threading.Thread(
            target=lambda: future.set_result(json.loads(stdout.readline())), daemon=True
        ).start()
        return future

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    peer = Receiver()
    try:
        yield peer
    finally:
        peer.close()
    assert segments_of(os.getpid()) == []
    assert segments_of(peer.proc.pid) == []


@pytest.fixture
def manager() -> Iterator[TransferManager]:
    mgr = TransferManager(SECRET)
    try:
        yield mgr
    finally:
        mgr.close()


def digest(data: np.ndarray) -> str:
    return hashlib.sha256(data.tobytes()).hexdigest()


class _CorruptingOutgoing(OutgoingTransfer):
    """Sends a copy of one layer with a flipped byte under the original's CRCs."""

    def __init__(self, inner: OutgoingTransfer, corrupt_layer: int) -> None:
        self.descriptor = inner.descriptor
        self._inner = inner
        self._corrupt_layer = corrupt_layer
        self._scratch: list[bytearray] = []

    def send_layer(
        self, layer: int, tensors: Sequence[Buffer], crcs: Sequence[int] | None = None
    ) -> None:
        if layer == self._corrupt_layer:
            crcs = [framing.crc64(t) for t in tensors]
            copies = [bytearray(memoryview(t).cast("B")) for t in tensors]
            copies[0][3] ^= 0x40  # the bytes change after checksumming: in-flight corruption
            self._scratch.extend(copies)
            tensors = copies
        self._inner.send_layer(layer, tensors, crcs)

    def finish(self) -> Future[TransferResult]:
        return self._inner.finish()

    def cancel(self) -> None:
        self._inner.cancel()


class CorruptingSource(TransferSource):
    """Fault injection: a real source whose transfers arrive corrupted."""

    def __init__(self, inner: TransferSource, corrupt_layer: int = 2) -> None:
        self.inner = inner
        self.name, self.mode = inner.name, inner.mode
        self.corrupt_layer = corrupt_layer

    def open(self, descriptor: TransferDescriptor, destination: str) -> OutgoingTransfer:
        return _CorruptingOutgoing(self.inner.open(descriptor, destination), self.corrupt_layer)

    def close(self) -> None:
        self.inner.close()


def test_delivers_over_first_transport(receiver: Receiver, manager: TransferManager) -> None:
    data = kv_data(1)
    plan = TransferPlan(
        TransferDescriptor(1, "m", LAYOUT), layer_tensors(data), receiver.addresses, ("shm", "tcp")
    )
    answer = receiver.expect(1)
    outcome = manager.run(plan)
    assert outcome.transport == "shm" and outcome.failovers == 0
    assert outcome.result.checksum_verified
    assert answer.result(20) == {"ok": True, "sha": digest(data), "sink": "shm"}


def test_corruption_on_shm_fails_over_to_tcp(receiver: Receiver) -> None:
    manager = TransferManager(SECRET, sources={"shm": CorruptingSource(ShmSource(SECRET))})
    data = kv_data(2)
    called: list[Future[TransferOutcome]] = []
    done = threading.Event()

    def callback(future: Future[TransferOutcome]) -> None:
        called.append(future)
        done.set()

    try:
        answer = receiver.expect(2)
        plan = TransferPlan(
            TransferDescriptor(2, "m", LAYOUT),
            layer_tensors(data),
            receiver.addresses,
            ("shm", "tcp"),
        )
        handle = manager.submit(plan, callback=callback)
        outcome = handle.result(30)
    finally:
        manager.close()
    assert [a.transport for a in outcome.attempts] == ["shm", "tcp"]
    assert outcome.attempts[0].error_type == ChecksumMismatch.__name__
    assert outcome.attempts[1].ok and outcome.transport == "tcp"
    assert answer.result(20) == {"ok": True, "sha": digest(data), "sink": "tcp"}
    assert done.wait(5) and called[0].result() is outcome
    assert data.tobytes() == kv_data(2).tobytes()  # the source buffers were never touched


def test_unreachable_sink_fails_over(
    receiver: Receiver, manager: TransferManager, tmp_path: Path
) -> None:
    data = kv_data(3)
    destination = dict(receiver.addresses, shm=f"shm://{tmp_path / 'nobody.sock'}")
    answer = receiver.expect(3, sinks="tcp")
    outcome = manager.run(
        TransferPlan(
            TransferDescriptor(3, "m", LAYOUT), layer_tensors(data), destination, ("shm", "tcp")
        )
    )
    assert outcome.attempts[0].error_type == "PeerDied"
    assert outcome.transport == "tcp"
    assert answer.result(20)["sha"] == digest(data)


def test_every_transport_failing_reports_each(manager: TransferManager, tmp_path: Path) -> None:
    closed = TcpSink(SECRET)
    address = closed.address
    closed.close()
    destination = {"shm": f"shm://{tmp_path / 'x.sock'}", "tcp": address}
    plan = TransferPlan(
        TransferDescriptor(4, "m", LAYOUT), layer_tensors(kv_data(4)), destination, ("shm", "tcp")
    )
    with pytest.raises(TransferFailed, match="every transport failed") as info:
        manager.run(plan)
    assert [a.transport for a in info.value.attempts] == ["shm", "tcp"]
    assert all(a.error_type == PeerDied.__name__ for a in info.value.attempts)


@pytest.mark.parametrize("medium", ["shm", "tcp"])
def test_streaming_layers_and_cancel_without_failover(
    receiver: Receiver, manager: TransferManager, medium: str
) -> None:
    other = "tcp" if medium == "shm" else "shm"
    answer = receiver.expect(5, sinks=medium)
    plan = TransferPlan(
        TransferDescriptor(5, "m", LAYOUT),
        layer_tensors(kv_data(5)),
        receiver.addresses,
        (medium, other),
        streaming=True,
    )
    handle = manager.submit(plan)
    handle.layer_ready(0)
    handle.layer_ready(1)
    assert not handle.done()  # waits for layer 2, which the producer has not finished
    handle.cancel()
    with pytest.raises(TransferCancelled):
        handle.result(20)
    assert answer.result(20)["error"] == "TransferCancelled"


def test_streaming_plan_delivers_as_layers_become_ready(
    receiver: Receiver, manager: TransferManager
) -> None:
    data = kv_data(6)
    answer = receiver.expect(6, sinks="tcp")
    plan = TransferPlan(
        TransferDescriptor(6, "m", LAYOUT),
        layer_tensors(data),
        receiver.addresses,
        ("tcp",),
        streaming=True,
    )
    handle = manager.submit(plan)
    for layer in range(LAYOUT.num_layers):
        assert not handle.done()
        handle.layer_ready(layer)
    assert handle.result(20).transport == "tcp"
    assert answer.result(20)["sha"] == digest(data)


def test_layer_never_ready_times_out_without_failover(
    receiver: Receiver, manager: TransferManager
) -> None:
    receiver.expect(7, timeout=10, sinks="shm")
    plan = TransferPlan(
        TransferDescriptor(7, "m", LAYOUT),
        layer_tensors(kv_data(7)),
        receiver.addresses,
        ("shm", "tcp"),
        streaming=True,
        timeout_s=0.5,
    )
    handle = manager.submit(plan)
    handle.layer_ready(0)
    with pytest.raises(TransferTimeout, match=r"not ready within 0\.5 s"):
        handle.result(20)
    assert handle.future.exception() is not None


def test_plan_checks_its_inputs(receiver: Receiver) -> None:
    data = layer_tensors(kv_data(8))
    descriptor = TransferDescriptor(8, "m", LAYOUT)
    with pytest.raises(TransportError, match="layers of buffers"):
        TransferPlan(descriptor, data[:2], receiver.addresses, ("tcp",))
    with pytest.raises(TransportError, match="no transport"):
        TransferPlan(descriptor, data, receiver.addresses, ())
    plan = TransferPlan(descriptor, data, {"tcp": "tcp://127.0.0.1:1"}, ("shm",))
    with pytest.raises(TransportError, match="no sink for 'shm'"):
        plan.address_for("shm")
    emulated = TransferPlan(descriptor, data, receiver.addresses, ("emulated-rdma",))
    assert emulated.address_for("emulated-rdma") == receiver.addresses["tcp"]


def test_plan_from_selection_maps_paths_to_media(receiver: Receiver) -> None:
    from topkv.policy.select import Selection

    selection = Selection("cost", "pcie", (), ("rdma", "tcp"), "test")
    plan = TransferPlan.from_selection(
        TransferDescriptor(9, "m", LAYOUT),
        layer_tensors(kv_data(9)),
        receiver.addresses,
        selection,
    )
    assert plan.transports == ("shm", "emulated-rdma", "tcp")


# -- the receiving process -----------------------------------------------------------------


def _serve(secret: bytes) -> None:
    sinks: dict[str, TransferSink] = {"shm": ShmSink(secret), "tcp": TcpSink(secret)}
    print(json.dumps({k: s.address for k, s in sinks.items()}), flush=True)
    for line in sys.stdin:
        _, rid, timeout, names = line.split()
        chosen = [sinks[n] for n in names.split(",")]
        try:
            kv = receive_first(chosen, int(rid), float(timeout))
        except TransportError as exc:
            answer: dict[str, Any] = {"ok": False, "error": type(exc).__name__, "msg": str(exc)}
        else:
            data = b"".join(bytes(t) for layer in kv.layers for t in layer)
            sink = "shm" if kv.layers[0][0].readonly else "tcp"
            kv.release()
            answer = {"ok": True, "sha": hashlib.sha256(data).hexdigest(), "sink": sink}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "sink":
        _serve(bytes.fromhex(sys.argv[2]))
