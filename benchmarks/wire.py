"""Wire-format throughput against a memcpy of the same bytes, measured in the same run.

Usage: python benchmarks/wire.py [--mib 256] [--repeats 5]

The payload (K and V, half each) is random bytes, so no page or cache trick flatters the
checksum. Reported GB/s are payload bytes / best wall time of ``--repeats`` runs:

- memcpy            np.copyto of the payload into a preallocated, pre-touched buffer
- encode+checksum   encode_kv: header + CRC-64/NVME of K and of V (tensors not copied)
- decode+verify     decode_kv of the whole received frame: header checks + both CRCs
- layer frames      encode_layer_frame + decode_layer_frame per layer (64 layers)
- crc64, 2 threads  the same CRC work split over two threads (does awscrt drop the GIL?)

Ratios > 1 mean faster than memcpy. Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import threading
import time
from collections.abc import Callable

import numpy as np

from topkv.wire import (
    CRC64_VARIANT,
    DType,
    crc64,
    decode_kv,
    decode_layer_frame,
    encode_kv,
    encode_layer_frame,
)

LAYERS = 64
KV_HEADS = 8
HEAD_DIM = 128
DTYPE = DType.FP16


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="payload size, K plus V (MiB)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    per_token = LAYERS * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    seq_len = (args.mib << 20) // 2 // per_token
    shape = (LAYERS, seq_len, KV_HEADS, HEAD_DIM)
    rng = np.random.default_rng(0)
    k = rng.integers(0, 2**16, size=shape, dtype=np.uint16).view(np.float16)
    v = rng.integers(0, 2**16, size=shape, dtype=np.uint16).view(np.float16)
    payload = k.nbytes + v.nbytes
    dims = {"seq_len": seq_len, "layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM}

    src = np.concatenate([k.reshape(-1).view(np.uint8), v.reshape(-1).view(np.uint8)])
    dst = np.ones_like(src)  # pre-touched
    t_memcpy = best_seconds(lambda: np.copyto(dst, src), args.repeats)

    def encode() -> object:
        return encode_kv(k, v, request_id="bench", model_id=1, dtype=DTYPE, **dims)

    t_encode = best_seconds(encode, args.repeats)

    frame = encode_kv(k, v, request_id="bench", model_id=1, dtype=DTYPE, **dims)
    received = bytearray(frame.nbytes)
    offset = 0
    for buf in frame.buffers:
        received[offset : offset + buf.nbytes] = buf
        offset += buf.nbytes
    t_decode = best_seconds(lambda: decode_kv(received), args.repeats)

    layer_frames = [
        encode_layer_frame(
            k[i], v[i], request_id="bench", model_id=1, dtype=DTYPE, layer_index=i, **dims
        ).to_bytes()
        for i in range(LAYERS)
    ]

    def layered() -> None:
        for i in range(LAYERS):
            encode_layer_frame(
                k[i], v[i], request_id="bench", model_id=1, dtype=DTYPE, layer_index=i, **dims
            )
            decode_layer_frame(layer_frames[i])

    t_layers = best_seconds(layered, args.repeats)

    def crc_two_threads() -> None:
        threads = [threading.Thread(target=crc64, args=(t,)) for t in (k, v)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    t_crc1 = best_seconds(lambda: (crc64(k), crc64(v)), args.repeats)
    t_crc2 = best_seconds(crc_two_threads, args.repeats)

    def gbps(seconds: float, nbytes: int = payload) -> float:
        return nbytes / seconds / 1e9

    print(
        f"wire benchmark: {payload / 2**20:.0f} MiB payload (K+V, {DTYPE.wire_name}, "
        f"{LAYERS}x{seq_len}x{KV_HEADS}x{HEAD_DIM}), {CRC64_VARIANT}, best of {args.repeats}"
    )
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    rows = [
        ("memcpy (np.copyto)", t_memcpy, payload),
        ("encode+checksum", t_encode, payload),
        ("decode+verify", t_decode, payload),
        ("layer frames enc+dec", t_layers, 2 * payload),
        ("crc64 K,V 1 thread", t_crc1, payload),
        ("crc64 K,V 2 threads", t_crc2, payload),
    ]
    memcpy = gbps(t_memcpy)
    print(f"{'operation':<24}{'ms':>10}{'GB/s':>10}{'vs memcpy':>11}")
    for name, seconds, nbytes in rows:
        rate = gbps(seconds, nbytes)
        print(f"{name:<24}{seconds * 1e3:>10.1f}{rate:>10.2f}{rate / memcpy:>10.2f}x")


if __name__ == "__main__":
    main()
