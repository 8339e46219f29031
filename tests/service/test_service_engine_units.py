"""The worker's engine interface and streaming KV, without a model or processes."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from topkv.errors import ConfigError
from topkv.service.compute.engines import EngineRequestError, EngineSpec, SyntheticEngine
from topkv.service.kvstore import HeldKV, PrefillFailed, synthetic_kv
from topkv.service.messages import LayoutModel, PrefillRequest
from topkv.service.orchestrator.models import SubmitRequest
from topkv.transport.base import KVLayout

LAYOUT = KVLayout(3, 8, 2, 4)


def test_synthetic_engine_publishes_synthetic_kv_layer_by_layer() -> None:
    engine = SyntheticEngine()
    plan = engine.plan(7, PrefillRequest(model_id="m", layout=LayoutModel.of(LAYOUT)))
    kv = HeldKV.producing(7, plan.model_id, plan.layout)
    seen: list[int] = []
    kv.subscribe(lambda index, tensors, crcs: seen.append(index))
    assert engine.prefill(plan, kv.publish) is None
    kv.finish(None)
    assert seen == [0, 1, 2] and kv.complete
    assert kv.digest == synthetic_kv(7, "m", LAYOUT).digest
    with pytest.raises(EngineRequestError, match="--engine hf"):
        engine.plan(7, PrefillRequest(prompt=[1, 2, 3]))
    with pytest.raises(EngineRequestError, match="cannot decode"):
        engine.decode(kv, 1, 2)


def test_a_late_send_gets_the_published_layers_then_the_rest() -> None:
    kv = HeldKV.producing(1, "m", LAYOUT)
    layers = list(synthetic_kv(1, "m", LAYOUT).layers)
    kv.publish(0, layers[0], (0, 0))
    got: list[int] = []
    unsubscribe = kv.subscribe(lambda index, tensors, crcs: got.append(index))
    ended: list[bool] = []
    kv.when_ended(lambda: ended.append(kv.complete))
    assert got == [0] and kv.subscribers == 1 and not ended
    kv.publish(1, layers[1], (0, 0))
    unsubscribe()
    kv.publish(2, layers[2], (0, 0))
    kv.finish(42)
    assert got == [0, 1] and ended == [True] and kv.first_token == 42
    kv.check_whole()


def test_freeing_or_a_short_prefill_fails_the_kv() -> None:
    kv = HeldKV.producing(1, "m", LAYOUT)
    kv.free()
    with pytest.raises(PrefillFailed, match="released"):
        kv.publish(0, (memoryview(b""),), (0,))
    short = HeldKV.producing(2, "m", LAYOUT)
    short.finish(None)
    with pytest.raises(PrefillFailed, match="published 0 of 3 layers"):
        short.check_whole()
    with pytest.raises(PrefillFailed, match="expected 0"):
        HeldKV.producing(3, "m", LAYOUT).publish(1, (memoryview(b""),), (0,))


def test_prefill_and_submit_bodies_take_one_input() -> None:
    layout = LayoutModel.of(LAYOUT)
    with pytest.raises(ValidationError, match="not both"):
        PrefillRequest(prompt=[1], prompt_seed=1, prompt_tokens=1)
    with pytest.raises(ValidationError, match="needs 'prompt_tokens'"):
        PrefillRequest(prompt_seed=1)
    with pytest.raises(ValidationError, match="omit 'layout'"):
        PrefillRequest(prompt=[1], layout=layout)
    with pytest.raises(ValidationError, match="give 'model_id' and 'layout'"):
        PrefillRequest(model_id="m")
    assert SubmitRequest(model="m", prompt_seed=3, prompt_tokens=9, new_tokens=4).is_prompt
    with pytest.raises(ValidationError, match="layout comes from"):
        SubmitRequest(model="m", prompt=[1], layout=layout)
    with pytest.raises(ValidationError, match="'new_tokens' needs a prompt"):
        SubmitRequest(model="m", layout=layout, new_tokens=2)
    with pytest.raises(ValidationError, match="'prefill' true"):
        SubmitRequest(model="m", prompt=[1], prefill=False)


def test_engine_spec_needs_one_model_for_hf_and_none_for_synthetic() -> None:
    with pytest.raises(ConfigError, match="exactly one of --model-path"):
        EngineSpec(kind="hf")
    with pytest.raises(ConfigError, match="exactly one of --model-path"):
        EngineSpec(kind="hf", demo_seed=0, model_path=Path("x"))
    with pytest.raises(ConfigError, match="need --engine hf"):
        EngineSpec(demo_seed=0)
    assert EngineSpec(kind="hf", demo_seed=3, torch_threads=1).cli_args() == [
        "--engine", "hf", "--demo-model", "3", "--torch-threads", "1",
    ]  # fmt: skip
