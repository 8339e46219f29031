"""The tiny seeded model shape the engine and MoE tests share (fast on two CPU cores)."""

from __future__ import annotations

from dataclasses import replace

from topkv.engine.spec import DemoModelConfig

#: 2 layers of 64 wide, 4 query and 2 KV heads of 16, a 512-token vocabulary.
TINY = DemoModelConfig(
    layers=2,
    hidden_size=64,
    heads=4,
    kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=1024,
)


def tiny(**over: int) -> DemoModelConfig:
    """:data:`TINY` with some fields changed."""
    return replace(TINY, **over)
