"""Copy + CRC-64 into a preallocated buffer, one process, against memcpy in the same run.

Usage: python benchmarks/copy_crc.py [--mib 256] [--repeats 7] [--tensor-mib 4]

What the shm sender does per tensor, isolated from the transport. Rows (median ms, GB/s,
ratio to memcpy; > 1 is faster than memcpy):

- memcpy                 np.copyto of the whole buffer (glibc; the shm benchmark's limit)
- crc64 (awscrt)         checksum only, the reference implementation
- native copy+crc        topkv._copycrc.copy_crc64 per tensor, best level for this CPU
- native copy+crc Lk     the same at each lower level (1 PCLMULQDQ, 0 byte table: skipped
                         above 64 MiB, it is ~1 GB/s)
- native copy            topkv._copycrc.copy per tensor (streaming stores, no CRC)
- fallback copy+crc      awscrt CRC then np.copyto per 1 MiB chunk (no C extension)

The source is random bytes. Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

from topkv.transport import copying
from topkv.wire.checksum import crc64

try:
    from topkv import _copycrc  # type: ignore[attr-defined]
except ImportError:
    _copycrc = None


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tensor-mib", type=int, default=4, help="bytes per copy call (MiB)")
    args = parser.parse_args()
    size, step = args.mib << 20, args.tensor_mib << 20
    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    dst = np.ones_like(src)  # pre-touched
    pieces = [(dst[i : i + step].data, src[i : i + step].data) for i in range(0, size, step)]

    def per_tensor(call: Callable[[memoryview, memoryview], object]) -> Callable[[], None]:
        def run() -> None:
            for out, inp in pieces:
                call(out, inp)

        return run

    def fallback() -> None:
        saved = copying._native_copy_crc
        copying._native_copy_crc = None
        try:
            per_tensor(copying.copy_with_crc)()
        finally:
            copying._native_copy_crc = saved

    rows: list[tuple[str, Callable[[], object]]] = [
        ("memcpy (np.copyto)", lambda: np.copyto(dst, src)),
        ("crc64 (awscrt)", lambda: crc64(src)),
    ]
    if _copycrc is not None:
        native = _copycrc
        rows.append(
            (f"native copy+crc L{native.LEVEL}", per_tensor(lambda d, s: native.copy_crc64(d, s)))
        )
        for level in range(native.LEVEL - 1, -1, -1):
            if level == 0 and size > 64 << 20:
                continue
            rows.append(
                (
                    f"native copy+crc L{level}",
                    per_tensor(lambda d, s, lv=level: native.copy_crc64(d, s, 0, lv)),
                )
            )
        rows.append(("native copy", per_tensor(native.copy)))
    rows.append(("fallback copy+crc", fallback))

    print(
        f"copy benchmark: {args.mib} MiB in {args.tensor_mib} MiB calls, median of "
        f"{args.repeats}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; "
        f"shm uses: {copying.copy_path()} ({copying.NATIVE_STATUS})"
    )
    times = {name: median_seconds(fn, args.repeats) for name, fn in rows}
    memcpy = times["memcpy (np.copyto)"]
    print(f"{'operation':<24}{'ms':>9}{'GB/s':>9}{'vs memcpy':>11}")
    for name, seconds in times.items():
        print(
            f"{name:<24}{seconds * 1e3:>9.1f}{size / seconds / 1e9:>9.2f}{memcpy / seconds:>10.2f}x"
        )


if __name__ == "__main__":
    main()
