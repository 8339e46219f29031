"""Pure descriptions of a model's KV cache: shape, dtype and byte sizes (no torch needed).

Per-layer layout on the wire (and in every tensor the engine publishes or accepts):
``[seq_len][kv_heads][head_dim]``, row-major (C-contiguous), one tensor for K and one for V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import numpy as np

from topkv.engine.errors import KVLayoutError


class KVModelSpec(TypedDict):
    """What the wire and kv layers need to describe a model's cache."""

    model_id: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # a numpy dtype name, e.g. "float32"
    dtype_bytes: int


@dataclass(frozen=True)
class DemoModelConfig:
    """Shape of the seeded random Llama-architecture demo model.

    The defaults were picked by measurement on the 2-core CPU dev machine so that prefill of
    a 1-2K-token prompt takes a few hundred ms, about 10-50 ms per layer (see docs/engine.md).
    ``init_std`` 0.08 (about 1/sqrt(hidden_size)) makes greedy output vary token to token;
    at 0.02 the random model repeats one token, which would make identity checks weak.
    """

    layers: int = 12
    hidden_size: int = 256
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 704
    vocab_size: int = 4096
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0
    init_std: float = 0.08

    def __post_init__(self) -> None:
        for name in ("layers", "hidden_size", "heads", "kv_heads", "head_dim", "vocab_size"):
            if getattr(self, name) < 1:
                raise KVLayoutError(
                    f"DemoModelConfig.{name} must be >= 1, got {getattr(self, name)}"
                )
        if self.heads % self.kv_heads != 0:
            raise KVLayoutError(
                f"DemoModelConfig.heads ({self.heads}) must be a multiple of kv_heads "
                f"({self.kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2 != 0:
            raise KVLayoutError(
                f"DemoModelConfig.head_dim must be even for RoPE, got {self.head_dim}"
            )


def layer_shape(spec: KVModelSpec, seq_len: int) -> tuple[int, int, int]:
    """Shape of one layer's K (or V) in wire layout: ``(seq_len, kv_heads, head_dim)``."""
    return (seq_len, spec["kv_heads"], spec["head_dim"])


def tensor_nbytes(spec: KVModelSpec, seq_len: int) -> int:
    """Bytes of one layer's K (or V alone) for ``seq_len`` tokens."""
    return seq_len * spec["kv_heads"] * spec["head_dim"] * spec["dtype_bytes"]


def layer_nbytes(spec: KVModelSpec, seq_len: int) -> int:
    """Bytes of one layer's K and V together for ``seq_len`` tokens."""
    return 2 * tensor_nbytes(spec, seq_len)


def cache_nbytes(spec: KVModelSpec, seq_len: int) -> int:
    """Bytes of the whole cache (all layers, K and V) for ``seq_len`` tokens."""
    return spec["layers"] * layer_nbytes(spec, seq_len)


def arrays_from_bytes(
    spec: KVModelSpec,
    seq_len: int,
    k_bytes: bytes | bytearray | memoryview,
    v_bytes: bytes | bytearray | memoryview,
) -> tuple[np.ndarray, np.ndarray]:
    """Zero-copy numpy views of one layer's K and V received as raw bytes (wire layout)."""
    expected = tensor_nbytes(spec, seq_len)
    for name, buf in (("K", k_bytes), ("V", v_bytes)):
        size = memoryview(buf).nbytes
        if size != expected:
            raise KVLayoutError(
                f"{name} buffer holds {size} bytes, expected {expected} for {seq_len} tokens x "
                f"{spec['kv_heads']} kv heads x {spec['head_dim']} x {spec['dtype']}"
            )
    shape = layer_shape(spec, seq_len)
    dtype = np.dtype(spec["dtype"])
    k = np.frombuffer(k_bytes, dtype=dtype).reshape(shape)
    v = np.frombuffer(v_bytes, dtype=dtype).reshape(shape)
    return k, v


def prompt_token_ids(length: int, seed: int, vocab_size: int) -> list[int]:
    """Deterministic pseudo-random prompt of ``length`` token ids in ``[0, vocab_size)``.

    Same (length, seed, vocab_size) gives the same ids in any process or platform
    (numpy's PCG64 stream is specified). The demo uses it to replay trace prompt lengths.
    """
    if length < 1:
        raise KVLayoutError(f"prompt length must be >= 1, got {length}")
    if vocab_size < 1:
        raise KVLayoutError(f"vocab_size must be >= 1, got {vocab_size}")
    rng = np.random.Generator(np.random.PCG64(seed))
    return [int(x) for x in rng.integers(0, vocab_size, size=length, dtype=np.int64)]
