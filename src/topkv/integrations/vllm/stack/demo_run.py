"""``topkv demo --engine vllm``: the demo's requests through real vLLM instances.

:func:`run_vllm_demo` starts the stack of :mod:`.instances` (a ``topkv orchestrator``, one
prefill and one decode vLLM CPU instance with TopKVConnector under the interpreter that has
vLLM, :func:`find_vllm_python`, and the front door on a thread of this process), streams the
demo's requests (:func:`topkv.demo.workload.load_requests`) through it at their arrival times,
then has the prefill instance compute every prompt alone: the reference for
``tokens_identical``. What it measures: docs/vllm.md ("The demo on vLLM").
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from topkv.demo.measure import Percentiles
from topkv.demo.report import JSON_REQUEST_KEYS
from topkv.demo.workload import DemoRequest, find_trace, load_requests
from topkv.engine.spec import prompt_token_ids
from topkv.errors import TopKVError
from topkv.integrations.vllm.frontdoor.router import RouterServer
from topkv.integrations.vllm.stack.instances import (
    StackFiles,
    start_orchestrator,
    start_pd_instances,
    wait_up,
)
from topkv.integrations.vllm.stack.model import VOCAB_SIZE
from topkv.service.cluster.local import Supervisor

#: The demo's prompt range (as the default demo's), and room for the generated tokens.
MIN_PROMPT, MAX_PROMPT = 128, 1024
#: The byte tokens (``<s>`` and ``</s>`` are left out of prompts).
PROMPT_VOCAB = VOCAB_SIZE - 2
_REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=300.0, sock_read=120.0)


class VllmNotInstalled(TopKVError):
    """No interpreter with vLLM was found."""


def find_vllm_python() -> str | None:
    """The interpreter with vLLM: ``$TOPKV_VLLM_PYTHON`` when set (None if it is not a
    file), else ``.venv-vllm`` here or at the source tree's root, else this one if it has
    vLLM; None when there is none."""
    explicit = os.environ.get("TOPKV_VLLM_PYTHON")
    if explicit:
        return str(Path(explicit).absolute()) if Path(explicit).is_file() else None
    candidates = [
        Path.cwd() / ".venv-vllm/bin/python",
        Path(__file__).resolve().parents[4] / ".venv-vllm/bin/python",
    ]
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate.absolute())
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


@dataclass(frozen=True)
class VllmDemoOptions:
    requests: int = 50
    seed: int = 0
    new_tokens: int = 8
    speedup: float = 1.5
    trace: Path | None = None
    trace_start: int = 0
    #: Where the model, tokens and logs go (default: a temporary directory, removed after).
    run_dir: Path | None = None


@dataclass
class _Answer:
    """One request as the client saw it."""

    token_ids: list[int] = field(default_factory=list)
    sent_s: float = 0.0
    first_token_s: float | None = None
    last_token_s: float | None = None
    medium: str | None = None
    kv_bytes: int | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None
    kv_verified: bool | None = None
    error: str | None = None


class _RouterThread:
    """The front door on its own event loop, in a daemon thread."""

    def __init__(self, files: StackFiles, registry_url: str = "", affinity: bool = True) -> None:
        self.server = RouterServer(
            files.front_door_auth(), str(files.run_dir), registry_url=registry_url,
            registry_token=files.admin_token, affinity=affinity,
        )  # fmt: skip
        self._loop = asyncio.new_event_loop()
        started: Future[str] = Future()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name="topkv-router", daemon=True
        )
        self._thread.start()
        self.url = started.result(30)

    def _run(self, started: Future[str]) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            started.set_result(self._loop.run_until_complete(self.server.serve()))
        except BaseException as exc:  # the caller waits on the future: hand it the failure
            started.set_exception(exc)
            return
        self._loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


def _write_model(python: str, directory: Path, seed: int) -> Path:
    """TopKV's tiny Llama, written by vLLM's interpreter (its transformers loads it)."""
    code = (
        "import sys, pathlib\n"
        "from topkv.integrations.vllm.stack.model import write_tiny_llama\n"
        "write_tiny_llama(pathlib.Path(sys.argv[1]), seed=int(sys.argv[2]))\n"
    )
    done = subprocess.run(
        [python, "-c", code, str(directory), str(seed)], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise TopKVError(f"writing the tiny Llama with {python} failed:\n{done.stderr[-2000:]}")
    return directory


def _header_int(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


async def _stream(
    session: aiohttp.ClientSession, url: str, token: str, prompt: list[int], new_tokens: int
) -> _Answer:
    body = {
        "model": "tiny-llama", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, "stream": True,
    }  # fmt: skip
    answer = _Answer(sent_s=time.perf_counter())
    try:
        async with session.post(
            url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {token}"}
        ) as response:
            if response.status != 200:
                answer.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return answer
            answer.medium = response.headers.get("X-TopKV-Medium")
            answer.kv_bytes = _header_int(response.headers.get("X-TopKV-KV-Bytes-Sent"))
            answer.prefill_worker = response.headers.get("X-TopKV-Prefill")
            answer.decode_worker = response.headers.get("X-TopKV-Decode")
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data:") :])
                topkv = (chunk.get("kv_transfer_params") or {}).get("topkv") or {}
                if isinstance(topkv.get("verified"), bool):
                    answer.kv_verified = topkv["verified"]
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    if ids:
                        now = time.perf_counter()
                        if answer.first_token_s is None:
                            answer.first_token_s = now
                        answer.last_token_s = now
                        answer.token_ids.extend(int(i) for i in ids)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        answer.error = f"{type(exc).__name__}: {exc}"
    return answer


async def _reference(
    session: aiohttp.ClientSession, url: str, prompt: list[int], new_tokens: int
) -> list[int]:
    """The prefill instance computing the whole request alone (no transfer)."""
    body = {
        "model": "tiny-llama", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            raise TopKVError(f"the reference run failed: HTTP {response.status}")
        answer = await response.json()
    return [int(i) for i in answer["choices"][0]["token_ids"]]


async def _replay(
    requests: list[DemoRequest],
    prompts: list[list[int]],
    router_url: str,
    reference_url: str,
    token: str,
    new_tokens: int,
) -> tuple[list[_Answer], list[list[int]]]:
    async with aiohttp.ClientSession(timeout=_REQUEST_TIMEOUT) as session:
        started = time.perf_counter()

        async def one(request: DemoRequest, prompt: list[int]) -> _Answer:
            await asyncio.sleep(max(0.0, started + request.arrival_s - time.perf_counter()))
            return await _stream(session, router_url, token, prompt, new_tokens)

        answers = await asyncio.gather(*(one(r, p) for r, p in zip(requests, prompts, strict=True)))
        # after the timed run, so the reference neither loads the instance nor warms its cache
        references = [await _reference(session, reference_url, p, new_tokens) for p in prompts]
    return list(answers), references


def _ms(seconds: float | None) -> float | None:
    return round(seconds * 1000, 3) if seconds is not None else None


def _request_json(
    request: DemoRequest, answer: _Answer, reference: list[int], new_tokens: int
) -> dict[str, Any]:
    first, last = answer.first_token_s, answer.last_token_s
    identical = (
        answer.error is None
        and len(answer.token_ids) == new_tokens
        and answer.token_ids == reference
    )
    measured: dict[str, Any] = {
        "id": request.rid,
        "transport": answer.medium,
        "bytes": answer.kv_bytes,
        "ttft_ms": _ms(first - answer.sent_s if first is not None else None),
        "tokens_identical": identical,
        "emulated": False,  # real processes, a real medium: nothing is emulated
        "arrival_ms": round(request.arrival_s * 1000, 3),
        "prompt_len": request.prompt_len,
        "prefill_worker": answer.prefill_worker,
        "decode_worker": answer.decode_worker,
        "decode_ms": _ms(last - first if first is not None and last is not None else None),
    }
    # the default demo's keys, in its order; what this path does not measure is null
    out = {key: measured.get(key) for key in JSON_REQUEST_KEYS}
    out["kv_verified"] = answer.kv_verified  # the decode's report, in the stream's last chunk
    out["error"] = answer.error
    return out


def _summary(results: list[dict[str, Any]], wall_s: float, vllm_python: str) -> dict[str, Any]:
    identical = sum(1 for r in results if r["tokens_identical"])
    transports: dict[str, int] = {}
    for r in results:
        transports[r["transport"] or "none"] = transports.get(r["transport"] or "none", 0) + 1
    ttft = [r["ttft_ms"] for r in results if r["ttft_ms"] is not None]
    return {
        "engine": "vllm",
        "model": "topkv tiny-llama (4 layers, hidden 256, float32; vLLM CPU)",
        "vllm_python": vllm_python,
        "requests": len(results),
        "completed": sum(1 for r in results if r["error"] is None),
        "tokens_identical": identical,
        "all_tokens_identical": identical == len(results) and len(results) > 0,
        "failed": [{"id": r["id"], "error": r["error"]} for r in results if r["error"]],
        "transports": transports,
        "kv_bytes": sum(r["bytes"] or 0 for r in results),
        "kv_verified": sum(1 for r in results if r["kv_verified"]),
        "ttft_ms": Percentiles.of(ttft).as_dict() if ttft else None,
        "wall_s": round(wall_s, 3),
    }


@contextmanager
def _run_dir(explicit: Path | None) -> Iterator[Path]:
    if explicit is not None:
        explicit.mkdir(parents=True, exist_ok=True)
        yield explicit
        return
    with tempfile.TemporaryDirectory(prefix="topkv-vllm-demo-") as directory:
        yield Path(directory)


def run_vllm_demo(options: VllmDemoOptions) -> dict[str, Any]:
    """Run the demo's requests through the vLLM stack; the demo's JSON payload."""
    python = find_vllm_python()
    if python is None:
        raise VllmNotInstalled(
            "topkv demo --engine vllm needs vLLM: run scripts/install-vllm.sh (it creates "
            ".venv-vllm), or set TOPKV_VLLM_PYTHON to an interpreter that has vLLM"
        )
    requests = load_requests(
        find_trace(options.trace), options.requests, seed=options.seed,
        min_tokens=MIN_PROMPT, max_tokens=MAX_PROMPT, speedup=options.speedup,
        start=options.trace_start,
    )  # fmt: skip
    prompts = [prompt_token_ids(r.prompt_len, r.prompt_seed, PROMPT_VOCAB) for r in requests]
    max_model_len = -(-(MAX_PROMPT + options.new_tokens) // 32) * 32  # whole 32-token blocks
    started = time.perf_counter()
    with _run_dir(options.run_dir) as root:
        model = _write_model(python, root / "model", options.seed)
        files = StackFiles.create(root)
        router: _RouterThread | None = None
        try:
            with Supervisor(root / "logs", grace_s=20) as supervisor:
                _, registry = start_orchestrator(supervisor, files)
                router = _RouterThread(files, registry)
                instances = start_pd_instances(
                    supervisor, model, files, registry, python=python,
                    max_model_len=max_model_len, load_timeout_s=20,
                )  # fmt: skip
                wait_up(instances, router.server.registry, timeout_s=420)
                run_started = time.perf_counter()
                answers, references = asyncio.run(
                    _replay(
                        requests,
                        prompts,
                        router.url,
                        instances[0].url,
                        files.client_token,
                        options.new_tokens,
                    )
                )
                wall_s = time.perf_counter() - run_started
        finally:
            if router is not None:
                router.close()
    results = [
        _request_json(r, a, ref, options.new_tokens)
        for r, a, ref in zip(requests, answers, references, strict=True)
    ]
    summary = _summary(results, wall_s, python)
    summary["stack_s"] = round(time.perf_counter() - started, 3)
    return {
        "requests": results,
        "summary": summary,
        "options": {
            "requests": options.requests, "seed": options.seed, "speedup": options.speedup,
            "dilation": None, "new_tokens": options.new_tokens, "engine": "vllm",
        },
    }  # fmt: skip
