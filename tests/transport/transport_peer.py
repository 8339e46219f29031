"""A transport peer run as a separate process by the transport tests (not a test module).

python transport_peer.py send TRANSPORT ADDRESS SECRET_HEX SEED LAYOUT_JSON [MODE]
    MODE: ok | corrupt | hang-after-2
python transport_peer.py sink TRANSPORT SECRET_HEX
    prints the sink address, then waits to be killed
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from topkv.transport import framing
from topkv.transport.base import KVLayout, TransferDescriptor
from topkv.transport.errors import TransportError
from topkv.transport.shm import ShmSink, ShmSource
from topkv.transport.tcp import TcpSink, TcpSource


def kv_bytes(layout: KVLayout, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, layout.total_bytes, dtype=np.uint8)


def layer_views(data: np.ndarray, layout: KVLayout, layer: int) -> list[memoryview]:
    size, per = layout.tensor_bytes, layout.tensors_per_layer
    view = data.data
    return [view[(layer * per + t) * size : (layer * per + t + 1) * size] for t in range(per)]


def send(
    transport: str, address: str, secret: bytes, seed: int, layout: KVLayout, mode: str
) -> None:
    if transport == "shm":
        source = ShmSource(secret)
    else:
        source = TcpSource(secret, streams=2 if transport == "tcp2" else 1)
    data = kv_bytes(layout, seed)
    out = source.open(TransferDescriptor(seed, "test-model", layout), address)
    for layer in range(layout.num_layers):
        tensors = layer_views(data, layout, layer)
        crcs = None
        if mode == "corrupt" and layer == layout.num_layers - 1:
            crcs = [framing.crc64(t) for t in tensors]
            data[layer * layout.layer_bytes + 5] ^= 0xFF  # corrupted after checksumming
        out.send_layer(layer, tensors, crcs)
        if mode == "hang-after-2" and layer == 1:
            print("SENT2", flush=True)
            time.sleep(3600)
    try:
        result = out.finish().result(30)
        print(json.dumps({"ok": True, "gbps": result.gbps}), flush=True)
    except TransportError as exc:
        print(json.dumps({"ok": False, "error": type(exc).__name__, "message": str(exc)}))
    source.close()


def sink(transport: str, secret: bytes) -> None:
    receiver = ShmSink(secret) if transport == "shm" else TcpSink(secret)
    print(receiver.address, flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    if sys.argv[1] == "send":
        layout = KVLayout(**json.loads(sys.argv[6]))
        mode = sys.argv[7] if len(sys.argv) > 7 else "ok"
        send(sys.argv[2], sys.argv[3], bytes.fromhex(sys.argv[4]), int(sys.argv[5]), layout, mode)
    else:
        sink(sys.argv[2], bytes.fromhex(sys.argv[3]))
