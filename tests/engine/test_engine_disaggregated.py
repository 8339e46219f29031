"""Prefill publishes per-layer K/V; decode from those bytes matches single-process generation."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch
from transformers import DynamicCache

from topkv.engine import (
    DecodeRunner,
    DemoModelConfig,
    KVLayoutError,
    LoadedModel,
    PrefillRunner,
    arrays_from_bytes,
    build_demo_model,
    kv_model_spec,
    layer_nbytes,
    layer_to_numpy,
    prompt_token_ids,
    reference_generate,
)

pytestmark = pytest.mark.model

SEED = 11
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def demo() -> LoadedModel:
    return build_demo_model(DemoModelConfig(), seed=SEED)


def prefill_through_bytes(
    loaded: LoadedModel, ids: list[int]
) -> tuple[int, list[tuple[np.ndarray, np.ndarray]]]:
    """Prefill, then copy every published layer through raw bytes (a transport stand-in)."""
    spec = kv_model_spec(loaded)
    received: list[tuple[np.ndarray, np.ndarray]] = []

    def on_layer(index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        assert index == len(received)
        k_np, v_np = layer_to_numpy(k, v)
        received.append(arrays_from_bytes(spec, len(ids), k_np.tobytes(), v_np.tobytes()))

    result = PrefillRunner(loaded).run(ids, on_layer)
    return result.first_token, received


@pytest.mark.parametrize(("length", "prompt_seed"), [(1, 0), (7, 1), (64, 2), (200, 3), (333, 4)])
def test_disaggregated_tokens_equal_reference(
    demo: LoadedModel, length: int, prompt_seed: int
) -> None:
    ids = prompt_token_ids(length, prompt_seed, demo.config.vocab_size)
    first_token, layers = prefill_through_bytes(demo, ids)
    tokens = DecodeRunner(demo).generate(layers, first_token, length, NEW_TOKENS)
    reference = reference_generate(demo, ids, NEW_TOKENS)
    assert tokens == reference
    assert len(tokens) == NEW_TOKENS


def test_reference_matches_transformers_generate(demo: LoadedModel) -> None:
    ids = prompt_token_ids(50, 9, demo.config.vocab_size)
    model: Any = demo.model
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
    )
    assert reference_generate(demo, ids, NEW_TOKENS) == out[0, len(ids) :].tolist()


def test_outputs_depend_on_the_prompt_and_on_the_received_kv(demo: LoadedModel) -> None:
    """Guards against a degenerate model that would make the identity check meaningless."""
    outputs = [
        reference_generate(demo, prompt_token_ids(40, s, 4096), NEW_TOKENS) for s in range(3)
    ]
    assert len({tuple(o) for o in outputs}) == 3
    assert all(len(set(o)) > NEW_TOKENS // 2 for o in outputs)
    ids = prompt_token_ids(40, 0, 4096)
    first_token, layers = prefill_through_bytes(demo, ids)
    k0, v0 = layers[0]
    layers[0] = (np.zeros_like(k0), v0)  # a corrupted layer must change the output
    assert DecodeRunner(demo).generate(layers, first_token, 40, NEW_TOKENS) != outputs[0]


def test_layers_arrive_in_order_once_each_before_return_in_one_forward(demo: LoadedModel) -> None:
    spec = kv_model_spec(demo)
    ids = prompt_token_ids(96, 5, demo.config.vocab_size)
    events: list[tuple[str, int]] = []
    forward_calls = 0

    def count_forward(*_: Any) -> None:
        nonlocal forward_calls
        forward_calls += 1

    def on_layer(index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        events.append(("layer", index))
        assert k.shape == v.shape == (96, spec["kv_heads"], spec["head_dim"])
        assert k.dtype == v.dtype == torch.float32
        assert k.is_contiguous() and v.is_contiguous()
        assert k.numel() * 4 * 2 == layer_nbytes(spec, 96)

    layer_calls: list[int] = []
    handles = [demo.model.register_forward_hook(count_forward)]
    for i, layer in enumerate(demo.decoder_layers):
        handles.append(layer.register_forward_pre_hook(lambda *_, i=i: layer_calls.append(i)))
        # a layer's pre-hook must come after the previous layer's publication
        handles.append(layer.register_forward_pre_hook(lambda *_, i=i: events.append(("start", i))))
    try:
        result = PrefillRunner(demo).run(ids, on_layer)
        events.append(("returned", -1))
    finally:
        for handle in handles:
            handle.remove()

    n = spec["layers"]
    assert forward_calls == 1
    assert layer_calls == list(range(n))
    expected = [e for i in range(n) for e in (("start", i), ("layer", i))] + [("returned", -1)]
    assert events == expected
    assert [t.layer for t in result.layers] == list(range(n))
    for before, after in zip(result.layers, result.layers[1:], strict=False):
        assert before.start_s < before.end_s <= before.published_s <= after.start_s
    assert result.forward_start_s <= result.layers[0].start_s
    assert result.layers[-1].published_s <= result.forward_end_s
    assert all(t > 0 for t in result.layer_compute_s)
    assert 0 < result.compute_s <= result.total_s
    assert result.prompt_len == 96


def test_published_kv_is_the_models_own_cache_in_wire_layout(demo: LoadedModel) -> None:
    ids = prompt_token_ids(33, 6, demo.config.vocab_size)
    published: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    PrefillRunner(demo).run(ids, lambda i, k, v: published.__setitem__(i, (k, v)))
    cache = DynamicCache(config=demo.config)
    with torch.inference_mode():
        demo.model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    for i, (k, v) in published.items():
        layer: Any = cache.layers[i]
        hf_k, hf_v = layer.keys, layer.values
        assert hf_k is not None and hf_v is not None
        for s in (0, 17, 32):
            for h in range(k.shape[1]):
                assert torch.equal(k[s, h], hf_k[0, h, s])
                assert torch.equal(v[s, h], hf_v[0, h, s])


def test_decode_rejects_mismatched_layers(demo: LoadedModel) -> None:
    ids = prompt_token_ids(12, 7, demo.config.vocab_size)
    first_token, layers = prefill_through_bytes(demo, ids)
    runner = DecodeRunner(demo)
    with pytest.raises(KVLayoutError, match="received 11 layers"):
        runner.generate(layers[:-1], first_token, 12, 3)
    with pytest.raises(KVLayoutError, match=r"layer 0 K has shape \(12, 2, 64\), expected \(13"):
        runner.generate(layers, first_token, 13, 3)
    bad = [(k.astype(np.float64), v) for k, v in layers]
    with pytest.raises(KVLayoutError, match="dtype float64"):
        runner.generate(bad, first_token, 12, 3)
    with pytest.raises(KVLayoutError, match="max_new_tokens"):
        runner.generate(layers, first_token, 12, 0)
    with pytest.raises(KVLayoutError, match="first_token"):
        runner.generate(layers, 4096, 12, 3)


def test_prefill_rejects_out_of_vocabulary_ids(demo: LoadedModel) -> None:
    with pytest.raises(KVLayoutError, match=r"\[0, 4096\)"):
        PrefillRunner(demo).run([1, 2, 4096], lambda *_: None)
    with pytest.raises(KVLayoutError, match="non-empty"):
        PrefillRunner(demo).run([], lambda *_: None)
