"""load_model: a local Hugging Face directory in, the same weights and tokens out; clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch

from tiny_models import tiny
from topkv.engine import (
    DecodeRunner,
    DemoModelConfig,
    PrefillRunner,
    UnsupportedModelError,
    build_demo_model,
    kv_model_spec,
    load_model,
    prompt_token_ids,
    reference_generate,
    state_dict_digest,
)

pytestmark = pytest.mark.model

TINY = tiny(layers=3, max_position_embeddings=DemoModelConfig().max_position_embeddings)


def test_saved_model_loads_with_same_weights_spec_and_tokens(tmp_path: Path) -> None:
    built = build_demo_model(TINY, seed=5)
    built.model.save_pretrained(tmp_path / "tiny-llama")
    loaded = load_model(tmp_path / "tiny-llama")
    assert state_dict_digest(loaded) == state_dict_digest(built)
    assert loaded.model_id == "tiny-llama"
    spec = kv_model_spec(loaded)
    assert (spec["layers"], spec["kv_heads"], spec["head_dim"], spec["dtype"]) == (
        3,
        2,
        16,
        "float32",
    )
    ids = prompt_token_ids(30, 1, 512)
    layers: list[tuple[torch.Tensor, torch.Tensor]] = []
    result = PrefillRunner(loaded).run(ids, lambda i, k, v: layers.append((k, v)))
    tokens = DecodeRunner(loaded).generate(layers, result.first_token, 30, 6)
    assert tokens == reference_generate(built, ids, 6)


def write_config(directory: Path, **fields: object) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(fields))
    return directory


def test_missing_directory_and_config(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="no such model directory"):
        load_model(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnsupportedModelError, match=r"no config\.json"):
        load_model(tmp_path / "empty")


def test_unreadable_config(tmp_path: Path) -> None:
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError, match="cannot read the model config"):
        load_model(tmp_path / "bad")


def test_non_llama_model_is_refused(tmp_path: Path) -> None:
    path = write_config(tmp_path / "gpt2", model_type="gpt2", n_layer=2, n_head=2, n_embd=32)
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2' is not supported"):
        load_model(path)


def test_sliding_window_model_is_refused(tmp_path: Path) -> None:
    path = write_config(
        tmp_path / "mistral",
        model_type="mistral",
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=64,
        sliding_window=4096,
    )
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        load_model(path)


def test_config_without_weights(tmp_path: Path) -> None:
    path = write_config(
        tmp_path / "noweights",
        model_type="llama",
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=64,
        num_hidden_layers=2,
    )
    with pytest.raises(UnsupportedModelError, match="cannot load the model weights"):
        load_model(path)
