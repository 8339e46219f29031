"""Two-process peer for the transports: a sink or a sender in its own process.

``python -m topkv.harness.peers sink TRANSPORT SECRET_HEX ...`` prints ``ADDRESS <address>``,
``LAYER <rid> <layer>`` per verified layer, then one JSON line per received request;
``python -m topkv.harness.peers send TRANSPORT ADDRESS SECRET_HEX SEED LAYOUT_JSON ...``
sends seeded random KV and prints one JSON line per transfer. :func:`spawn_sink` and
:func:`spawn_sender` start them (inside a :class:`~topkv.harness.netns.PrivateNetns` or not)
and :class:`PeerProcess` reads their lines; :func:`expected_digest` is what a bit-exact copy
of a sender's data must hash to. The arena transports' tests and ``topkv bench transfer
--transport nixl|mooncake|cuda`` drive them.
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Any

from topkv.harness.netns import PrivateNetns
from topkv.transport import framing
from topkv.transport.arena.factory import make_sink, make_source
from topkv.transport.base import LayerTensors, TransferDescriptor
from topkv.transport.errors import PeerDied, TransferTimeout, TransportError

MODULE = "topkv.harness.peers"


def kv_data(total_bytes: int, seed: int) -> Any:
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, total_bytes, dtype=np.uint8)


def kv_digest(layers: Sequence[LayerTensors]) -> str:
    """SHA-256 of every tensor's bytes in layer order (what a bit-exact copy must match)."""
    import hashlib

    digest = hashlib.sha256()
    for tensors in layers:
        for tensor in tensors:
            if hasattr(tensor, "cpu"):  # a torch tensor (the cuda transport's device views)
                digest.update(tensor.cpu().numpy())
            else:
                digest.update(tensor)
    return digest.hexdigest()


def expected_digest(total_bytes: int, seed: int) -> str:
    """The digest :func:`peer_send` data of ``seed`` must arrive with."""
    import hashlib

    return hashlib.sha256(kv_data(total_bytes, seed).tobytes()).hexdigest()


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def peer_sink(
    transport: str,
    secret: bytes,
    options: dict[str, Any],
    first: int,
    count: int,
    digest_all: bool = True,
) -> None:
    """Print ``ADDRESS <sink address>``, ``LAYER <rid> <layer>`` per verified layer, then
    one JSON line per received request ``first..`` (with the SHA-256 of its bytes; only for
    the last one when ``digest_all`` is false, which keeps benchmarks' timings clean)."""

    def announce(descriptor: TransferDescriptor, layer: int, tensors: LayerTensors) -> None:
        print(f"LAYER {descriptor.request_id} {layer}", flush=True)

    sink = make_sink(transport, secret, on_layer=announce, **options)
    print(f"ADDRESS {sink.address}", flush=True)  # their libraries may log to stdout too
    try:
        for rid in range(first, first + count):
            try:
                kv = sink.receive(rid).result(120)
            except TransportError as exc:
                _emit({"rid": rid, "ok": False, "error": type(exc).__name__, "message": str(exc)})
                continue
            last = rid == first + count - 1
            digest = kv_digest(kv.layers) if digest_all or last else None
            _emit({"rid": rid, "ok": True, "sha256": digest})
            kv.release()
        import sys

        sys.stdin.readline()  # hold the sink until the driver says so (or closes stdin)
    finally:
        sink.close()


def peer_send(
    transport: str,
    address: str,
    secret: bytes,
    seed: int,
    layout_fields: dict[str, Any],
    mode: str,
    repeat: int,
    options: dict[str, Any],
    from_device: int | None = None,
) -> None:
    """Send ``repeat`` transfers (request ids ``seed..``) and print one JSON line each.

    ``mode``: ``ok``; ``corrupt`` (last layer changed after its CRC was taken);
    ``hang-after-2`` (print SENT2 after two layers, then sleep: the driver kills us);
    ``wait-before-2`` (print WAITING after the first transfer; go on at a line on stdin).
    """
    import sys

    from topkv.transport.base import KVLayout

    layout = KVLayout(**layout_fields)
    data = kv_data(layout.total_bytes, seed)
    view: Any = data.data
    if from_device is not None:  # the cuda transport: send from GPU memory
        import torch

        data = torch.from_numpy(data).to(f"cuda:{from_device}")
        view = data
    size, per = layout.tensor_bytes, layout.tensors_per_layer
    source = make_source(transport, secret, **options)
    try:
        for rid in range(seed, seed + repeat):
            if mode == "wait-before-2" and rid == seed + 1:
                print("WAITING", flush=True)
                sys.stdin.readline()
            try:
                out = source.open(TransferDescriptor(rid, "test-model", layout), address)
                for layer in range(layout.num_layers):
                    tensors = [
                        view[(layer * per + t) * size : (layer * per + t + 1) * size]
                        for t in range(per)
                    ]
                    crcs = None
                    if mode == "corrupt" and layer == layout.num_layers - 1:
                        host = [t.cpu().numpy() if hasattr(t, "cpu") else t for t in tensors]
                        crcs = [framing.crc64(t) for t in host]
                        data[layer * layout.layer_bytes + 5] ^= 0xFF  # changed after the CRC
                    out.send_layer(layer, tensors, crcs)
                    if mode == "hang-after-2" and layer == 1:
                        print("SENT2", flush=True)
                        time.sleep(3600)
                result = out.finish().result(120)
                _emit({"rid": rid, "ok": True, "seconds": result.seconds, "gbps": result.gbps})
            except TransportError as exc:
                _emit({"rid": rid, "ok": False, "error": type(exc).__name__, "message": str(exc)})
    finally:
        source.close()


def _peer_main(argv: Sequence[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    sub = parser.add_subparsers(dest="role", required=True)
    sink = sub.add_parser("sink")
    sink.add_argument("transport")
    sink.add_argument("secret_hex")
    sink.add_argument("--first", type=int, default=1)
    sink.add_argument("--count", type=int, default=1)
    sink.add_argument("--options", default="{}")
    sink.add_argument("--digest-last-only", action="store_true")
    send = sub.add_parser("send")
    send.add_argument("transport")
    send.add_argument("address")
    send.add_argument("secret_hex")
    send.add_argument("seed", type=int)
    send.add_argument("layout_json")
    send.add_argument(
        "--mode", default="ok", choices=["ok", "corrupt", "hang-after-2", "wait-before-2"]
    )
    send.add_argument("--repeat", type=int, default=1)
    send.add_argument("--options", default="{}")
    send.add_argument("--from-device", type=int, default=None)
    args = parser.parse_args(argv)
    options = json.loads(args.options)
    if args.role == "sink":
        peer_sink(
            args.transport,
            bytes.fromhex(args.secret_hex),
            options,
            args.first,
            args.count,
            not args.digest_last_only,
        )
    else:
        peer_send(
            args.transport,
            args.address,
            bytes.fromhex(args.secret_hex),
            args.seed,
            json.loads(args.layout_json),
            args.mode,
            args.repeat,
            options,
            args.from_device,
        )


class PeerProcess:
    """A :func:`peer_sink` / :func:`peer_send` child process, read line by line."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def line(self, prefix: str, timeout: float) -> str:
        """The next stdout line starting with ``prefix`` (libraries may log other lines)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self._lines.get(timeout=max(left, 0.001))
            except queue.Empty:
                raise TransferTimeout(f"peer printed no {prefix!r} line in {timeout} s") from None
            if line is None:
                raise PeerDied(f"peer exited ({self.proc.wait()}) before printing {prefix!r}")
            if line.startswith(prefix):
                return line

    def record(self, timeout: float) -> dict[str, Any]:
        """The next JSON record the peer printed."""
        parsed: dict[str, Any] = json.loads(self.line("{", timeout))
        return parsed

    def tell(self, text: str = "go") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def spawn_sink(
    netns: PrivateNetns | None,
    transport: str,
    secret: bytes,
    *,
    first: int = 1,
    count: int = 1,
    options: dict[str, Any] | None = None,
    python: str | None = None,
    digest_all: bool = True,
) -> tuple[PeerProcess, str]:
    """Start a sink peer (inside ``netns`` unless None); returns it and its address."""
    import sys

    argv = [python or sys.executable, "-m", MODULE, "sink", transport]
    argv += [secret.hex(), "--first", str(first), "--count", str(count)]
    argv += ["--options", json.dumps(options or {})]
    if not digest_all:
        argv.append("--digest-last-only")
    peer = PeerProcess(netns.command(argv) if netns is not None else argv)
    try:
        address = peer.line("ADDRESS ", 60).split(" ", 1)[1]
    except TransportError:
        peer.stop()
        raise
    return peer, address


def spawn_sender(
    netns: PrivateNetns | None,
    transport: str,
    address: str,
    secret: bytes,
    seed: int,
    layout: Any,
    *,
    mode: str = "ok",
    repeat: int = 1,
    options: dict[str, Any] | None = None,
    python: str | None = None,
    from_device: int | None = None,
) -> PeerProcess:
    """Start a sender peer (inside ``netns`` unless None; ``layout`` is a KVLayout)."""
    import dataclasses
    import sys

    argv = [python or sys.executable, "-m", MODULE, "send", transport]
    argv += [address, secret.hex(), str(seed), json.dumps(dataclasses.asdict(layout))]
    argv += ["--mode", mode, "--repeat", str(repeat), "--options", json.dumps(options or {})]
    if from_device is not None:
        argv += ["--from-device", str(from_device)]
    return PeerProcess(netns.command(argv) if netns is not None else argv)


if __name__ == "__main__":
    import sys

    _peer_main(sys.argv[1:])
