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

``--affinity [--rounds R]`` measures something else instead: TTFT of repeated-prefix
requests through the front door with the picker's prefix affinity on and off, over the
same two prefill and one decode instances (:mod:`topkv.integrations.vllm.stack.affinity_bench`);
its JSON is ``{"affinity": {...}, "no_affinity": {...}, "ttft_p50_ratio",
"ttft_mean_ratio", "prefill_mean_ratio", ...}``.
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


def _nixl_missing() -> str | None:
    """Why vLLM's NixlConnector cannot run here (None: it can)."""
    try:
        import nixl._api  # noqa: F401
    except ImportError as exc:
        return (
            f"NIXL is not importable in this environment ({exc}); vLLM's NixlConnector "
            "needs `pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1` in .venv-vllm"
        )
    return None


#: vLLM's NixlConnector on the CPU: KV staged in host memory, UCX over tcp/shm.
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
#: Its instances' environment: UCX and the side channel on loopback, as TopKVConnector keeps
#: its own NIXL/UCX on an instance serving on 127.0.0.1 (media.arena_options).
NIXL_ENV = {"UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}  # fmt: skip
#: Seconds every instance gets to become healthy, counted from their common start (they
#: start together and share the cores: on a loaded 2-core host that takes minutes).
START_TIMEOUT_S = 900.0
NIXL_PREFILL_PARAMS = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--affinity", action="store_true", help="prefix affinity on vs off")
    parser.add_argument("--rounds", type=int, default=8, help="--affinity: rounds")
    args = parser.parse_args()
    _need_vllm()
    if args.affinity:
        _affinity(args.json, args.rounds)
        return
    from topkv.integrations.vllm.stack.launch import (
        VllmStartError,
        kv_transfer_config,
        start_vllm,
        stop_instances,
        wait_healthy,
    )
    from topkv.integrations.vllm.stack.model import VOCAB_SIZE, write_tiny_llama
    from topkv.service.cluster.local import Supervisor

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
    nixl_error = _nixl_missing()
    envs: dict[str, dict[str, str]] = {}
    if nixl_error is None:
        for name in ("nixl-prefill", "nixl-decode"):
            configs[name] = NIXL
            envs[name] = {**NIXL_ENV, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(_port())}
    supervisor = Supervisor(root / "logs", grace_s=20)
    instances = {
        name: start_vllm(
            supervisor, name, model, _port(), cpu=str(i % 2), kv_config=config,
            env=envs.get(name),
        )
        for i, (name, config) in enumerate(configs.items())
    }  # fmt: skip
    started = time.monotonic()
    try:
        nixl_names = [name for name in instances if name.startswith("nixl")]
        others = [i for n, i in instances.items() if n not in nixl_names]
        wait_healthy(others, timeout_s=START_TIMEOUT_S)
        try:  # never less than 120 s more than the others took
            left = max(START_TIMEOUT_S - (time.monotonic() - started), 120.0)
            wait_healthy([instances[n] for n in nixl_names], timeout_s=left)
        except VllmStartError as exc:
            nixl_error = f"NixlConnector instances did not start: {str(exc)[-4000:]}"
        rng = random.Random(0)
        lengths = [rng.randrange(100, 901) for _ in range(args.requests)]
        ttft: dict[str, list[float]] = {"topkv": [], "example": [], "nixl": [], "none": []}
        transfer: dict[str, list[float]] = {"topkv": [], "example": [], "nixl": []}
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
            if nixl_error is None:
                try:
                    first, pre = _post(
                        url["nixl-prefill"],
                        {**base, "prompt": prompt, "kv_transfer_params": NIXL_PREFILL_PARAMS},
                    )
                    params = first["kv_transfer_params"]
                    _, dec = _post(
                        url["nixl-decode"], {**base, "prompt": prompt, "kv_transfer_params": params}
                    )
                    ttft["nixl"].append(pre + dec)
                    transfer["nixl"].append(dec)
                except Exception as exc:  # report why, keep the other setups' figures
                    logs = "".join(
                        f"\n--- {n}'s log ends:\n{instances[n].log_lines()}" for n in nixl_names
                    )
                    nixl_error = f"NixlConnector request failed: {exc!r}{logs}"
            other = [rng.randrange(VOCAB_SIZE - 2) for _ in range(length)]  # not cached yet
            _, alone = _post(url["topkv-prefill"], {**base, "prompt": other})
            ttft["none"].append(alone)
    finally:
        stop_instances(supervisor, list(instances.values()))

    def entry(name: str) -> dict[str, Any]:
        t = _pcts(ttft[name])
        out: dict[str, Any] = {"ttft_p50_ms": t["p50"], "ttft_p90_ms": t["p90"]}
        out["transfer_ms_p50"] = _pcts(transfer[name])["p50"] if name in transfer else 0.0
        return out

    connectors: dict[str, Any] = {name: entry(name) for name in ("topkv", "example", "none")}
    connectors["topkv"]["kv_bytes"] = kv_bytes
    nixl_ok = nixl_error is None and len(ttft["nixl"]) == len(lengths)
    connectors["nixl"] = entry("nixl") if nixl_ok else None
    p50 = {name: entry["ttft_p50_ms"] for name, entry in connectors.items() if entry}
    report: dict[str, Any] = {
        "requests": len(lengths),
        "prompt_tokens": lengths,
        "connectors": connectors,
        "ratios": {
            f"topkv_vs_{name}_ttft_p50": p50["topkv"] / p50[name] for name in p50 if name != "topkv"
        },
    }
    if not nixl_ok:
        report["nixl_error"] = nixl_error or "NixlConnector did not answer every request"
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{len(lengths)} requests, prompts of {min(lengths)}-{max(lengths)} tokens")
    for name in ("none", "topkv", "example", "nixl"):
        e = connectors[name]
        if e is None:
            print(f"  {name:8s} not run: {report['nixl_error']}")
            continue
        print(f"  {name:8s} TTFT p50 {e['ttft_p50_ms']:7.1f} ms  p90 {e['ttft_p90_ms']:7.1f} ms"
              f"  transfer p50 {e['transfer_ms_p50']:6.1f} ms")  # fmt: skip
    for key, value in report["ratios"].items():
        print(f"  {key}: {value:.2f}")


def _affinity(as_json: bool, rounds: int) -> None:
    from topkv.integrations.vllm.stack.affinity_bench import (
        AffinityBenchOptions,
        run_affinity_bench,
    )

    root = Path(tempfile.mkdtemp(prefix="topkv-vllm-affinity-"))
    report = run_affinity_bench(sys.executable, root, AffinityBenchOptions(rounds=rounds))
    if as_json:
        print(json.dumps(report, indent=1))
        return
    for name in ("affinity", "no_affinity"):
        e = report[name]
        print(f"  {name:12s} TTFT p50 {e['ttft_p50_ms']:7.1f} ms  p90 {e['ttft_p90_ms']:7.1f} ms"
              f"  mean {e['ttft_mean_ms']:7.1f} ms  prefill mean {e['prefill_ms_mean']} ms"
              f"  same prefill {e['prefix_on_the_same_prefill']}/{e['requests']}")  # fmt: skip
    for key in ("ttft_p50_ratio", "ttft_mean_ratio", "prefill_mean_ratio"):
        print(f"  {key} (affinity / none): {report[key]}")


if __name__ == "__main__":
    main()
