"""Transfer benchmark between two real processes, against the medium's limit in the same run.

The receiver runs in a spawned child process; the parent sends. For each repeat the parent
times ``open -> send every layer -> verified ack``. The limit is measured in the same run:
one ``memcpy`` into a preallocated buffer for shm (and for emulated modes riding on shm),
a raw blocking ``sendall`` -> ``recv_into`` a preallocated buffer between the same two
processes for tcp.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import statistics
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from topkv.transport import registry
from topkv.transport.base import KVLayout, TransferDescriptor, TransferSink, TransportMode
from topkv.transport.emulated import EmulatedSource, dilation_for
from topkv.transport.errors import TransportError
from topkv.transport.shm import ShmSink
from topkv.transport.tcp import TcpSink

BENCH_LAYERS = 32
_TOKEN_BYTES = 2 * 8 * 128 * 2  # K+V, 8 kv heads, head_dim 128, fp16: bytes per token-layer


def bench_layout(size_bytes: int) -> KVLayout:
    """A Llama-like fp16 layout of 32 layers whose total is ``size_bytes`` rounded down."""
    seq_len = size_bytes // (BENCH_LAYERS * _TOKEN_BYTES)
    if seq_len < 1:
        raise TransportError(
            f"size {size_bytes} is too small; need at least {BENCH_LAYERS * _TOKEN_BYTES} bytes"
        )
    return KVLayout(BENCH_LAYERS, seq_len, 8, 128, "fp16")


@dataclass(frozen=True)
class BenchConfig:
    transport: str
    size_bytes: int
    repeat: int = 5
    verify: bool = True
    streams: int = 1


def _make_sink(name: str, secret: bytes, verify: bool) -> TransferSink:
    inner = _inner_medium(name)
    if inner == "shm":
        return ShmSink(secret, verify=verify)
    return TcpSink(secret, verify=verify)


def _inner_medium(name: str) -> str:
    info = registry.get(name)
    if not info.emulated:
        return info.name
    fast = info.mode in (TransportMode.NVLINK, TransportMode.NVSWITCH, TransportMode.PCIE)
    return "shm" if fast else "tcp"


def _sink_main(conn: Connection, name: str, secret: bytes, verify: bool, size: int) -> None:
    """Child process: raw-socket limit server, then the transport's sink."""
    raw = socket.create_server(("127.0.0.1", 0))
    sink = _make_sink(name, secret, verify)
    conn.send((sink.address, raw.getsockname()[1]))
    buffer = bytearray(size)
    view = memoryview(buffer)
    while True:
        command = conn.recv()
        if command[0] == "raw":
            peer, _ = raw.accept()
            with peer:
                for _ in range(command[1]):
                    got = 0
                    while got < size:
                        n = peer.recv_into(view[got:])
                        if n == 0:
                            raise TransportError("raw sender closed early")
                        got += n
                    peer.sendall(b"k")
        elif command[0] == "receive":
            try:
                kv = sink.receive(command[1]).result(120)
                ok = True
                kv.release()
            except Exception as exc:
                ok = False
                conn.send(("error", repr(exc)))
            if ok:
                conn.send(("ok",))
        else:
            sink.close()
            raw.close()
            conn.send(("bye",))
            return


def _memcpy_gbps(size: int, repeat: int) -> float:
    src = np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8)
    dst = np.ones(size, dtype=np.uint8)  # preallocated and faulted in
    s, d = src.data, dst.data
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        d[:] = s
        times.append(time.perf_counter() - start)
    return size / statistics.median(times) / 1e9


def _raw_tcp_gbps(conn: Connection, port: int, size: int, repeat: int) -> float:
    data = np.random.default_rng(2).integers(0, 255, size, dtype=np.uint8).data
    conn.send(("raw", repeat))
    times = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(repeat):
            start = time.perf_counter()
            sock.sendall(data)
            if sock.recv(1) != b"k":
                raise TransportError("raw receiver failed")
            times.append(time.perf_counter() - start)
    return size / statistics.median(times) / 1e9


def run_transfer_benchmark(config: BenchConfig) -> dict[str, Any]:
    """Run the benchmark; returns the JSON-ready result (see ``topkv bench transfer``)."""
    info = registry.get(config.transport)
    layout = bench_layout(config.size_bytes)
    size = layout.total_bytes
    secret = os.urandom(32)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_sink_main, args=(child, info.name, secret, config.verify, size), daemon=True
    )
    proc.start()
    try:
        address, raw_port = parent.recv()
        medium = _inner_medium(info.name)
        if medium == "shm":
            limit = _memcpy_gbps(size, config.repeat)
        else:
            limit = _raw_tcp_gbps(parent, raw_port, size, config.repeat)
        source = info.make_source(secret)
        if isinstance(source, EmulatedSource):
            source.dilation = dilation_for(source.link, limit)
        if medium == "tcp" and config.streams > 1 and hasattr(source, "streams"):
            source.streams = config.streams
        data = np.random.default_rng(3).integers(0, 255, size, dtype=np.uint8)
        view = data.data
        tensor = layout.tensor_bytes
        tensors = [view[i * tensor : (i + 1) * tensor] for i in range(2 * layout.num_layers)]
        no_crc = None if config.verify else (0, 0)
        results = []
        for rep in range(config.repeat + 1):  # the first run warms connections and segments
            descriptor = TransferDescriptor(rep + 1, "bench", layout)
            parent.send(("receive", rep + 1))
            out = source.open(descriptor, address)
            for layer in range(layout.num_layers):
                out.send_layer(layer, tensors[2 * layer : 2 * layer + 2], no_crc)
            result = out.finish().result(120)
            reply = parent.recv()
            if reply[0] != "ok":
                raise TransportError(f"receiver failed: {reply[1]}")
            if rep:
                results.append(result)
        source.close()
        seconds = statistics.median(r.seconds for r in results)
        gbps = size / seconds / 1e9
        report: dict[str, Any] = {
            "transport": info.name,
            "size_bytes": size,
            "gbps": round(gbps, 3),
            "limit_gbps": round(limit, 3),
            "ratio_to_limit": round(gbps / limit, 3),
            "checksum": "verified" if config.verify else "off",
            "emulated": info.emulated,
        }
        if info.emulated:
            model = source.link if isinstance(source, EmulatedSource) else None
            assert model is not None
            report["limit_gbps"] = model.bandwidth_gbps
            report["ratio_to_limit"] = round(gbps / model.bandwidth_gbps, 3)
            report["dilation"] = round(results[0].dilation, 3)
            report["medium"] = medium
            report["medium_limit_gbps"] = round(limit, 3)
        return report
    finally:
        with contextlib.suppress(Exception):
            parent.send(("stop",))
            parent.recv()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def crc_overhead_report(config: BenchConfig) -> dict[str, Any]:
    """Run with and without CRC-64 verification; overhead = t_verified / t_plain - 1."""
    on = run_transfer_benchmark(config)
    off = run_transfer_benchmark(
        BenchConfig(config.transport, config.size_bytes, config.repeat, False, config.streams)
    )
    return {
        "transport": config.transport,
        "size_bytes": on["size_bytes"],
        "gbps_verified": on["gbps"],
        "gbps_unverified": off["gbps"],
        "crc_overhead": round(off["gbps"] / on["gbps"] - 1, 3),
    }
