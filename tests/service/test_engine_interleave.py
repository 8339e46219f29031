"""Decode steps between a converted worker's prefill chunks (ADP, chunked prefill).

A real model engine: while a chunked prefill runs, a decode of a sequence the worker kept
asks for the model; it gets one step between each two chunks (the engine's turns), so it
ends long before the prompt does, and neither the prefill's KV and first token nor the
decode's tokens change. Without the turns the decode waited for the whole prompt.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np
import pytest

from topkv.service.compute.engines import ENGINE_THREADS, EngineSpec, EngineTurns, HfEngine
from topkv.service.kvstore import HeldKV
from topkv.service.messages import PrefillRequest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from topkv.engine import DemoModelConfig

pytestmark = pytest.mark.model

SMALL = DemoModelConfig(layers=4, hidden_size=64, heads=4, kv_heads=2, head_dim=16,
                        intermediate_size=128, vocab_size=512, init_std=0.25)  # fmt: skip
PROMPT, CHUNK, NEW_TOKENS = 40, 4, 6


def _prefilled(engine: HfEngine, request_id: int, chunk: int | None = None) -> HeldKV:
    plan = engine.plan(request_id, PrefillRequest(prompt_seed=request_id, prompt_tokens=PROMPT))
    if chunk is not None:
        plan = dataclasses.replace(plan, chunk_tokens=chunk)
    kv = HeldKV.producing(request_id, plan.model_id, plan.layout)
    kv.finish(engine.prefill(plan, kv.publish))
    return kv


def _arrays(kv: HeldKV) -> list[np.ndarray]:
    return [np.frombuffer(t, dtype=np.float32) for layer in kv.layers for t in layer]


def test_a_kept_decode_steps_between_the_chunks_of_a_prefill() -> None:
    engine = HfEngine.build(EngineSpec(kind="hf", demo_seed=5, demo_config=SMALL))
    assert engine.threads == ENGINE_THREADS > 1  # the worker runs calls side by side
    kept = _prefilled(engine, 1)
    assert kept.first_token is not None
    alone = engine.decode(kept, kept.first_token, NEW_TOKENS)
    one_pass = _prefilled(engine, 2)

    passes: list[str] = []
    decoded: list[list[int]] = []
    decoder = threading.Thread(
        target=lambda: decoded.append(engine.decode(kept, kept.first_token or 0, NEW_TOKENS))
    )

    def log(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        width = int(kwargs["input_ids"].shape[1])
        passes.append("d" if width == 1 else "p")
        if len(passes) == 1:  # the first chunk runs: the kept decode asks for the model
            decoder.start()
            while engine.turns.waiting("decode") == 0:
                threading.Event().wait(0.001)

    handle = engine.loaded.model.register_forward_pre_hook(log, with_kwargs=True)
    try:
        chunked = _prefilled(engine, 2, chunk=CHUNK)
        decoder.join(10.0)
    finally:
        handle.remove()
    chunks = PROMPT // CHUNK
    steps = NEW_TOKENS - 1
    # one decode step after each chunk until the decode is done; then the rest of the chunks
    assert "".join(passes) == "pd" * steps + "p" * (chunks - steps)
    assert decoded == [alone]
    assert chunked.first_token == one_pass.first_token
    for a, b in zip(_arrays(chunked), _arrays(one_pass), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_turns_go_in_order_and_a_holder_yields_only_to_the_kind_it_names() -> None:
    turns = EngineTurns()
    order: list[str] = []
    started = threading.Event()

    def decode() -> None:
        turns.begin()
        with turns.turn("decode"):
            started.set()
            order.append("d1")
            while turns.waiting("generate") == 0:  # a generate waits: no yield to it
                threading.Event().wait(0.001)
            turns.yield_to("prefill", "decode")
            order.append("d2")
            while turns.waiting("prefill") == 0:
                threading.Event().wait(0.001)
            turns.yield_to("prefill", "decode")  # the prefill, and the generate ahead of it
            order.append("d3")
        assert turns.started_s() is not None

    def other(kind: str) -> None:
        with turns.turn(kind):
            order.append(kind)

    d = threading.Thread(target=decode)
    d.start()
    started.wait(5)
    g = threading.Thread(target=other, args=("generate",))
    g.start()
    while turns.waiting("generate") == 0:
        threading.Event().wait(0.001)
    p = threading.Thread(target=other, args=("prefill",))
    while turns.waiting("prefill") == 0 and order[-1:] != ["d2"]:
        threading.Event().wait(0.001)
    p.start()
    for t in (d, g, p):
        t.join(5)
    assert order == ["d1", "d2", "generate", "prefill", "d3"]
