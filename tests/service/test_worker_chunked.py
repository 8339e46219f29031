"""Chunked prefill on a converted decode worker (ADP): a real model worker turned prefill
with ``POST /v1/role`` runs the prompt through its model in ``chunk_tokens`` chunks (counted
on the model's own forward calls), and the KV it produces matches the one-pass prefill of
the same prompt on a native prefill worker, with the same first token; converted back, it
prefills in one pass again."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from topkv.harness.inprocess_cluster import InProcessCluster, WorkerSpec
from topkv.relay.registry.memory import MemoryRegistry
from topkv.service.compute.engines import EngineSpec, HfEngine
from topkv.service.kvstore import HeldKV
from topkv.service.messages import PrefillRequest
from topkv.service.orchestrator.executor import RemoteExecutor

pytest.importorskip("torch")
pytest.importorskip("transformers")

from topkv.engine import DemoModelConfig

pytestmark = pytest.mark.model

SMALL = DemoModelConfig(layers=4, hidden_size=64, heads=4, kv_heads=2, head_dim=16,
                        intermediate_size=128, vocab_size=512, init_std=0.25)  # fmt: skip
ENGINE = EngineSpec(kind="hf", demo_seed=5, demo_config=SMALL, torch_threads=1)
PROMPT_TOKENS = 40
CHUNK = 8


def _arrays(kv: HeldKV) -> list[np.ndarray]:
    assert kv.layout.dtype == "fp32"
    return [np.frombuffer(t, dtype=np.float32) for layer in kv.layers for t in layer]


def test_a_converted_decode_worker_prefills_in_chunks_with_the_same_kv() -> None:
    async def main() -> None:
        async with InProcessCluster(MemoryRegistry()) as cluster:
            executor = RemoteExecutor(token=cluster.admin_token)
            try:
                await cluster.start(
                    [
                        WorkerSpec("prefill", "n0", 0, worker_id="p0", engine=ENGINE),
                        WorkerSpec("decode", "n0", 1, worker_id="d0", engine=ENGINE),
                    ]
                )
                calls = {"p0": 0, "d0": 0}
                for wid in calls:
                    engine = cluster.workers[wid].engine
                    assert isinstance(engine, HfEngine)

                    def count(*_: object, wid: str = wid) -> None:
                        calls[wid] += 1

                    engine.loaded.model.register_forward_pre_hook(count)
                d0 = cluster.info("d0")
                await executor.set_role(d0, "prefill", chunk_tokens=CHUNK, reserved_slots=0)
                body = PrefillRequest(prompt_seed=3, prompt_tokens=PROMPT_TOKENS)
                one = await executor.prefill(cluster.info("p0"), 1, body)
                chunked = await executor.prefill(d0, 2, body)
                assert calls == {"p0": 1, "d0": math.ceil(PROMPT_TOKENS / CHUNK)}
                assert chunked.first_token == one.first_token
                ref = cluster.workers["p0"].store.get(1)
                got = cluster.workers["d0"].store.get(2)
                assert got.layout == ref.layout
                for a, b in zip(_arrays(got), _arrays(ref), strict=True):
                    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
                # converted back (its prefilled KV released first): one pass again
                await executor.release_source(d0, 2)
                await executor.set_role(d0, "decode", chunk_tokens=CHUNK, reserved_slots=0)
                await executor.prefill(d0, 3, body)
                assert calls["d0"] == math.ceil(PROMPT_TOKENS / CHUNK) + 1
            finally:
                await executor.close()

    asyncio.run(main())
