"""Transfer benchmark: shm, tcp and emulated-rdma between two processes, 256 MiB.

Prints one JSON line per transport (same fields as ``topkv bench transfer --json``) and the
CRC-64 verification overhead for the real media. Not a test: figures depend on the machine.
Usage: python benchmarks/transfer.py [SIZE_BYTES] [REPEAT]
"""

from __future__ import annotations

import json
import sys

from topkv.transport.benchmark import BenchConfig, crc_overhead_report, run_transfer_benchmark


def main() -> None:
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 256 << 20
    repeat = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    for transport in ("shm", "tcp", "emulated-rdma"):
        print(json.dumps(run_transfer_benchmark(BenchConfig(transport, size, repeat))))
    for transport in ("shm", "tcp"):
        print(json.dumps(crc_overhead_report(BenchConfig(transport, size, repeat))))


if __name__ == "__main__":
    main()
