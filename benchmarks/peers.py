"""TopKV's transports against the transfer libraries people would otherwise use, in one run.

    .venv/bin/python benchmarks/peers.py [--size 256MiB] [--repeat 5] [--json]

Everything runs between two real processes inside one private, loopback-only network
namespace (the script re-executes itself under ``unshare -n``; NIXL/UCX and Mooncake bind
every interface for their data ports). Measured in the same run:

* limits: one ``memcpy`` into a preallocated buffer; a raw blocking socket
  ``sendall`` -> ``recv_into`` (both from
  :func:`topkv.harness.transfer_bench.run_transfer_benchmark`);
* TopKV ``tcp`` and ``shm`` through their public API (``run_transfer_benchmark``: 32 per-layer
  frames, CRC-64 verified on receipt, acknowledged);
* the peers at their best, through their own Python APIs: one NIXL ``WRITE`` of the whole
  buffer (UCX default, which picks its shared-memory path on one host, and UCX forced to
  TCP with ``UCX_TLS=tcp``), and one Mooncake TE ``transfer_sync_write`` over TCP (P2P
  handshake). No checksums on the peers' side; the target's CRC-64 is compared once after
  the timed runs to prove the bytes arrived;
* for reference, the same libraries behind TopKV's contract (the ``nixl``/``mooncake`` arena
  transports: per-layer writes plus CRC-64 verification).

Ratios printed: TopKV tcp vs each peer's TCP path; TopKV shm vs NIXL's best same-host path.
Peers that are not installed (scripts/install-peers.sh) are reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
_NETNS_FLAG = "TOPKV_PEERS_IN_NETNS"


def _in_private_netns() -> None:
    """Re-execute this script inside a fresh network namespace with only loopback up."""
    if os.environ.get(_NETNS_FLAG) == "1":
        return
    env = dict(os.environ, **{_NETNS_FLAG: "1"})
    script = 'ip link set lo up && exec "$0" "$@"'
    argv = ["unshare", "-n", "sh", "-c", script, sys.executable, *sys.argv]
    os.execvpe("unshare", argv, env)


def _parse_size(text: str) -> int:
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}
    upper = text.upper()
    for suffix, factor in units.items():
        if upper.endswith(suffix):
            return int(float(upper[: -len(suffix)]) * factor)
    return int(upper)


# -- raw peers (the libraries' own APIs, one whole-buffer write per transfer) -------------


def _target(peer: str, size: int) -> None:
    """Register a buffer, print how to reach it, then report its CRC-64 when asked."""
    from topkv import wire

    buffer = np.ones(size, dtype=np.uint8)  # faulted in, like a preallocated KV pool
    address = int(buffer.ctypes.data)
    keep: Any
    if peer.startswith("nixl"):
        from nixl_cu12 import nixl_agent, nixl_agent_config

        keep = nixl_agent(f"peers-target-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
        keep.register_memory([(address, size, 0, "")], "DRAM")
        meta = {"agent": keep.get_agent_metadata().hex(), "base": address}
    else:
        from mooncake.engine import TransferEngine

        keep = TransferEngine()
        if keep.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise SystemExit("mooncake: initialize failed")
        if keep.register_memory(address, size) != 0:
            raise SystemExit("mooncake: register_memory failed")
        meta = {"session": f"127.0.0.1:{keep.get_rpc_port()}", "base": address}
    print("READY " + json.dumps(meta), flush=True)
    sys.stdin.readline()
    print(f"CRC {wire.crc64(buffer)}", flush=True)


def _initiator(peer: str, size: int, repeat: int, meta: dict[str, Any]) -> None:
    """Write the whole buffer ``repeat + 1`` times (first is warm-up); print timings."""
    from topkv import wire

    data = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
    address = int(data.ctypes.data)
    times: list[float] = []
    if peer.startswith("nixl"):
        from nixl_cu12 import nixl_agent, nixl_agent_config

        agent = nixl_agent(f"peers-init-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
        agent.register_memory([(address, size, 0, "")], "DRAM")
        name = agent.add_remote_agent(bytes.fromhex(meta["agent"]))
        local = agent.get_xfer_descs([(address, size, 0)], "DRAM")
        remote = agent.get_xfer_descs([(int(meta["base"]), size, 0)], "DRAM")
        backend = ""
        for _ in range(repeat + 1):
            start = time.perf_counter()
            handle = agent.initialize_xfer("WRITE", local, remote, name)
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            times.append(time.perf_counter() - start)
            if state != "DONE":
                raise SystemExit(f"nixl transfer ended in state {state}")
            backend = agent.query_xfer_backend(handle)
            handle.release()
        extra = {"backend": backend}
    else:
        from mooncake.engine import TransferEngine

        te = TransferEngine()
        if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise SystemExit("mooncake: initialize failed")
        te.register_memory(address, size)
        for _ in range(repeat + 1):
            start = time.perf_counter()
            status = te.transfer_sync_write(meta["session"], address, int(meta["base"]), size)
            times.append(time.perf_counter() - start)
            if status != 0:
                raise SystemExit(f"mooncake transfer_sync_write returned {status}")
        extra = {}
    record = {"seconds": times[1:], "crc": wire.crc64(data), **extra}
    print("RESULT " + json.dumps(record), flush=True)


def _line(proc: subprocess.Popen[str], prefix: str) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(prefix):
            return line[len(prefix) :].strip()
    raise RuntimeError(f"peer exited ({proc.wait()}) without printing {prefix!r}")


def run_raw_peer(peer: str, size: int, repeat: int) -> dict[str, Any]:
    env = dict(os.environ, NIXL_LOG_LEVEL="WARN", GLOG_minloglevel="2")
    if peer == "nixl-ucx-tcp":
        env["UCX_TLS"] = "tcp"
    me = [sys.executable, __file__]
    common: dict[str, Any] = {"env": env, "stdout": subprocess.PIPE, "text": True}
    target = subprocess.Popen(
        [*me, "--role", "target", "--engine", peer, "--size", str(size)],
        stdin=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        **common,
    )
    try:
        meta = _line(target, "READY ")
        init = subprocess.Popen(
            [
                *me,
                "--role",
                "initiator",
                "--engine",
                peer,
                "--size",
                str(size),
                "--repeat",
                str(repeat),
                "--meta",
                meta,
            ],
            stderr=subprocess.DEVNULL,
            **common,
        )
        record = json.loads(_line(init, "RESULT "))
        init.wait(60)
        assert target.stdin is not None
        target.stdin.write("check\n")
        target.stdin.flush()
        landed = int(_line(target, "CRC "))
    finally:
        target.kill()
        target.wait(10)
    if landed != record["crc"]:
        raise RuntimeError(f"{peer}: bytes at the target differ from the source")
    seconds = statistics.median(record["seconds"])
    result = {"gbps": size / seconds / 1e9, "checksum": "compared after the run"}
    if "backend" in record:
        result["backend"] = record["backend"]
    return result


# -- TopKV -------------------------------------------------------------------------------


def run_topkv(transport: str, size: int, repeat: int) -> dict[str, Any]:
    from topkv.harness.transfer_bench import BenchConfig, run_transfer_benchmark

    report = run_transfer_benchmark(BenchConfig(transport, size, repeat))
    return {"gbps": report["gbps"], "limit_gbps": report["limit_gbps"], "checksum": "verified"}


def run_topkv_over_arena(
    transport: str, size: int, repeat: int, options: dict[str, Any]
) -> dict[str, Any]:
    from topkv.harness.arena_bench import run_arena_benchmark

    report = run_arena_benchmark(transport, size, repeat, options)
    return {"gbps": report["gbps"], "checksum": report["checksum"]}


# -- driver ------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="256MiB")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--role", choices=["driver", "target", "initiator"], default="driver")
    parser.add_argument("--engine", dest="peer", default="", help="raw peer row (internal)")
    parser.add_argument("--meta", default="{}")
    args = parser.parse_args()
    size = _parse_size(args.size)
    if args.role == "target":
        _target(args.peer, size)
        return
    if args.role == "initiator":
        _initiator(args.peer, size, args.repeat, json.loads(args.meta))
        return
    _in_private_netns()
    sys.path.insert(0, str(ROOT / "src"))
    from topkv.harness.transfer_bench import bench_layout
    from topkv.transport.arena.factory import missing_package

    size = bench_layout(size).total_bytes  # the TopKV runs' exact size, for every row
    rows: dict[str, dict[str, Any]] = {}
    rows["topkv-tcp"] = run_topkv("tcp", size, args.repeat)
    rows["topkv-shm"] = run_topkv("shm", size, args.repeat)
    rows["limit-raw-socket"] = {"gbps": rows["topkv-tcp"]["limit_gbps"]}
    rows["limit-memcpy"] = {"gbps": rows["topkv-shm"]["limit_gbps"]}
    peers = {
        "nixl-ucx-default": ("nixl", {}),
        "nixl-ucx-tcp": ("nixl", {"ucx_tls": "tcp"}),
        "mooncake-tcp": ("mooncake", {}),
    }
    for row, (package, options) in peers.items():
        reason = missing_package(package)
        if reason is not None:
            rows[row] = {"skipped": reason}
            continue
        rows[row] = run_raw_peer(row, size, args.repeat)
        rows[f"topkv-over-{row}"] = run_topkv_over_arena(package, size, args.repeat, options)

    def gbps(name: str) -> float | None:
        return rows.get(name, {}).get("gbps")

    ratios: dict[str, float] = {}
    tcp, shm = gbps("topkv-tcp"), gbps("topkv-shm")
    for peer in ("mooncake-tcp", "nixl-ucx-tcp"):
        if tcp and gbps(peer):
            ratios[f"topkv-tcp / {peer}"] = tcp / gbps(peer)  # type: ignore[operator]
    same_host = [g for g in (gbps("nixl-ucx-default"), gbps("nixl-ucx-tcp")) if g]
    if shm and same_host:
        ratios["topkv-shm / nixl best same-host"] = shm / max(same_host)
    if tcp:
        ratios["topkv-tcp / raw socket"] = tcp / rows["limit-raw-socket"]["gbps"]
    if shm:
        ratios["topkv-shm / memcpy"] = shm / rows["limit-memcpy"]["gbps"]
    load = os.getloadavg()  # the figures move with other load on the machine: say how much
    report = {
        "size_bytes": size,
        "repeat": args.repeat,
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in load],
        "rows": rows,
        "ratios": ratios,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"{size / (1 << 20):.0f} MiB, median of {args.repeat}, two processes, private netns; "
        f"{os.cpu_count()} CPUs, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
    )
    print(f"{'path':<34}{'GB/s':>8}  notes")
    for name, row in rows.items():
        if "skipped" in row:
            print(f"{name:<34}{'-':>8}  skipped: {row['skipped']}")
            continue
        notes = ", ".join(f"{k}={v}" for k, v in row.items() if k not in ("gbps", "limit_gbps"))
        print(f"{name:<34}{row['gbps']:>8.2f}  {notes}")
    print()
    for name, value in ratios.items():
        print(f"{name:<42}{value:>6.2f}x")


if __name__ == "__main__":
    main()
