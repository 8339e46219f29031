"""Transfer benchmark: shm, tcp and emulated-rdma between two processes, 256 MiB.

For shm and tcp, one run interleaves the medium's limit (memcpy / raw blocking socket), the
verified transfer and an unverified one (no CRC on either side), and prints one JSON line
with both ratios to the limit and the CRC-64 overhead. emulated-rdma prints the
``topkv bench transfer --json`` record. Not a test: figures depend on the machine and its
load (the 1-minute load average is printed with each line).
Usage: python benchmarks/transfer.py [SIZE_BYTES] [REPEAT]
"""

from __future__ import annotations

import json
import sys

from topkv.harness.transfer_bench import BenchConfig, crc_overhead_report, run_transfer_benchmark


def main() -> None:
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 256 << 20
    repeat = int(sys.argv[2]) if len(sys.argv) > 2 else 9
    for transport in ("shm", "tcp"):
        print(json.dumps(crc_overhead_report(BenchConfig(transport, size, repeat))), flush=True)
    print(json.dumps(run_transfer_benchmark(BenchConfig("emulated-rdma", size, repeat))))


if __name__ == "__main__":
    main()
