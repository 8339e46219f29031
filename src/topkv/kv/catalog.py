"""Catalog of the paper's models with the published shapes that determine KV size.

Every entry names its source: the model's Hugging Face ``config.json`` for the shapes, and
the model card for parameter counts. ``get_model`` looks names up case-insensitively and
also accepts a few aliases (``llama-3-70b`` for ``Llama-3-70B``, ``kimi-k2`` ...).
"""

from __future__ import annotations

import re

from topkv.kv.errors import UnknownModelError
from topkv.kv.spec import ModelSpec, alternating_sliding_full, every_nth_full

_HF = "https://huggingface.co"


def _gated_deltanet_state_bytes_16bit(
    num_k_heads: int, num_v_heads: int, k_head_dim: int, v_head_dim: int, conv_kernel: int
) -> int:
    """Bytes (2 per element) of one Gated DeltaNet layer's recurrent + convolution state.

    Recurrent state: ``num_v_heads * k_head_dim * v_head_dim``; causal-conv state over the
    concatenated q, k, v channels: ``(2 * num_k_heads * k_head_dim + num_v_heads *
    v_head_dim) * (conv_kernel - 1)``.
    """
    recurrent = num_v_heads * k_head_dim * v_head_dim
    conv = (2 * num_k_heads * k_head_dim + num_v_heads * v_head_dim) * (conv_kernel - 1)
    return 2 * (recurrent + conv)


_CATALOG: tuple[ModelSpec, ...] = (
    ModelSpec(
        name="Llama-3-8B",
        source=f"{_HF}/meta-llama/Meta-Llama-3-8B/blob/main/config.json",
        num_layers=32,
        num_attention_heads=32,
        num_kv_heads=8,
        head_dim=128,
        hidden_size=4096,
        intermediate_size=14336,
        vocab_size=128256,
        attention="gqa",
        num_params=8_030_000_000,
        active_params=8_030_000_000,
    ),
    ModelSpec(
        name="Llama-3-70B",
        source=f"{_HF}/meta-llama/Meta-Llama-3-70B/blob/main/config.json",
        num_layers=80,
        num_attention_heads=64,
        num_kv_heads=8,
        head_dim=128,
        hidden_size=8192,
        intermediate_size=28672,
        vocab_size=128256,
        attention="gqa",
        num_params=70_550_000_000,
        active_params=70_550_000_000,
    ),
    ModelSpec(
        name="Llama-3.1-405B",
        source=f"{_HF}/meta-llama/Llama-3.1-405B/blob/main/config.json",
        num_layers=126,
        num_attention_heads=128,
        num_kv_heads=8,
        head_dim=128,
        hidden_size=16384,
        intermediate_size=53248,
        vocab_size=128256,
        attention="gqa",
        num_params=405_850_000_000,
        active_params=405_850_000_000,
    ),
    ModelSpec(
        name="Mixtral-8x22B",
        source=f"{_HF}/mistralai/Mixtral-8x22B-v0.1/blob/main/config.json "
        "(141B total / 39B active: mistral.ai/news/mixtral-8x22b)",
        num_layers=56,
        num_attention_heads=48,
        num_kv_heads=8,
        head_dim=128,
        hidden_size=6144,
        intermediate_size=16384,
        vocab_size=32000,
        attention="gqa",
        num_params=140_620_000_000,
        active_params=39_000_000_000,
        num_experts=8,
        experts_per_token=2,
    ),
    ModelSpec(
        name="DeepSeek-V3",
        source=f"{_HF}/deepseek-ai/DeepSeek-V3/blob/main/config.json "
        "(671B total / 37B active: arXiv 2412.19437)",
        num_layers=61,
        num_attention_heads=128,
        num_kv_heads=128,
        head_dim=192,
        hidden_size=7168,
        intermediate_size=18432,
        vocab_size=129280,
        attention="mla",
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        num_params=671_000_000_000,
        active_params=37_000_000_000,
        num_experts=256,
        experts_per_token=8,
    ),
    ModelSpec(
        name="Kimi-K2",
        source=f"{_HF}/moonshotai/Kimi-K2-Instruct/blob/main/config.json "
        "(1.04T total / 32B active: model card)",
        num_layers=61,
        num_attention_heads=64,
        num_kv_heads=64,
        head_dim=192,
        hidden_size=7168,
        intermediate_size=18432,
        vocab_size=163840,
        attention="mla",
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        num_params=1_040_000_000_000,
        active_params=32_000_000_000,
        num_experts=384,
        experts_per_token=8,
    ),
    ModelSpec(
        name="gpt-oss-120b",
        source=f"{_HF}/openai/gpt-oss-120b/blob/main/config.json "
        "(116.8B total / 5.1B active: model card)",
        num_layers=36,
        num_attention_heads=64,
        num_kv_heads=8,
        head_dim=64,
        hidden_size=2880,
        intermediate_size=2880,
        vocab_size=201088,
        attention="gqa",
        layer_types=alternating_sliding_full(36),
        sliding_window=128,
        num_params=116_830_000_000,
        active_params=5_130_000_000,
        num_experts=128,
        experts_per_token=4,
    ),
    ModelSpec(
        name="Qwen3.5-397B",
        source=f"{_HF}/Qwen/Qwen3.5-397B-A17B/blob/main/config.json (text_config; "
        "15 x (3 Gated DeltaNet + 1 gated attention), 397B total / 17B active)",
        num_layers=60,
        num_attention_heads=32,
        num_kv_heads=2,
        head_dim=256,
        hidden_size=4096,
        intermediate_size=1024,
        vocab_size=248320,
        attention="gqa",
        layer_types=every_nth_full(60, 4),
        linear_state_bytes_per_layer=_gated_deltanet_state_bytes_16bit(
            num_k_heads=16, num_v_heads=64, k_head_dim=128, v_head_dim=128, conv_kernel=4
        ),
        num_params=397_000_000_000,
        active_params=17_000_000_000,
        num_experts=512,
        experts_per_token=10,
    ),
)


def catalog() -> list[ModelSpec]:
    """All catalog models, in a stable order (dense Llamas first, then MoE models)."""
    return list(_CATALOG)


def _normalise(name: str) -> str:
    return re.sub(r"[^a-z0-9.]", "", name.lower())


_ALIASES: dict[str, str] = {
    "kimik2instruct": "Kimi-K2",
    "qwen3.5397ba17b": "Qwen3.5-397B",
    "llama3405b": "Llama-3.1-405B",
    "deepseekv3": "DeepSeek-V3",
    "mixtral8x22bv0.1": "Mixtral-8x22B",
}


def get_model(name: str) -> ModelSpec:
    """Look a catalog model up by name, ignoring case, spaces, dashes and underscores.

    Raises UnknownModelError listing the known names.
    """
    wanted = _normalise(name)
    wanted = _normalise(_ALIASES.get(wanted, wanted))
    for spec in _CATALOG:
        if _normalise(spec.name) == wanted:
            return spec
    known = ", ".join(spec.name for spec in _CATALOG)
    raise UnknownModelError(
        f"unknown model {name!r}; known models: {known} (or pass --config PATH/config.json)"
    )
