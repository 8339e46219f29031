"""KV sizing against hand-computed values (paper Eq. 1, MLA, sliding window, hybrids)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from topkv.dtypes import KV_DTYPES
from topkv.errors import ConfigError
from topkv.kv import (
    ModelConfigError,
    ModelSpec,
    UnknownDtypeError,
    UnknownModelError,
    catalog,
    get_model,
)


def test_llama_3_70b_4k_fp16_matches_eq1() -> None:
    # 2 * L * h_kv * d_h * s * b_p = 2 * 80 * 8 * 128 * 4096 * 2
    assert get_model("Llama-3-70B").kv_bytes(4096, "fp16") == 1_342_177_280
    assert 2 * 80 * 8 * 128 * 4096 * 2 == 1_342_177_280


def test_deepseek_v3_mla_is_one_latent_per_token_per_layer() -> None:
    spec = get_model("deepseek-v3")
    # (kv_lora_rank 512 + rope 64) * 61 layers * 4096 tokens * 2 bytes
    assert spec.kv_bytes(4096) == 576 * 61 * 4096 * 2 == 287_834_112
    assert spec.kv_bytes_per_token_per_layer() == 576 * 2


@pytest.mark.parametrize(
    ("name", "expected_bytes", "spec_gb"),
    [
        ("Llama-3-8B", 2 * 32 * 8 * 128 * 4096 * 2, None),
        ("Llama-3.1-405B", 2 * 126 * 8 * 128 * 4096 * 2, None),
        ("Mixtral-8x22B", 2 * 56 * 8 * 128 * 4096 * 2, 0.94),
        ("Kimi-K2", 576 * 61 * 4096 * 2, 0.29),
        # 18 full layers hold 4096 tokens, 18 sliding layers hold 128
        ("gpt-oss-120b", 2 * 8 * 64 * 2 * (18 * 4096 + 18 * 128), 0.16),
        # only the 15 full-attention layers of 60 hold a per-token cache
        ("Qwen3.5-397B", 2 * 15 * 2 * 256 * 4096 * 2, 0.13),
    ],
)
def test_catalog_sizes_at_4k(name: str, expected_bytes: int, spec_gb: float | None) -> None:
    size = get_model(name).kv_bytes(4096)
    assert size == expected_bytes
    if spec_gb is not None:  # SPEC.md's rounded decimal-GB reference values
        assert round(size / 1e9, 2) == spec_gb


def test_dtype_scaling() -> None:
    spec = get_model("llama-3-70b")
    fp16 = spec.kv_bytes(1000, "fp16")
    assert spec.kv_bytes(1000, "bf16") == fp16
    assert spec.kv_bytes(1000, "fp32") == 2 * fp16
    assert spec.kv_bytes(1000, "FP8") * 2 == fp16
    assert set(KV_DTYPES) == {"fp32", "bf16", "fp16", "fp8"}


def test_unknown_dtype_is_a_config_error() -> None:
    with pytest.raises(UnknownDtypeError, match="fp16"):
        get_model("llama-3-8b").kv_bytes(10, "int3")
    assert issubclass(UnknownDtypeError, ConfigError)


def test_sliding_window_caps_tokens_per_layer() -> None:
    spec = get_model("gpt-oss-120b")
    per_layer = spec.kv_bytes_per_layer(1000)
    token = 2 * 8 * 64 * 2
    assert per_layer[0] == 128 * token  # layer 0 slides
    assert per_layer[1] == 1000 * token  # layer 1 is full
    assert len(per_layer) == 36
    # below the window every layer holds every token
    assert spec.kv_bytes(100) == 36 * 100 * token
    # asymptotic growth counts only the full layers
    assert spec.kv_bytes(10_001) - spec.kv_bytes(10_000) == spec.kv_bytes_per_token()


def test_hybrid_linear_layers_hold_fixed_state() -> None:
    spec = get_model("qwen3.5-397b")
    assert spec.layer_types.count("linear") == 45
    assert all(
        b == 0
        for b, t in zip(spec.kv_bytes_per_layer(4096), spec.layer_types, strict=True)
        if t == "linear"
    )
    # Gated DeltaNet: recurrent 64*128*128 + conv (2*16*128 + 64*128)*3 elements per layer
    elements = 64 * 128 * 128 + (2 * 16 * 128 + 64 * 128) * 3
    assert spec.linear_state_bytes("fp16") == 45 * elements * 2
    assert spec.linear_state_bytes("fp32") == 45 * elements * 4
    assert spec.linear_state_bytes("fp8") == 45 * elements


def test_mha_mqa_gqa_per_token() -> None:
    base = {
        "source": "hand-made",
        "num_layers": 2,
        "num_attention_heads": 4,
        "head_dim": 8,
        "hidden_size": 32,
        "intermediate_size": 64,
        "vocab_size": 100,
    }
    mha = ModelSpec(name="mha", num_kv_heads=4, attention="mha", **base)  # type: ignore[arg-type]
    mqa = ModelSpec(name="mqa", num_kv_heads=1, attention="mqa", **base)  # type: ignore[arg-type]
    assert mha.kv_bytes_per_token() == 2 * 2 * 4 * 8 * 2
    assert mqa.kv_bytes_per_token() == 2 * 2 * 1 * 8 * 2
    assert mha.kv_bytes(0) == 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"layer_types": ("full",)}, "layer_types has 1 entries"),
        ({"layer_types": ("full", "sliding")}, "sliding_window"),
        ({"layer_types": ("full", "chunked")}, "unknown layer types"),
        ({"attention": "mla"}, "kv_lora_rank"),
        ({"num_layers": 0, "layer_types": ()}, "num_layers"),
        ({"linear_state_bytes_per_layer": 3}, "even"),
    ],
)
def test_invalid_spec_fields(overrides: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {
        "name": "bad",
        "source": "test",
        "num_layers": 2,
        "num_attention_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 8,
        "hidden_size": 32,
        "intermediate_size": 64,
        "vocab_size": 100,
    }
    fields.update(overrides)
    with pytest.raises(ModelConfigError, match=message):
        ModelSpec(**fields)  # type: ignore[arg-type]


def test_negative_seq_len_rejected() -> None:
    with pytest.raises(ModelConfigError, match="seq_len"):
        get_model("llama-3-8b").kv_bytes(-1)


def test_get_model_is_case_insensitive_and_lists_names_on_error() -> None:
    assert get_model("LLAMA_3_70B").name == "Llama-3-70B"
    assert get_model("kimi k2").name == "Kimi-K2"
    assert get_model("Qwen3.5-397B-A17B").name == "Qwen3.5-397B"
    with pytest.raises(UnknownModelError, match=r"Llama-3-70B.*DeepSeek-V3"):
        get_model("gpt-5")


def test_catalog_has_the_papers_models_with_sources() -> None:
    names = {spec.name for spec in catalog()}
    assert {
        "Llama-3-8B",
        "Llama-3-70B",
        "Llama-3.1-405B",
        "Mixtral-8x22B",
        "DeepSeek-V3",
        "Kimi-K2",
        "gpt-oss-120b",
        "Qwen3.5-397B",
    } <= names
    for spec in catalog():
        assert spec.source.startswith("https://huggingface.co/"), spec.name
        assert spec.num_params and spec.active_params
        assert spec.active_params <= spec.num_params
        assert spec.is_moe == (spec.active_params < spec.num_params)


@given(
    seq=st.integers(min_value=0, max_value=1_000_000),
    extra=st.integers(min_value=0, max_value=10_000),
    index=st.integers(min_value=0, max_value=7),
)
def test_kv_bytes_monotone_and_bounded(seq: int, extra: int, index: int) -> None:
    spec = catalog()[index]
    small, large = spec.kv_bytes(seq), spec.kv_bytes(seq + extra)
    assert 0 <= small <= large
    # never more than every attention layer holding every token
    attention_layers = spec.num_layers - spec.layer_types.count("linear")
    assert large <= attention_layers * spec.kv_bytes_per_token_per_layer() * (seq + extra)
    # and never less than the full layers alone
    assert small >= spec.kv_bytes_per_token() * seq
