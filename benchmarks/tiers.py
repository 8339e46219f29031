"""KV tier benchmark: each tier's put/get against the limit measured in the same run.

* host tier (a pre-faulted arena; ``MemoryTierStore``) put and get of one KV cache vs one
  ``memcpy`` of as many bytes between pre-faulted buffers (numpy ``copyto``);
* disk tier (``DiskTierStore``: per-layer wire frames, CRC-64 checked on every read) write
  and read vs raw direct I/O of as many bytes in the same directory (``O_DIRECT`` from an
  aligned buffer, 8 MiB per call; ``dd oflag=direct`` / ``iflag=direct`` as well where dd
  is installed), and whether direct I/O was possible there;
* the peer: one safetensors file per request per layer, as vLLM's ExampleConnector stores
  KV (``safetensors.numpy``), written and read back;
* LMCache's CPU/disk backend only where ``import lmcache`` works (the report says why not);
* the device tier where torch sees a GPU (``TorchDeviceTier``: one ``torch.uint8`` arena on
  the GPU, pinned staging, CRC-64 checked on every read back) put and get of the same KV vs
  a torch ``copy_`` of as many bytes, host to GPU and back, measured in the same run, from
  pinned memory (the link's limit) and from pageable memory (the frames' bytes as they
  are); ``--device cpu`` runs the same code on a CPU tensor (a check of the benchmark, not
  a GPU figure).

Runs are interleaved (limit, tier, limit, tier ...) and the medians reported. Not a test:
figures depend on the machine, its disk and its load (printed with the figures).
Usage: ``python benchmarks/tiers.py [--json] [--size BYTES] [--repeat N] [--dir DIR]
[--device auto|cpu|none]``
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from topkv.policy.tiers import TierSpec
from topkv.service.kvstore import HeldKV
from topkv.service.tiers.arena import Arena
from topkv.service.tiers.stores import DiskTierStore, MemoryTierStore
from topkv.transport.base import KVLayout
from topkv.wire import crc64

CHUNK = 8 << 20


def _kv(size: int) -> HeldKV:
    """One KV cache of ``size`` bytes: 32 layers of K and V, random bytes, real CRC-64s."""
    layers = 32
    tensor = size // (2 * layers)
    head_dim, heads = 128, 8
    seq = tensor // (head_dim * heads * 2)
    layout = KVLayout(layers, seq, heads, head_dim, "fp16")
    data = np.random.default_rng(0).integers(0, 256, layout.total_bytes, dtype=np.uint8)
    view = memoryview(data)
    n = layout.tensor_bytes
    tensors = [(view[(2 * i) * n : (2 * i + 1) * n], view[(2 * i + 1) * n : (2 * i + 2) * n])
               for i in range(layers)]  # fmt: skip
    crcs = [tuple(crc64(t) for t in layer) for layer in tensors]
    return HeldKV(1, "bench", layout, tensors, crcs, origin="received")


def _time(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _aligned(n: int) -> mmap.mmap:
    buf = mmap.mmap(-1, -(-n // 4096) * 4096)
    buf.write(b"\1" * len(buf))  # pre-fault
    return buf


def _raw_write(path: Path, buf: mmap.mmap, direct: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0))
    view = memoryview(buf)
    try:
        for off in range(0, len(buf), CHUNK):
            os.write(fd, view[off : off + CHUNK])
        if not direct:
            os.fsync(fd)
    finally:
        view.release()
        os.close(fd)


def _raw_read(path: Path, buf: mmap.mmap, direct: bool) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    view = memoryview(buf)
    try:
        for off in range(0, len(buf), CHUNK):
            os.readv(fd, [view[off : off + CHUNK]])
    finally:
        view.release()
        os.close(fd)


def _dd(path: Path, size: int) -> dict[str, float] | None:
    """dd's own direct write and read of ``size`` bytes (seconds), if dd is here."""
    if shutil.which("dd") is None:
        return None
    count = -(-size // CHUNK)
    out = {}
    for what, args in (
        ("write_s", [f"of={path}", "if=/dev/zero", "oflag=direct"]),
        ("read_s", [f"if={path}", "of=/dev/null", "iflag=direct"]),
    ):
        cmd = ["dd", *args, f"bs={CHUNK}", f"count={count}", "status=none"]
        took = _time(lambda c=cmd: subprocess.run(c, check=True, capture_output=True))
        out[what] = took
    path.unlink(missing_ok=True)
    return out


def _safetensors_peer(kv: HeldKV, directory: Path, repeat: int) -> dict[str, Any]:
    """vLLM ExampleConnector's layout: one safetensors file per request per layer."""
    from safetensors.numpy import load_file, save_file

    layers = [{"k": np.frombuffer(k, np.uint8), "v": np.frombuffer(v, np.uint8)}
              for k, v in kv.layers]  # fmt: skip
    writes, reads = [], []
    for _ in range(repeat):
        writes.append(_time(lambda: [save_file(t, str(directory / f"req1-layer{i}.safetensors"))
                                     for i, t in enumerate(layers)]))  # fmt: skip
        os.sync()
        reads.append(_time(lambda: [load_file(str(directory / f"req1-layer{i}.safetensors"))
                                    for i in range(len(layers))]))  # fmt: skip
    for i in range(len(layers)):
        (directory / f"req1-layer{i}.safetensors").unlink()
    size = kv.layout.total_bytes
    return {
        "write_gbps": size / statistics.median(writes) / 1e9,
        "read_gbps": size / statistics.median(reads) / 1e9,
        "note": "page cache, no fsync, no checksum (as ExampleConnector)",
    }


def _lmcache() -> dict[str, Any]:
    try:
        import lmcache  # type: ignore[import-not-found]
    except Exception as exc:  # ImportError, or its CUDA extension failing to load
        return {"ran": False, "why": f"import lmcache failed: {type(exc).__name__}: {exc}"[:300]}
    return {"ran": False, "why": f"lmcache {getattr(lmcache, '__version__', '?')} imports; "
            "its CPU/disk backend needs a vLLM engine config, not driven here"}  # fmt: skip


def _device_tier(kv: HeldKV, repeat: int, device: str) -> dict[str, Any]:
    """The device tier's put/get vs torch ``copy_`` of as many bytes, interleaved."""
    try:
        import torch
    except ImportError:
        return {"ran": False, "why": "torch is not installed (the model extra)"}
    if device == "none":
        return {"ran": False, "why": "--device none"}
    if device == "auto" and not torch.cuda.is_available():
        return {"ran": False, "why": f"torch {torch.__version__} sees no CUDA GPU"}
    from topkv.service.tiers.device import TorchDeviceTier
    from topkv.service.tiers.torch_arena import TorchArena

    dev = torch.device("cuda" if device == "auto" else device)
    cuda = dev.type == "cuda"
    nbytes = kv.layout.total_bytes
    tier = TorchDeviceTier(TorchArena(nbytes + (1 << 20), dev), 1)
    on_dev = torch.ones(nbytes, dtype=torch.uint8, device=tier.arena.device)
    pinned = torch.ones(nbytes, dtype=torch.uint8, pin_memory=cuda)
    pageable = torch.from_numpy(np.ones(nbytes, np.uint8))
    out = memoryview(np.ones(nbytes, np.uint8))  # the engine's host buffers of a decode

    def copy(dst: Any, src: Any) -> Callable[[], None]:
        def run() -> None:
            dst.copy_(src, non_blocking=cuda)
            if cuda:
                torch.cuda.synchronize(tier.arena.device)

        return run

    times: dict[str, list[float]] = {k: [] for k in ("h2d", "d2h", "h2d_pg", "d2h_pg", "put",
                                                     "get")}  # fmt: skip
    tier.write(kv)  # warm: the staging buffers and the output's pages are touched once
    tier.read(kv.request_id, kv.layout, kv.crcs, out=out)
    tier.drop(kv.request_id)
    for _ in range(repeat):
        times["h2d"].append(_time(copy(on_dev, pinned)))
        times["put"].append(_time(lambda: tier.write(kv)))
        times["h2d_pg"].append(_time(copy(on_dev, pageable)))
        times["d2h"].append(_time(copy(pinned, on_dev)))
        times["get"].append(_time(lambda: tier.read(kv.request_id, kv.layout, kv.crcs, out=out)))
        times["d2h_pg"].append(_time(copy(pageable, on_dev)))
        tier.drop(kv.request_id)
    if bytes(out[:4096]) != bytes(kv.layers[0][0][:4096]):
        raise SystemExit("device tier read back other bytes")  # never reported as a figure
    med = {k: statistics.median(v) for k, v in times.items()}
    tier.close()
    return {
        "ran": True,
        "device": tier.device_name,
        "kind": tier.kind,
        "pinned_staging": tier.arena.pinned,
        "put_ratio": med["h2d"] / med["put"],  # vs pinned copy_: the link's limit
        "get_ratio": med["d2h"] / med["get"],
        "put_ratio_pageable": med["h2d_pg"] / med["put"],
        "get_ratio_pageable": med["d2h_pg"] / med["get"],
        **{f"{k}_gbps": nbytes / v / 1e9 for k, v in med.items()},
        "note": "put/get: the KV's tensors through two staging buffers (pinned on CUDA); get "
        "checks every tensor's CRC-64 (copy_ checks nothing)",
    }


def run(size: int, repeat: int, directory: Path, device_tier: str = "auto") -> dict[str, Any]:
    kv = _kv(size)
    nbytes = kv.layout.total_bytes
    # host tier vs memcpy between pre-faulted buffers
    src = np.frombuffer(bytearray(nbytes), np.uint8)
    src[:] = 1
    dst = np.ones(nbytes, np.uint8)
    host = MemoryTierStore(
        TierSpec("host", "host", nbytes + (1 << 20), 1e-7, 10.0), Arena(nbytes + (1 << 20))
    )
    device = memoryview(np.ones(nbytes, np.uint8))
    memcpy, put, get = [], [], []
    for _ in range(repeat):
        memcpy.append(_time(lambda: np.copyto(dst, src)))
        put.append(_time(lambda: host.write(kv)))
        memcpy.append(_time(lambda: np.copyto(dst, src)))
        get.append(_time(lambda: host.read(1, kv.layout, kv.crcs, out=device)))
        host.drop(1)
    host.close()
    # disk tier vs raw direct I/O of as many bytes as the tier's file, same directory
    disk = DiskTierStore(TierSpec("disk", "disk", 4 * nbytes, 20e-6, 1.0), directory)
    disk.write(kv)
    file_bytes = disk.file_bytes(1) or nbytes
    disk.drop(1)
    raw = _aligned(file_bytes)
    into = _aligned(file_bytes)  # the device memory a promotion reads into
    raw_path = directory / "raw-direct.bin"
    raw_w, raw_r, dw, dr = [], [], [], []
    for _ in range(repeat):
        raw_w.append(_time(lambda: _raw_write(raw_path, raw, disk.direct_io)))
        dw.append(_time(lambda: disk.write(kv)))
        raw_r.append(_time(lambda: _raw_read(raw_path, raw, disk.direct_io)))
        dr.append(_time(lambda: disk.read(1, kv.layout, kv.crcs, out=into)))
        disk.drop(1)
    raw_path.unlink(missing_ok=True)
    dd = _dd(raw_path, file_bytes) if disk.direct_io else None
    med = statistics.median
    raw_bytes = file_bytes
    return {
        "size_bytes": nbytes,
        "host_put_ratio": med(memcpy) / med(put),
        "host_get_ratio": med(memcpy) / med(get),
        "disk_write_ratio": med(raw_w) / med(dw),  # same bytes: a ratio of times
        "disk_read_ratio": med(raw_r) / med(dr),
        "direct_io": disk.direct_io,
        "disk_io": disk.io_note,
        "directory": str(directory),
        "memcpy_gbps": nbytes / med(memcpy) / 1e9,
        "host_put_gbps": nbytes / med(put) / 1e9,
        "host_get_gbps": nbytes / med(get) / 1e9,
        "raw_direct_write_gbps": raw_bytes / med(raw_w) / 1e9,
        "raw_direct_read_gbps": raw_bytes / med(raw_r) / 1e9,
        "disk_write_gbps": file_bytes / med(dw) / 1e9,
        "disk_read_gbps": file_bytes / med(dr) / 1e9,
        "disk_file_bytes": file_bytes,
        "dd_direct_gbps": None
        if dd is None
        else {k.replace("_s", ""): raw_bytes / v / 1e9 for k, v in dd.items()},
        "peer_safetensors_per_layer": _safetensors_peer(kv, directory, repeat),
        "peer_lmcache": _lmcache(),
        **_device_summary(_device_tier(kv, repeat, device_tier)),
        "repeat": repeat,
        "load_avg_1m": os.getloadavg()[0],
    }


def _device_summary(report: dict[str, Any]) -> dict[str, Any]:
    """``device_put_ratio``/``device_get_ratio`` (None where no GPU ran) and the details."""
    gpu = report.get("kind") == "gpu"
    return {
        "device_put_ratio": report["put_ratio"] if gpu else None,
        "device_get_ratio": report["get_ratio"] if gpu else None,
        "device_tier": report,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--size", type=int, default=256 << 20, help="bytes of the KV cache")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="disk tier directory")
    parser.add_argument(
        "--device",
        default="auto",
        help="device tier: auto (a CUDA GPU if torch sees one), cpu (the same code on a CPU "
        "tensor, a check), none",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="topkv-tiers-") as tmp:
        report = run(args.size, args.repeat, Path(tmp), args.device)
    if args.json:
        print(json.dumps(report))
        return
    for key, value in report.items():
        print(f"{key:28} {value}")


if __name__ == "__main__":
    main()
