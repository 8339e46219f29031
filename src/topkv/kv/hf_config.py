"""Read a Hugging Face ``config.json`` into a :class:`ModelSpec`.

Supported ``model_type`` families:

* standard attention: llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe;
* MLA: deepseek_v2, deepseek_v3, kimi_k2;
* alternating sliding/full attention: gpt_oss (``layer_types``);
* hybrid linear/full attention: qwen3_next, qwen3_5(_moe) and their ``*_text`` configs
  (``layer_types`` or ``full_attention_interval``).

Multimodal wrappers that nest the language model under ``text_config`` are unwrapped.
Parameter counts are *estimated* from the weight shapes (projections, MLPs/experts,
embeddings; norms, biases and routers ignored) and are within a few percent of published
totals.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from topkv.inputs import InputFileError, excerpt, load_json
from topkv.kv.errors import ModelConfigError
from topkv.kv.spec import (
    AttentionKind,
    LayerType,
    ModelSpec,
    alternating_sliding_full,
    every_nth_full,
    sliding_from,
)

_STANDARD = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})
_MLA = frozenset({"deepseek_v2", "deepseek_v3", "kimi_k2"})
_GPT_OSS = frozenset({"gpt_oss"})
_HYBRID = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})
SUPPORTED_MODEL_TYPES: frozenset[str] = _STANDARD | _MLA | _GPT_OSS | _HYBRID

#: A config.json is a few KiB; anything far larger is not one.
MAX_CONFIG_BYTES = 16 << 20
#: Most layers a model may have (the largest published ones have ~130): the per-layer
#: pattern is built in memory, so a short file must not ask for a billion layers.
MAX_LAYERS = 100_000
#: Largest value of any count or size field (hidden_size, vocab_size, ...): sizes computed
#: from them stay finite floats.
MAX_FIELD = 1 << 32

_LAYER_TYPE_NAMES: dict[str, LayerType] = {
    "full_attention": "full",
    "sliding_attention": "sliding",
    "linear_attention": "linear",
}


def load_hf_config(path: str | Path, name: str | None = None) -> ModelSpec:
    """Build a ModelSpec from ``path`` (a ``config.json`` file or a directory holding one).

    ``name`` defaults to the config's ``_name_or_path`` or the directory name. Raises
    ModelConfigError naming the file and the missing/invalid field, the unsupported
    ``model_type`` or the JSON syntax error.
    """
    file = _resolve(Path(path))
    try:
        raw = load_json(file, what="a Hugging Face config.json", limit=MAX_CONFIG_BYTES)
    except InputFileError as exc:
        raise ModelConfigError(str(exc)) from None
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{file}: expected a JSON object, got {type(raw).__name__}")
    default_name = raw.get("_name_or_path") or file.parent.name or file.stem
    return spec_from_hf_dict(raw, name=name or str(default_name), source=str(file))


def _resolve(path: Path) -> Path:
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ModelConfigError(f"{path}: no such config file")
    return path


def spec_from_hf_dict(raw: Mapping[str, Any], name: str, source: str) -> ModelSpec:
    """Build a ModelSpec from an already-parsed ``config.json`` mapping."""
    cfg = _Fields(raw, source)
    model_type = cfg.optional_str("model_type")
    if model_type is None:
        raise ModelConfigError(f"{source}: missing field 'model_type'")
    text_config = raw.get("text_config")
    if isinstance(text_config, Mapping) and "num_hidden_layers" not in raw:
        cfg = _Fields(text_config, f"{source} (text_config)")
        model_type = cfg.optional_str("model_type") or model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(sorted(SUPPORTED_MODEL_TYPES))
        raise ModelConfigError(
            f"{source}: unsupported model_type {model_type!r}; supported: {supported}"
        )

    num_layers = cfg.positive_int("num_hidden_layers")
    if num_layers > MAX_LAYERS:
        raise ModelConfigError(
            f"{cfg.source}: field 'num_hidden_layers' is {num_layers:,}, more than {MAX_LAYERS:,}"
        )
    num_heads = cfg.positive_int("num_attention_heads")
    hidden = cfg.positive_int("hidden_size")
    vocab = cfg.positive_int("vocab_size")
    num_kv_heads = cfg.positive_int("num_key_value_heads", default=num_heads)

    kv_lora_rank = 0
    qk_rope = 0
    if model_type in _MLA:
        kv_lora_rank = cfg.positive_int("kv_lora_rank")
        qk_rope = cfg.positive_int("qk_rope_head_dim")
        head_dim = cfg.positive_int("qk_nope_head_dim") + qk_rope
        attention: AttentionKind = "mla"
    else:
        head_dim = _head_dim(cfg, hidden, num_heads)
        attention = _attention_kind(num_heads, num_kv_heads)

    layer_types, sliding_window = _layer_pattern(cfg, model_type, num_layers)
    linear_state = 0
    if "linear" in layer_types:
        linear_state = 2 * _gated_deltanet_state_elements(cfg)

    num_experts = (
        cfg.positive_int("num_local_experts", default=0)
        or cfg.positive_int("num_experts", default=0)
        or cfg.positive_int("n_routed_experts", default=0)
    )
    experts_per_token = cfg.positive_int("num_experts_per_tok", default=0) or cfg.positive_int(
        "experts_per_token", default=0
    )
    intermediate = cfg.positive_int("intermediate_size", default=0) or cfg.positive_int(
        "moe_intermediate_size"
    )

    spec = ModelSpec(
        name=name,
        source=source,
        num_layers=num_layers,
        num_attention_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=intermediate,
        vocab_size=vocab,
        attention=attention,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope,
        layer_types=layer_types,
        sliding_window=sliding_window,
        linear_state_bytes_per_layer=linear_state,
        num_experts=num_experts,
        experts_per_token=experts_per_token if num_experts else 0,
        max_context=_max_context(cfg.raw.get("max_position_embeddings")),
    )
    total, active = _estimate_params(cfg, spec, model_type)
    return replace(spec, num_params=total, active_params=active)


def _max_context(value: object) -> int | None:
    """``max_position_embeddings`` when it is a positive integer; anything else: unknown."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def _head_dim(cfg: _Fields, hidden: int, num_heads: int) -> int:
    explicit = cfg.positive_int("head_dim", default=0)
    if explicit:
        return explicit
    if hidden % num_heads:
        raise ModelConfigError(
            f"{cfg.source}: missing field 'head_dim' and hidden_size {hidden} is not "
            f"divisible by num_attention_heads {num_heads}"
        )
    return hidden // num_heads


def _attention_kind(num_heads: int, num_kv_heads: int) -> AttentionKind:
    if num_kv_heads == num_heads:
        return "mha"
    if num_kv_heads == 1:
        return "mqa"
    return "gqa"


def _layer_pattern(
    cfg: _Fields, model_type: str, num_layers: int
) -> tuple[tuple[LayerType, ...], int | None]:
    """Per-layer attention types and the sliding window (None when no layer slides)."""
    explicit = cfg.raw.get("layer_types")
    window = cfg.positive_int("sliding_window", default=0) or None
    if explicit is not None:
        types = _parse_layer_types(cfg, explicit, num_layers)
    elif model_type in _GPT_OSS:
        types = alternating_sliding_full(num_layers)
    elif model_type in _HYBRID:
        interval = cfg.positive_int("full_attention_interval")
        types = every_nth_full(num_layers, interval)
    elif window is not None and cfg.raw.get("use_sliding_window", True):
        # Qwen2/3 slide from layer max_window_layers on; Mistral/Mixtral slide everywhere.
        first = cfg.non_negative_int("max_window_layers")
        types = sliding_from(num_layers, first)
    else:
        types = sliding_from(num_layers, num_layers)
    if "sliding" in types and window is None:
        raise ModelConfigError(f"{cfg.source}: sliding layers need field 'sliding_window'")
    return types, (window if "sliding" in types else None)


def _parse_layer_types(cfg: _Fields, value: object, num_layers: int) -> tuple[LayerType, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ModelConfigError(f"{cfg.source}: field 'layer_types' must be a list of strings")
    if len(value) != num_layers:
        raise ModelConfigError(
            f"{cfg.source}: field 'layer_types' has {len(value)} entries "
            f"but num_hidden_layers is {num_layers}"
        )
    unknown = sorted({v for v in value if v not in _LAYER_TYPE_NAMES})
    if unknown:
        raise ModelConfigError(
            f"{cfg.source}: unsupported layer types {unknown} in 'layer_types'; "
            f"supported: {sorted(_LAYER_TYPE_NAMES)}"
        )
    return tuple(_LAYER_TYPE_NAMES[v] for v in value)


def _gated_deltanet_state_elements(cfg: _Fields) -> int:
    """Recurrent + causal-conv state elements of one Gated DeltaNet layer."""
    nk = cfg.positive_int("linear_num_key_heads")
    nv = cfg.positive_int("linear_num_value_heads")
    dk = cfg.positive_int("linear_key_head_dim")
    dv = cfg.positive_int("linear_value_head_dim")
    kernel = cfg.positive_int("linear_conv_kernel_dim")
    return nv * dk * dv + (2 * nk * dk + nv * dv) * (kernel - 1)


def _estimate_params(cfg: _Fields, spec: ModelSpec, model_type: str) -> tuple[int, int]:
    """Estimate (total, active) parameters from projection and MLP shapes."""
    h = spec.hidden_size
    embed = spec.vocab_size * h
    lm_head = 0 if cfg.raw.get("tie_word_embeddings", False) else spec.vocab_size * h

    attn = _attention_params(cfg, spec, model_type)
    linear = 0
    if "linear" in spec.layer_types:
        nk = cfg.positive_int("linear_num_key_heads")
        nv = cfg.positive_int("linear_num_value_heads")
        dk = cfg.positive_int("linear_key_head_dim")
        dv = cfg.positive_int("linear_value_head_dim")
        linear = h * (2 * nk * dk + 2 * nv * dv + 2 * nv) + nv * dv * h

    dense_mlp = 3 * h * spec.intermediate_size
    total = active = embed + lm_head
    dense_layers = spec.num_layers
    if spec.is_moe:
        expert_size = cfg.positive_int("moe_intermediate_size", default=0) or (
            spec.intermediate_size
        )
        expert = 3 * h * expert_size
        shared = 3 * h * cfg.non_negative_int("shared_expert_intermediate_size")
        shared += 3 * h * expert_size * cfg.non_negative_int("n_shared_experts")
        dense_layers = cfg.non_negative_int("first_k_dense_replace")
        moe_layers = spec.num_layers - dense_layers
        total += moe_layers * (spec.num_experts * expert + shared)
        active += moe_layers * (spec.experts_per_token * expert + shared)
    mixer = sum(linear if t == "linear" else attn for t in spec.layer_types)
    total += mixer + dense_layers * dense_mlp
    active += mixer + dense_layers * dense_mlp
    return total, active


def _attention_params(cfg: _Fields, spec: ModelSpec, model_type: str) -> int:
    h, heads = spec.hidden_size, spec.num_attention_heads
    if model_type not in _MLA:
        return 2 * h * heads * spec.head_dim + 2 * h * spec.num_kv_heads * spec.head_dim
    nope = cfg.positive_int("qk_nope_head_dim")
    rope = spec.qk_rope_head_dim
    v_dim = cfg.positive_int("v_head_dim")
    q_lora = cfg.positive_int("q_lora_rank", default=0)
    q = h * q_lora + q_lora * heads * (nope + rope) if q_lora else h * heads * (nope + rope)
    kv = h * (spec.kv_lora_rank + rope) + spec.kv_lora_rank * heads * (nope + v_dim)
    return q + kv + heads * v_dim * h


class _Fields:
    """Typed access to a config mapping with errors that name the file and field."""

    def __init__(self, raw: Mapping[str, Any], source: str) -> None:
        self.raw = raw
        self.source = source

    def optional_str(self, key: str) -> str | None:
        value = self.raw.get(key)
        if value is None:
            return None
        if not isinstance(value, str):
            raise ModelConfigError(f"{self.source}: field {key!r} must be a string")
        return value

    def positive_int(self, key: str, default: int | None = None) -> int:
        value = self.raw.get(key)
        if value is None:
            if default is None:
                raise ModelConfigError(f"{self.source}: missing field {key!r}")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelConfigError(
                f"{self.source}: field {key!r} must be a positive integer, got {excerpt(value)}"
            )
        return self._bounded(key, value)

    def _bounded(self, key: str, value: int) -> int:
        if value > MAX_FIELD:
            raise ModelConfigError(
                f"{self.source}: field {key!r} is {value:.3g}, larger than any model's "
                f"({MAX_FIELD:,} at most)"
            )
        return value

    def non_negative_int(self, key: str) -> int:
        """An optional count that may be zero; absent or null reads as 0."""
        value = self.raw.get(key)
        if value is None:
            return 0
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ModelConfigError(
                f"{self.source}: field {key!r} must be a non-negative integer, got {excerpt(value)}"
            )
        return self._bounded(key, value)
