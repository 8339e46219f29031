"""Transfer benchmark between two real processes, against the medium's limit in the same run.

The receiver runs in a spawned child process; the parent sends. The limit is measured in the
same run, **interleaved** with the transfers (limit, transfer, limit, transfer, ...) so that a
machine whose load changes during the run affects both alike: one ``memcpy`` (``np.copyto``)
into a preallocated buffer for shm (and for emulated modes riding on shm); a raw blocking
``sendall`` -> ``recv_into`` a preallocated buffer between the same two processes for tcp.
Each transfer is timed from ``open`` to the receiver's acknowledgement of a verified copy;
medians are reported. With ``crc_overhead_report`` two more variants join the same
interleaving, so the overhead compares like with like: a verified transfer whose CRC-64s the
producer supplied (``send_layer(..., crcs=...)``, computed once before timing, as an engine
computes them when it writes the layer; only the receiver checksums during the transfer) and
an unverified one (no CRC on either side).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from topkv.transport import catalog
from topkv.transport.base import (
    KVLayout,
    TransferDescriptor,
    TransferSink,
    TransferSource,
)
from topkv.transport.copying import copy_path
from topkv.transport.emulated import EmulatedSource, dilation_for
from topkv.transport.errors import TransportError
from topkv.transport.media import real_medium
from topkv.transport.shm import ShmSink
from topkv.transport.tcp import TcpSink, tune_socket
from topkv.wire.checksum import crc64

BENCH_LAYERS = 32
#: Who computes the sender's CRC-64s: the transport during the transfer, the producer
#: beforehand (passed as ``crcs=``), or nobody (receiver does not verify).
CRC_TRANSPORT, CRC_SUPPLIED, CRC_OFF = "transport", "supplied", "off"
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


def _make_sink(medium: str, secret: bytes, verify: bool) -> TransferSink:
    if medium == "shm":
        return ShmSink(secret, verify=verify)
    return TcpSink(secret, verify=verify)


def _inner_medium(name: str) -> str:
    info = catalog.get(name)
    if not info.emulated:
        return info.name
    return real_medium(info.mode.value)


def _sink_main(conn: Connection, medium: str, secret: bytes, size: int) -> None:
    """Child process: raw-socket limit server and two sinks (verifying and not)."""
    raw = socket.create_server(("127.0.0.1", 0))
    sinks = {True: _make_sink(medium, secret, True), False: _make_sink(medium, secret, False)}
    conn.send(({v: s.address for v, s in sinks.items()}, raw.getsockname()[1]))
    buffer = np.ones(size, dtype=np.uint8)  # preallocated and faulted in
    view = buffer.data
    peer: socket.socket | None = None
    while True:
        command = conn.recv()
        if command[0] == "raw":
            if peer is None:
                peer, _ = raw.accept()
                tune_socket(peer)
            got = 0
            while got < size:
                n = peer.recv_into(view[got:])
                if n == 0:
                    raise TransportError("raw sender closed early")
                got += n
            peer.sendall(b"k")
        elif command[0] == "receive":
            try:
                kv = sinks[command[2]].receive(command[1]).result(120)
                kv.release()
            except Exception as exc:
                conn.send(("error", repr(exc)))
            else:
                conn.send(("ok",))
        else:
            for sink in sinks.values():
                sink.close()
            if peer is not None:
                peer.close()
            raw.close()
            conn.send(("bye",))
            return


class _Limit:
    """The medium's limit, one timed run per call."""

    def __init__(self, medium: str, size: int, conn: Connection, raw_port: int) -> None:
        self._medium = medium
        self._size = size
        self._conn = conn
        self._src = np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8)
        self._sock: socket.socket | None = None
        if medium == "shm":
            self._dst = np.ones(size, dtype=np.uint8)  # preallocated and faulted in
        else:
            self._sock = socket.create_connection(("127.0.0.1", raw_port))
            tune_socket(self._sock)

    def once(self) -> float:
        """Seconds for one limit run."""
        start = time.perf_counter()
        if self._sock is None:
            np.copyto(self._dst, self._src)
        else:
            self._conn.send(("raw",))
            self._sock.sendall(self._src.data)
            if self._sock.recv(1) != b"k":
                raise TransportError("raw receiver failed")
        return time.perf_counter() - start

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()


def _transfer_once(
    source: TransferSource,
    conn: Connection,
    address: str,
    layout: KVLayout,
    tensors: list[memoryview],
    request_id: int,
    crcs: list[tuple[int, ...]] | None,
    verify: bool,
) -> float:
    """One transfer; returns the sender's seconds (open -> verified ack).

    ``crcs`` (per layer) are passed to ``send_layer`` as the producer's CRC-64s; None lets
    the transport compute them.
    """
    conn.send(("receive", request_id, verify))
    out = source.open(TransferDescriptor(request_id, "bench", layout), address)
    for layer in range(layout.num_layers):
        layer_crcs = None if crcs is None else crcs[layer]
        out.send_layer(layer, tensors[2 * layer : 2 * layer + 2], layer_crcs)
    result = out.finish().result(120)
    reply = conn.recv()
    if reply[0] != "ok":
        raise TransportError(f"receiver failed: {reply[1]}")
    return result.seconds


def _run(config: BenchConfig, variants: tuple[str, ...]) -> dict[str, Any]:
    """Interleave limit and transfer runs (one per CRC variant); medians and reports."""
    info = catalog.get(config.transport)
    layout = bench_layout(config.size_bytes)
    size = layout.total_bytes
    medium = _inner_medium(info.name)
    secret = os.urandom(32)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_sink_main, args=(child, medium, secret, size), daemon=True)
    proc.start()
    source: TransferSource | None = None
    limit: _Limit | None = None
    try:
        addresses, raw_port = parent.recv()
        limit = _Limit(medium, size, parent, raw_port)
        source = info.make_source(secret)
        if medium == "tcp" and config.streams > 1 and hasattr(source, "streams"):
            source.streams = config.streams
        data = np.random.default_rng(3).integers(0, 255, size, dtype=np.uint8)
        tensor = layout.tensor_bytes
        tensors = [data.data[i * tensor : (i + 1) * tensor] for i in range(2 * layout.num_layers)]
        limit.once()  # warm-up
        if isinstance(source, EmulatedSource):
            source.dilation = dilation_for(source.link, size / limit.once() / 1e9)
        request_ids = iter(range(1, 1 << 30))
        per_tensor = layout.tensors_per_layer
        supplied = [
            tuple(crc64(t) for t in tensors[per_tensor * layer : per_tensor * (layer + 1)])
            for layer in range(layout.num_layers)
        ]
        zeros = [(0,) * per_tensor] * layout.num_layers
        runs: list[Callable[[], float]] = []
        for variant in variants:
            verify = variant != CRC_OFF
            crcs = {CRC_TRANSPORT: None, CRC_SUPPLIED: supplied, CRC_OFF: zeros}[variant]
            runs.append(
                lambda v=verify, c=crcs: _transfer_once(  # type: ignore[misc]
                    source, parent, addresses[v], layout, tensors, next(request_ids), c, v
                )
            )
        for run in runs:
            run()  # warm-up: connections, segments, destination buffers
        limit_times: list[float] = []
        times: list[list[float]] = [[] for _ in variants]
        for _ in range(config.repeat):
            limit_times.append(limit.once())
            for index, run in enumerate(runs):
                times[index].append(run())
        limit_gbps = size / statistics.median(limit_times) / 1e9
        reports = {}
        for variant, samples in zip(variants, times, strict=True):
            verify = variant != CRC_OFF
            gbps = size / statistics.median(samples) / 1e9
            report: dict[str, Any] = {
                "transport": info.name,
                "size_bytes": size,
                "gbps": round(gbps, 3),
                "limit_gbps": round(limit_gbps, 3),
                "ratio_to_limit": round(gbps / limit_gbps, 3),
                "checksum": "verified" if verify else "off",
                "crcs_by": variant if verify else None,
                "emulated": info.emulated,
            }
            if medium == "shm":
                report["copy"] = copy_path()
            if isinstance(source, EmulatedSource):
                report["limit_gbps"] = source.link.bandwidth_gbps
                report["ratio_to_limit"] = round(gbps / source.link.bandwidth_gbps, 3)
                report["dilation"] = round(source.dilation, 3)
                report["medium"] = medium
                report["medium_limit_gbps"] = round(limit_gbps, 3)
            reports[variant] = report
        return reports
    finally:
        if source is not None:
            source.close()
        if limit is not None:
            limit.close()
        with contextlib.suppress(Exception):
            parent.send(("stop",))
            parent.recv()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def run_transfer_benchmark(config: BenchConfig) -> dict[str, Any]:
    """Run the benchmark; returns the JSON-ready result (see ``topkv bench transfer``)."""
    variant = CRC_TRANSPORT if config.verify else CRC_OFF
    result: dict[str, Any] = _run(config, (variant,))[variant]
    return result


def crc_overhead_report(config: BenchConfig) -> dict[str, Any]:
    """Verified (CRCs by the transport), verified (CRCs supplied by the producer) and
    unverified transfers interleaved in one run.

    The headline ``ratio_verified`` / ``crc_overhead`` use CRCs computed by the transport
    during the transfer (the conservative case); ``*_supplied`` are the same with the
    producer's CRCs passed to ``send_layer`` (only the receiver checksums in the timed
    window). ``crc_overhead`` = t_verified / t_unverified - 1 (medians).
    """
    reports = _run(config, (CRC_TRANSPORT, CRC_SUPPLIED, CRC_OFF))
    on, given, off = reports[CRC_TRANSPORT], reports[CRC_SUPPLIED], reports[CRC_OFF]
    return {
        "transport": config.transport,
        "size_bytes": on["size_bytes"],
        "gbps_verified": on["gbps"],
        "gbps_verified_supplied": given["gbps"],
        "gbps_unverified": off["gbps"],
        "limit_gbps": on["limit_gbps"],
        "ratio_verified": on["ratio_to_limit"],
        "ratio_verified_supplied": given["ratio_to_limit"],
        "ratio_unverified": off["ratio_to_limit"],
        "crc_overhead": round(off["gbps"] / on["gbps"] - 1, 3),
        "crc_overhead_supplied": round(off["gbps"] / given["gbps"] - 1, 3),
        **({"copy": on["copy"]} if "copy" in on else {}),
        "load_average": round(os.getloadavg()[0], 2),
    }
