"""Model architecture description and KV-cache sizing (paper Eq. 1 and its extensions).

Per layer and per token a layer's cache holds:

* MHA / GQA / MQA: ``2 * num_kv_heads * head_dim`` elements (K and V), i.e. Eq. 1
  ``bytes = 2 * L * h_kv * d_h * s * b_p`` summed over layers;
* MLA (DeepSeek-V2/V3, Kimi K2): one latent of ``kv_lora_rank + qk_rope_head_dim``
  elements, no separate K and V;

and the number of tokens a layer keeps depends on its type:

* ``"full"``: every token of the sequence;
* ``"sliding"``: at most ``sliding_window`` tokens;
* ``"linear"`` (linear attention, e.g. Gated DeltaNet): no per-token cache at all, only a
  fixed-size recurrent state, reported separately by :meth:`ModelSpec.linear_state_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from topkv.kv.dtypes import dtype_bytes
from topkv.kv.errors import ModelConfigError

AttentionKind = Literal["mha", "gqa", "mqa", "mla"]
LayerType = Literal["full", "sliding", "linear"]

ATTENTION_KINDS: tuple[str, ...] = get_args(AttentionKind)
LAYER_TYPES: tuple[str, ...] = get_args(LayerType)


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a decoder-only transformer that determine its KV-cache size.

    ``layer_types`` has one entry per layer; an empty tuple means "all full attention".
    ``linear_state_bytes_per_layer`` is the recurrent state (plus convolution state) of one
    linear-attention layer in bytes at 16-bit precision; :meth:`linear_state_bytes` scales
    it to other dtypes. ``num_params`` / ``active_params`` are total and per-token active
    parameter counts (equal for dense models); ``None`` when unknown. ``max_context`` is
    the longest sequence (prompt + output tokens) the model takes, from the config's
    ``max_position_embeddings``; ``None`` when unknown (then no length is refused).
    """

    name: str
    source: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    attention: AttentionKind = "gqa"
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    layer_types: tuple[LayerType, ...] = ()
    sliding_window: int | None = None
    linear_state_bytes_per_layer: int = 0
    num_params: int | None = None
    active_params: int | None = None
    num_experts: int = 0
    experts_per_token: int = 0
    max_context: int | None = None

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full",) * self.num_layers)
        self._validate()

    def _validate(self) -> None:
        where = f"model {self.name!r}"
        for field in ("num_layers", "num_attention_heads", "hidden_size"):
            if getattr(self, field) <= 0:
                raise ModelConfigError(f"{where}: {field} must be positive")
        if self.attention not in ATTENTION_KINDS:
            raise ModelConfigError(
                f"{where}: attention {self.attention!r} is not one of {ATTENTION_KINDS}"
            )
        if self.attention == "mla":
            if self.kv_lora_rank <= 0 or self.qk_rope_head_dim < 0:
                raise ModelConfigError(
                    f"{where}: MLA needs kv_lora_rank > 0 and qk_rope_head_dim >= 0"
                )
        elif self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise ModelConfigError(f"{where}: num_kv_heads and head_dim must be positive")
        if len(self.layer_types) != self.num_layers:
            raise ModelConfigError(
                f"{where}: layer_types has {len(self.layer_types)} entries "
                f"but num_layers is {self.num_layers}"
            )
        if self.max_context is not None and self.max_context <= 0:
            raise ModelConfigError(f"{where}: max_context must be positive when given")
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise ModelConfigError(f"{where}: unknown layer types {bad}; expected {LAYER_TYPES}")
        if "sliding" in self.layer_types and (self.sliding_window or 0) <= 0:
            raise ModelConfigError(f"{where}: sliding layers need a positive sliding_window")
        if self.linear_state_bytes_per_layer < 0 or self.linear_state_bytes_per_layer % 2:
            raise ModelConfigError(
                f"{where}: linear_state_bytes_per_layer must be a non-negative even number "
                "(bytes at 16-bit precision)"
            )

    # -- per-token sizes -------------------------------------------------------------

    def kv_elements_per_token_per_layer(self) -> int:
        """Elements one attention layer stores per cached token (K+V, or the MLA latent)."""
        if self.attention == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def kv_bytes_per_token_per_layer(self, dtype: str = "fp16") -> int:
        """Bytes one attention layer stores per cached token."""
        return self.kv_elements_per_token_per_layer() * dtype_bytes(dtype)

    def kv_bytes_per_token(self, dtype: str = "fp16") -> int:
        """Asymptotic KV growth per token: bytes added by one more token in a long sequence.

        Only full-attention layers count (sliding layers stop growing at their window and
        linear layers never grow). For a model whose layers are all full attention this is
        ``kv_bytes(s) / s`` for every ``s``.
        """
        return self.kv_bytes_per_token_per_layer(dtype) * self.layer_types.count("full")

    # -- whole-sequence sizes --------------------------------------------------------

    def cached_tokens(self, layer_type: LayerType, seq_len: int) -> int:
        """Tokens a layer of ``layer_type`` holds for a sequence of ``seq_len`` tokens."""
        if layer_type == "full":
            return seq_len
        if layer_type == "sliding":
            return min(seq_len, self.sliding_window or 0)
        return 0

    def kv_bytes_per_layer(self, seq_len: int, dtype: str = "fp16") -> list[int]:
        """KV-cache bytes of each layer for one sequence of ``seq_len`` tokens."""
        _check_seq_len(seq_len)
        per_token = self.kv_bytes_per_token_per_layer(dtype)
        return [per_token * self.cached_tokens(t, seq_len) for t in self.layer_types]

    def kv_bytes(self, seq_len: int, dtype: str = "fp16") -> int:
        """Total KV-cache bytes for one sequence (excludes linear-attention state)."""
        return sum(self.kv_bytes_per_layer(seq_len, dtype))

    def linear_state_bytes(self, dtype: str = "fp16") -> int:
        """Fixed-size state of all linear-attention layers, independent of sequence length."""
        per_layer = self.linear_state_bytes_per_layer // 2 * dtype_bytes(dtype)
        return per_layer * self.layer_types.count("linear")

    @property
    def is_moe(self) -> bool:
        """Whether the model routes tokens to a subset of experts."""
        return self.num_experts > 0


def alternating_sliding_full(num_layers: int) -> tuple[LayerType, ...]:
    """gpt-oss pattern: even layers sliding-window, odd layers full attention."""
    return tuple("sliding" if i % 2 == 0 else "full" for i in range(num_layers))


def every_nth_full(num_layers: int, interval: int) -> tuple[LayerType, ...]:
    """Qwen3-Next / Qwen3.5 pattern: every ``interval``-th layer full, the rest linear."""
    return tuple("full" if (i + 1) % interval == 0 else "linear" for i in range(num_layers))


def sliding_from(num_layers: int, first_sliding: int) -> tuple[LayerType, ...]:
    """Layers ``first_sliding`` and above slide (Qwen2 ``max_window_layers``; 0 = all)."""
    return tuple("sliding" if i >= first_sliding else "full" for i in range(num_layers))


def _check_seq_len(seq_len: int) -> None:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ModelConfigError(f"seq_len must be a non-negative integer, got {seq_len!r}")
