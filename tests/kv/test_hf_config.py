"""Reading real-shaped Hugging Face config.json files (field names and values copied from
the public configs of each model) and every error path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from topkv.kv import ModelConfigError, get_model, load_hf_config, spec_from_hf_dict

LLAMA_3_70B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 8192,
    "initializer_range": 0.02,
    "intermediate_size": 28672,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}

MISTRAL_7B_V01: dict[str, Any] = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.34.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}

MIXTRAL_8X22B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 6144,
    "initializer_range": 0.02,
    "intermediate_size": 16384,
    "max_position_embeddings": 65536,
    "model_type": "mixtral",
    "num_attention_heads": 48,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 56,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.38.0",
    "use_cache": True,
    "vocab_size": 32000,
}

QWEN2_5_7B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 152064,
}

QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}

DEEPSEEK_V2_LITE: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "first_k_dense_replace": 1,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "tie_word_embeddings": False,
    "v_head_dim": 128,
    "vocab_size": 102400,
}

GPT_OSS_120B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "num_local_experts": 128,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "rms_norm_eps": 1e-05,
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 201088,
}

QWEN3_NEXT_80B: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "decoder_sparse_step": 1,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "model_type": "qwen3_next",
    "moe_intermediate_size": 512,
    "num_attention_heads": 16,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    "partial_rotary_factor": 0.25,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

QWEN3_5_397B: dict[str, Any] = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "image_token_id": 248056,
    "model_type": "qwen3_5_moe",
    "text_config": {
        "attn_output_gate": True,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_size": 4096,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 15,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 64,
        "linear_value_head_dim": 128,
        "mamba_ssm_dtype": "float32",
        "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": 1024,
        "num_attention_heads": 32,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "num_hidden_layers": 60,
        "num_key_value_heads": 2,
        "shared_expert_intermediate_size": 1024,
        "vocab_size": 248320,
    },
    "tie_word_embeddings": False,
    "vision_config": {"depth": 27, "hidden_size": 1152},
}


def _write(tmp_path: Path, cfg: dict[str, Any], name: str = "model") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    path = folder / "config.json"
    path.write_text(json.dumps(cfg, indent=2))
    return path


def test_llama_directory_matches_catalog(tmp_path: Path) -> None:
    path = _write(tmp_path, LLAMA_3_70B, "Meta-Llama-3-70B")
    spec = load_hf_config(path.parent)
    assert spec.name == "Meta-Llama-3-70B"
    assert spec.source == str(path)
    assert spec.head_dim == 128  # derived: 8192 / 64
    assert spec.attention == "gqa"
    assert spec.kv_bytes(4096) == 1_342_177_280
    assert spec.kv_bytes_per_token() == get_model("llama-3-70b").kv_bytes_per_token()
    assert spec.num_params is not None
    assert spec.num_params == pytest.approx(70.55e9, rel=0.01)


def test_mistral_sliding_window_applies_to_every_layer(tmp_path: Path) -> None:
    spec = load_hf_config(_write(tmp_path, MISTRAL_7B_V01))
    assert spec.layer_types == ("sliding",) * 32
    assert spec.sliding_window == 4096
    token = 32 * 2 * 8 * 128 * 2
    assert spec.kv_bytes(2048) == 2048 * token
    assert spec.kv_bytes(8192) == 4096 * token
    assert spec.kv_bytes_per_token() == 0  # nothing grows past the window


def test_mixtral_matches_catalog_and_counts_experts(tmp_path: Path) -> None:
    spec = load_hf_config(_write(tmp_path, MIXTRAL_8X22B))
    assert spec.sliding_window is None
    assert spec.kv_bytes(4096) == get_model("mixtral-8x22b").kv_bytes(4096) == 939_524_096
    assert (spec.num_experts, spec.experts_per_token) == (8, 2)
    assert spec.num_params == pytest.approx(140.6e9, rel=0.01)
    assert spec.active_params == pytest.approx(39e9, rel=0.02)


def test_qwen2_sliding_disabled_by_use_sliding_window(tmp_path: Path) -> None:
    spec = load_hf_config(_write(tmp_path, QWEN2_5_7B))
    assert spec.layer_types == ("full",) * 28
    assert spec.head_dim == 128
    assert spec.kv_bytes_per_token() == 28 * 2 * 4 * 128 * 2


def test_qwen2_sliding_from_max_window_layers(tmp_path: Path) -> None:
    cfg = dict(QWEN2_5_7B, use_sliding_window=True, sliding_window=1024, max_window_layers=20)
    spec = load_hf_config(_write(tmp_path, cfg))
    assert spec.layer_types == ("full",) * 20 + ("sliding",) * 8
    token = 2 * 4 * 128 * 2
    assert spec.kv_bytes(4096) == token * (20 * 4096 + 8 * 1024)


def test_qwen3_moe_explicit_head_dim_wins(tmp_path: Path) -> None:
    spec = load_hf_config(_write(tmp_path, QWEN3_30B_A3B))
    assert spec.head_dim == 128  # not 2048 / 32 = 64
    assert spec.kv_bytes_per_token() == 48 * 2 * 4 * 128 * 2
    assert spec.num_params == pytest.approx(30.5e9, rel=0.02)
    assert spec.active_params == pytest.approx(3.3e9, rel=0.05)


def test_deepseek_v3_mla(tmp_path: Path) -> None:
    spec = load_hf_config(_write(tmp_path, DEEPSEEK_V3))
    assert spec.attention == "mla"
    assert (spec.kv_lora_rank, spec.qk_rope_head_dim) == (512, 64)
    assert spec.kv_bytes(4096) == 287_834_112
    assert (spec.num_experts, spec.experts_per_token) == (256, 8)
    assert spec.num_params == pytest.approx(671e9, rel=0.02)
    assert spec.active_params == pytest.approx(37e9, rel=0.03)


def test_deepseek_v2_lite_without_q_lora(tmp_path: Path) -> None:
    spec = load_hf_config(_write(tmp_path, DEEPSEEK_V2_LITE))
    assert spec.kv_bytes(1000, "bf16") == 27 * 576 * 1000 * 2
    assert spec.num_params == pytest.approx(15.7e9, rel=0.03)


def test_gpt_oss_alternating_layers(tmp_path: Path) -> None:
    spec = load_hf_config(_write(tmp_path, GPT_OSS_120B))
    assert spec.layer_types == get_model("gpt-oss-120b").layer_types
    assert spec.kv_bytes(4096) == get_model("gpt-oss-120b").kv_bytes(4096) == 155_713_536
    assert spec.num_params == pytest.approx(116.8e9, rel=0.01)


def test_gpt_oss_without_layer_types_defaults_to_alternating(tmp_path: Path) -> None:
    cfg = {k: v for k, v in GPT_OSS_120B.items() if k != "layer_types"}
    spec = load_hf_config(_write(tmp_path, cfg))
    assert spec.layer_types[:2] == ("sliding", "full")


def test_qwen3_next_hybrid_from_interval(tmp_path: Path) -> None:
    spec = load_hf_config(_write(tmp_path, QWEN3_NEXT_80B))
    assert spec.layer_types.count("full") == 12
    assert spec.layer_types[3] == "full" and spec.layer_types[0] == "linear"
    assert spec.kv_bytes_per_token() == 12 * 2 * 2 * 256 * 2
    elements = 32 * 128 * 128 + (2 * 16 * 128 + 32 * 128) * 3
    assert spec.linear_state_bytes("bf16") == 36 * elements * 2
    assert spec.num_params == pytest.approx(80e9, rel=0.02)


def test_qwen3_5_nested_text_config_matches_catalog(tmp_path: Path) -> None:
    spec = load_hf_config(_write(tmp_path, QWEN3_5_397B))
    reference = get_model("qwen3.5-397b")
    assert spec.layer_types == reference.layer_types
    assert spec.kv_bytes(4096) == reference.kv_bytes(4096) == 125_829_120
    assert spec.linear_state_bytes() == reference.linear_state_bytes()
    assert spec.num_params == pytest.approx(397e9, rel=0.02)
    assert spec.active_params == pytest.approx(17e9, rel=0.05)


def test_name_argument_overrides(tmp_path: Path) -> None:
    assert load_hf_config(_write(tmp_path, LLAMA_3_70B), name="mine").name == "mine"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: c.pop("num_hidden_layers"), "missing field 'num_hidden_layers'"),
        (lambda c: c.pop("model_type"), "missing field 'model_type'"),
        (lambda c: c.update(model_type="bert"), "unsupported model_type 'bert'"),
        (lambda c: c.update(num_attention_heads="64"), "'num_attention_heads' must be a positive"),
        (lambda c: c.update(num_key_value_heads=True), "'num_key_value_heads' must be a positive"),
        (lambda c: c.update(hidden_size=8193), "missing field 'head_dim'"),
        (lambda c: c.update(layer_types=["full_attention"] * 3), "has 3 entries"),
        (
            lambda c: c.update(layer_types=["chunked_attention"] * 80),
            "unsupported layer types",
        ),
        (lambda c: c.update(layer_types="full"), "must be a list of strings"),
        (
            lambda c: c.update(layer_types=["sliding_attention"] * 80),
            "need field 'sliding_window'",
        ),
    ],
)
def test_llama_config_errors(tmp_path: Path, mutate: Any, message: str) -> None:
    cfg = json.loads(json.dumps(LLAMA_3_70B))
    mutate(cfg)
    with pytest.raises(ModelConfigError, match=message):
        load_hf_config(_write(tmp_path, cfg))


def test_mla_missing_kv_lora_rank(tmp_path: Path) -> None:
    cfg = {k: v for k, v in DEEPSEEK_V3.items() if k != "kv_lora_rank"}
    with pytest.raises(ModelConfigError, match="missing field 'kv_lora_rank'"):
        load_hf_config(_write(tmp_path, cfg))


def test_hybrid_missing_linear_heads(tmp_path: Path) -> None:
    cfg = {k: v for k, v in QWEN3_NEXT_80B.items() if k != "linear_num_value_heads"}
    with pytest.raises(ModelConfigError, match="linear_num_value_heads"):
        load_hf_config(_write(tmp_path, cfg))


def test_bad_json_names_file_and_position(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama",\n  "hidden_size": }')
    with pytest.raises(ModelConfigError, match=r"config.json: invalid JSON at line 2"):
        load_hf_config(path)


def test_json_that_is_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match="expected a JSON object"):
        load_hf_config(tmp_path)


def test_missing_file_and_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="no such config file"):
        load_hf_config(tmp_path / "nope.json")
    with pytest.raises(ModelConfigError, match="no such config file"):
        load_hf_config(tmp_path)


@given(
    st.dictionaries(
        st.sampled_from([*LLAMA_3_70B, "layer_types", "kv_lora_rank", "text_config"]),
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-5, 10**6),
            st.text(max_size=5),
            st.lists(st.sampled_from(["full_attention", "sliding_attention", "x"])),
        ),
    )
)
def test_arbitrary_fields_give_a_spec_or_a_model_config_error(fields: dict[str, Any]) -> None:
    cfg = dict(LLAMA_3_70B, **fields)
    try:
        spec = spec_from_hf_dict(cfg, name="fuzz", source="fuzz.json")
    except ModelConfigError:
        return
    assert spec.kv_bytes(16) >= 0
