"""A worker that hosts a model: prefill streams per-layer KV, the decode worker generates.

The same :class:`~topkv.service.worker.service.WorkerService` runs in this process (a prefill and a
decode worker beside an in-process orchestrator) and as ``topkv worker`` processes
(``topkv cluster up --engine hf``); in both, the tokens the decode worker generates from the
KV it received equal the single-process reference generation of the same model.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from topkv.jsonout import loads_strict
from topkv.relay.workers import WorkerCapabilities
from topkv.service.cluster.tokens import ClusterTokens
from topkv.service.compute.engines import EngineSpec, PrefillPlan, Publish
from topkv.service.http.auth import Credentials, ServerAuth, auth_headers
from topkv.service.orchestrator.api import OrchestratorServiceConfig, serve_orchestrator
from topkv.service.worker.service import WorkerConfig, WorkerFaults, WorkerService

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from topkv.engine import (  # noqa: E402
    DemoModelConfig,
    build_demo_model,
    prompt_token_ids,
    reference_generate,
)

pytestmark = pytest.mark.model

TOPKV = [sys.executable, "-c", "from topkv.cli.main import app; app()"]
# Small enough to build in a blink; init_std 0.25 keeps its greedy output varied.
SMALL = DemoModelConfig(layers=6, hidden_size=64, heads=4, kv_heads=2, head_dim=16,
                        intermediate_size=128, vocab_size=512, init_std=0.25)  # fmt: skip
SEED = 5
NEW_TOKENS = 6
TOKENS = ClusterTokens()
PROMPTS = [(1, 3), (17, 4), (90, 5)]  # (length, prompt seed)


class _SlowLayers:
    """The worker's engine with each layer held back a little, recording whether a send was
    already waiting for it: a layer published to a waiting send goes straight from the
    forward-pass hook to the transport."""

    def __init__(self, service: WorkerService, delay_s: float) -> None:
        self.service = service
        self.inner = service.engine
        self.delay_s = delay_s
        self.waiting_sends: dict[int, list[int]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def prefill(self, plan: PrefillPlan, publish: Publish) -> int | None:
        seen = self.waiting_sends.setdefault(plan.request_id, [])

        def slow(index: int, tensors: tuple[memoryview, ...], crcs: tuple[int, ...]) -> None:
            time.sleep(self.delay_s)
            seen.append(self.service.store.get(plan.request_id).subscribers)
            publish(index, tensors, crcs)

        assert self.inner is not None
        return self.inner.prefill(plan, slow)


async def _refusals(
    http: aiohttp.ClientSession, url: str, workers: list[WorkerService]
) -> dict[str, tuple[int, str]]:
    """What the model-serving workers answer to requests they cannot serve."""
    prefill = workers[0].info
    decode = workers[1].info
    assert prefill is not None and decode is not None
    layout = {"num_layers": 6, "seq_len": 4, "kv_heads": 2, "head_dim": 16, "dtype": "fp32"}
    asks = {
        "layout to a model": (f"{url}/v1/requests", {"model": "m", "layout": layout}),
        "another model": (
            f"{url}/v1/requests",
            {"model": "other-model", "prompt_seed": 1, "prompt_tokens": 4},
        ),
        "token out of vocab": (
            f"{prefill.control_url}/v1/kv/77/prefill",
            {"prompt": [SMALL.vocab_size]},
        ),
        "decode without first token": (
            f"{decode.control_url}/v1/kv/1/decode",
            {"max_new_tokens": 2},
        ),
    }
    answers = {}
    for what, (target, body) in asks.items():
        async with http.post(target, json=body) as answer:
            payload = await answer.json()
            answers[what] = (answer.status, payload["error"]["detail"])
    return answers


async def _run_inprocess(
    tmp: Path,
) -> tuple[list[dict[str, Any]], dict[int, list[int]], str, dict[str, tuple[int, str]]]:
    stop = asyncio.Event()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    orchestrator = asyncio.create_task(
        serve_orchestrator(
            OrchestratorServiceConfig(auth=TOKENS.orchestrator_auth(["prefill", "decode"])),
            "127.0.0.1",
            0,
            stop,
            ready,
        )
    )
    url = await ready
    engine = EngineSpec(kind="hf", demo_seed=SEED, demo_config=SMALL)
    workers = [
        WorkerService(
            WorkerConfig(
                role=role,
                node="n0",
                secret=b"engine-test-secret",
                gpus=(gpu,),
                host_id="h0",
                orchestrator_url=url,
                ttl_s=5.0,
                capabilities=WorkerCapabilities(),
                faults=WorkerFaults(),
                engine=engine,
                media=("tcp", "shm"),
                auth=ServerAuth(
                    Credentials.of(admin=[TOKENS.admin]), client_token=TOKENS.worker_token(role)
                ),
            )
        )
        for gpu, role in enumerate(("prefill", "decode"))
    ]
    try:
        for worker in workers:
            await worker.start()
        slow = _SlowLayers(workers[0], 0.02)
        workers[0].engine = slow  # type: ignore[assignment]
        records = []
        async with aiohttp.ClientSession(headers=auth_headers(TOKENS.admin)) as http:
            for rid, (length, prompt_seed) in enumerate(PROMPTS, start=1):
                body = {"request_id": rid, "model": "", "prompt_seed": prompt_seed,
                        "prompt_tokens": length, "new_tokens": NEW_TOKENS}  # fmt: skip
                body["model"] = workers[0].engine.model_id
                async with http.post(f"{url}/v1/requests", json=body) as answer:
                    assert answer.status == 202, await answer.text()
            for rid in range(1, len(PROMPTS) + 1):
                for _ in range(600):
                    async with http.get(f"{url}/v1/requests/{rid}") as answer:
                        record = await answer.json()
                    if record["state"] in ("failed", "cancelled") or record["decode_check"]:
                        break
                    await asyncio.sleep(0.02)
                records.append(record)
            refusals = await _refusals(http, url, workers)
        return records, slow.waiting_sends, slow.model_id, refusals
    finally:
        for worker in reversed(workers):
            await worker.stop()
        stop.set()
        await orchestrator


def test_inprocess_hf_workers_stream_prefill_and_decode_token_identical(tmp_path: Path) -> None:
    records, waiting_sends, model_id, refusals = asyncio.run(_run_inprocess(tmp_path))
    loaded = build_demo_model(SMALL, SEED)
    assert model_id == loaded.model_id
    for record, (length, prompt_seed) in zip(records, PROMPTS, strict=True):
        assert record["state"] == "delivered", record
        check = record["decode_check"]
        assert check["matches_source"], check
        ids = prompt_token_ids(length, prompt_seed, SMALL.vocab_size)
        expected = reference_generate(loaded, ids, NEW_TOKENS)
        assert len(set(expected)) > 2, "the model's output must vary for identity to mean much"
        assert check["tokens"] == expected
        assert record["layers"] == SMALL.layers and record["medium"] == "shm"
        # The send subscribed while prefill was running: the last layers went from the
        # forward-pass hook straight to the transport.
        assert waiting_sends[record["request_id"]][-1] >= 1, waiting_sends
    assert refusals["layout to a model"][0] == 400
    assert "give a prompt" in refusals["layout to a model"][1]
    assert refusals["another model"][0] == 400 and model_id in refusals["another model"][1]
    assert refusals["token out of vocab"] == (
        400,
        f"token ids must be in [0, {SMALL.vocab_size}), got range "
        f"[{SMALL.vocab_size}, {SMALL.vocab_size}]",
    )
    # the delivered KV was freed by the decode stand-in: nothing to decode from
    assert refusals["decode without first token"][0] == 404


def test_cluster_up_hf_workers_decode_streamed_kv_token_identical(tmp_path: Path) -> None:
    """Real ``topkv worker --engine hf --model-path DIR`` processes under ``cluster up``."""
    loaded = build_demo_model(SMALL, SEED)
    model_dir = tmp_path / "tiny-llama"
    loaded.model.save_pretrained(model_dir)
    tokens = 40
    done = subprocess.run(
        [*TOPKV, "cluster", "up", "--prefill", "1", "--decode", "1", "--port", "0",
         "--engine", "hf", "--model-path", str(model_dir), "--media", "tcp",
         "--smoke", "3", "--smoke-tokens", str(tokens), "--json",
         "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    report = loads_strict(done.stdout)
    engines = {w["role"]: w["engine"] for w in report["cluster"]["workers"]}
    assert engines["prefill"]["model_id"] == engines["decode"]["model_id"] == "tiny-llama"
    assert {tuple(w["media"]) for w in report["cluster"]["workers"]} == {("tcp",)}
    assert len(report["results"]) == 3
    for result in report["results"]:
        assert result["verified"] and result["transport"] == "tcp", result
        ids = prompt_token_ids(tokens, result["request_id"], SMALL.vocab_size)
        assert result["tokens"] == reference_generate(loaded, ids, 4)
