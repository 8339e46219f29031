"""Prefill/decode disaggregation on real vLLM CPU instances: TopKVConnector vs vLLM's
ExampleConnector vs vLLM's NixlConnector vs no disaggregation, same requests, one run.

Every request is a seeded random prompt of 100-900 tokens to TopKV's tiny Llama (float32,
4 layers, hidden 256). TTFT of a disaggregated setup = the prefill call (``max_tokens`` 1,
the KV leaves during it) + the decode instance's call for the first token (it loads the KV,
recomputes the last prompt token, samples); ``transfer_ms`` is that decode call, the part of
TTFT that disaggregation adds. ``none`` is the TopKV prefill instance serving the whole
request itself (its connector idle). The setups run side by side, request by request, so
they share the machine's noise.

Run: ``.venv-vllm/bin/python benchmarks/vllm_pd.py [--json] [--requests N]`` (with the
project's ``.venv`` it re-runs itself under ``.venv-vllm`` when that exists, and skips
otherwise: ``scripts/install-vllm.sh`` makes it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

VENV_PYTHON = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"


def _need_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        if VENV_PYTHON.exists() and Path(sys.executable).resolve() != VENV_PYTHON.resolve():
            os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), *sys.argv])
        print("vllm_pd: vLLM is not installed (scripts/install-vllm.sh); skipped")
        raise SystemExit(0) from None


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as answer:
        out = json.loads(answer.read())
    return out, (time.perf_counter() - started) * 1e3


def _pcts(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return {"p50": statistics.median(ordered), "p90": p90}


def _nixl_error() -> str:
    try:
        import nixl._api  # noqa: F401
    except ImportError as exc:
        return (
            f"NIXL is not importable in this environment ({exc}); vLLM's NixlConnector "
            "needs `pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1` in .venv-vllm "
            "(not run by this benchmark)"
        )
    return "NixlConnector is installed but not wired into this benchmark yet"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--requests", type=int, default=12)
    args = parser.parse_args()
    _need_vllm()
    from topkv.integrations.vllm.launch import kv_transfer_config, start_vllm, wait_healthy
    from topkv.integrations.vllm.model import VOCAB_SIZE, write_tiny_llama
    from topkv.service.cluster import Supervisor

    root = Path(tempfile.mkdtemp(prefix="topkv-vllm-pd-"))
    model = write_tiny_llama(root / "model")
    (root / "secret").write_text(os.urandom(16).hex())
    decode_tcp = _port()
    topkv_extra = {"secret_file": str(root / "secret"), "shm_dir": str(root)}
    example_extra = {"shared_storage_path": str(root / "example")}
    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": example_extra,
    }
    configs = {
        "topkv-prefill": kv_transfer_config("kv_producer", {**topkv_extra, "worker_id": "p"}),
        "topkv-decode": kv_transfer_config(
            "kv_consumer", {**topkv_extra, "worker_id": "d", "tcp_port": decode_tcp}
        ),
        "example-prefill": example,
        "example-decode": example,
    }
    supervisor = Supervisor(root / "logs", grace_s=20)
    instances = {
        name: start_vllm(supervisor, name, model, _port(), cpu=str(i % 2), kv_config=config)
        for i, (name, config) in enumerate(configs.items())
    }
    try:
        wait_healthy(list(instances.values()), timeout_s=600)
        rng = random.Random(0)
        lengths = [rng.randrange(100, 901) for _ in range(args.requests)]
        ttft: dict[str, list[float]] = {"topkv": [], "example": [], "none": []}
        transfer: dict[str, list[float]] = {"topkv": [], "example": []}
        kv_bytes = 0
        destination = "shm://" + os.path.join(str(root), "topkv-vllm-d.sock")
        base = {"model": "tiny-llama", "max_tokens": 1, "temperature": 0}
        for i, length in enumerate(lengths):
            prompt = [rng.randrange(VOCAB_SIZE - 2) for _ in range(length)]
            send = {"do_remote_decode": True,
                    "topkv": {"transfer_id": i, "destination": destination}}  # fmt: skip
            load = {"do_remote_prefill": True, "topkv": {"transfer_id": i, "medium": "shm"}}
            url = {name: inst.url + "/v1/completions" for name, inst in instances.items()}
            _, pre = _post(
                url["topkv-prefill"], {**base, "prompt": prompt, "kv_transfer_params": send}
            )
            answer, dec = _post(
                url["topkv-decode"], {**base, "prompt": prompt, "kv_transfer_params": load}
            )
            kv_bytes += answer["kv_transfer_params"]["topkv"]["kv_bytes"]
            ttft["topkv"].append(pre + dec)
            transfer["topkv"].append(dec)
            _, pre = _post(url["example-prefill"], {**base, "prompt": prompt})
            _, dec = _post(url["example-decode"], {**base, "prompt": prompt})
            ttft["example"].append(pre + dec)
            transfer["example"].append(dec)
            other = [rng.randrange(VOCAB_SIZE - 2) for _ in range(length)]  # not cached yet
            _, alone = _post(url["topkv-prefill"], {**base, "prompt": other})
            ttft["none"].append(alone)
    finally:
        supervisor.stop_all()

    def entry(name: str) -> dict[str, Any]:
        t = _pcts(ttft[name])
        out: dict[str, Any] = {"ttft_p50_ms": t["p50"], "ttft_p90_ms": t["p90"]}
        out["transfer_ms_p50"] = _pcts(transfer[name])["p50"] if name in transfer else 0.0
        return out

    connectors: dict[str, Any] = {name: entry(name) for name in ("topkv", "example", "none")}
    connectors["topkv"]["kv_bytes"] = kv_bytes
    connectors["nixl"] = None
    report = {
        "requests": len(lengths),
        "prompt_tokens": lengths,
        "connectors": connectors,
        "nixl_error": _nixl_error(),
        "ratios": {
            "topkv_vs_example_ttft_p50": connectors["topkv"]["ttft_p50_ms"]
            / connectors["example"]["ttft_p50_ms"],
            "topkv_vs_none_ttft_p50": connectors["topkv"]["ttft_p50_ms"]
            / connectors["none"]["ttft_p50_ms"],
        },
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{len(lengths)} requests, prompts of {min(lengths)}-{max(lengths)} tokens")
    for name in ("none", "topkv", "example"):
        e = connectors[name]
        print(f"  {name:8s} TTFT p50 {e['ttft_p50_ms']:7.1f} ms  p90 {e['ttft_p90_ms']:7.1f} ms"
              f"  transfer p50 {e['transfer_ms_p50']:6.1f} ms")  # fmt: skip
    print(f"  nixl     not run: {report['nixl_error']}")
    for key, value in report["ratios"].items():
        print(f"  {key}: {value:.2f}")


if __name__ == "__main__":
    main()
