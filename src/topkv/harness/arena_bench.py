"""``topkv bench transfer --transport nixl|mooncake|cuda`` and the limits it compares to.

Sink and sender are :mod:`topkv.harness.peers` processes; nixl and mooncake run inside a
private network namespace (:mod:`topkv.harness.netns`). The limit, measured in the same run,
is one memcpy (:func:`memcpy_gbps`) for same-host paths and a raw blocking socket
(:func:`raw_socket_gbps`) for TCP paths; the JSON has the keys of the other media's reports.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from topkv.harness.netns import PrivateNetns
from topkv.harness.peers import expected_digest, kv_data, spawn_sender, spawn_sink
from topkv.transport.arena.factory import ARENA_TRANSPORTS, missing_package
from topkv.transport.errors import ChecksumMismatch, PeerDied, TransportError, TransportUnavailable


def memcpy_gbps(size: int, repeat: int) -> float:
    """One copy into a preallocated, faulted-in buffer: the same-host limit."""
    import statistics

    import numpy as np

    src = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    dst = np.ones(size, dtype=np.uint8)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        dst[:] = src
        times.append(time.perf_counter() - start)
    return size / statistics.median(times) / 1e9


def _raw_receiver(port_out: Any, size: int, repeat: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port_out.send(listener.getsockname()[1])
    buffer = memoryview(bytearray(size))
    peer, _ = listener.accept()
    with peer, listener:
        for _ in range(repeat):
            got = 0
            while got < size:
                n = peer.recv_into(buffer[got:])
                if n == 0:
                    return
                got += n
            peer.sendall(b"k")


def raw_socket_gbps(size: int, repeat: int) -> float:
    """Blocking ``sendall`` -> ``recv_into`` a preallocated buffer between two processes."""
    import multiprocessing
    import statistics

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_raw_receiver, args=(child, size, repeat), daemon=True)
    proc.start()
    data = kv_data(size, 2).data
    times = []
    try:
        with socket.create_connection(("127.0.0.1", parent.recv()), timeout=60) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(repeat):
                start = time.perf_counter()
                sock.sendall(data)
                if sock.recv(1) != b"k":
                    raise PeerDied("raw-socket receiver failed")
                times.append(time.perf_counter() - start)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return size / statistics.median(times) / 1e9


def run_arena_benchmark(
    transport: str, size_bytes: int, repeat: int = 5, options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``topkv bench transfer`` for nixl | mooncake | cuda, same JSON as the other media.

    Sink and sender are separate processes; nixl and mooncake run inside a private network
    namespace. The limit, measured in the same run, is one memcpy for same-host paths (nixl
    with UCX's default transports, cuda) and a raw blocking socket for TCP paths (mooncake,
    nixl with ``{"ucx_tls": "tcp"}``).
    """
    import statistics

    from topkv.harness.transfer_bench import bench_layout

    if transport not in ARENA_TRANSPORTS:
        raise TransportUnavailable(
            f"{transport!r} is not an arena transport ({', '.join(ARENA_TRANSPORTS)})"
        )
    reason = missing_package(transport)
    if reason is not None:
        raise TransportUnavailable(reason)
    options = dict(options or {})
    layout = bench_layout(size_bytes)
    size = layout.total_bytes
    tcp_path = transport == "mooncake" or options.get("ucx_tls") == "tcp"
    limit = raw_socket_gbps(size, repeat) if tcp_path else memcpy_gbps(size, repeat)
    options.setdefault("capacity_bytes", size + (1 << 20))
    sink_options = options
    send_options = {k: v for k, v in options.items() if k != "capacity_bytes"}
    if transport == "cuda":
        send_options = {}
    secret = os.urandom(32)
    netns = PrivateNetns() if transport != "cuda" else None
    try:
        sink, address = spawn_sink(
            netns, transport, secret, count=repeat + 1, options=sink_options, digest_all=False
        )
        try:
            sender = spawn_sender(
                netns,
                transport,
                address,
                secret,
                1,
                layout,
                repeat=repeat + 1,
                options=send_options,
            )
            try:
                sent = [sender.record(600) for _ in range(repeat + 1)]
                got = [sink.record(600) for _ in range(repeat + 1)]
            finally:
                sender.stop()
        finally:
            sink.stop()
    finally:
        if netns is not None:
            netns.close()
    failed = [r for r in sent + got if not r["ok"]]
    if failed:
        raise TransportError(f"{transport} benchmark transfer failed: {failed[0]}")
    if got[-1]["sha256"] != expected_digest(size, 1):
        raise ChecksumMismatch(f"{transport} benchmark: received bytes differ from the source")
    gbps = size / statistics.median(r["seconds"] for r in sent[1:]) / 1e9
    return {
        "transport": transport,
        "size_bytes": size,
        "gbps": round(gbps, 3),
        "limit_gbps": round(limit, 3),
        "ratio_to_limit": round(gbps / limit, 3),
        "checksum": "verified",
        "emulated": False,
    }
