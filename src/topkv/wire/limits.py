"""Caps a receiver puts on what an untrusted header may announce."""

from __future__ import annotations

from dataclasses import dataclass, fields

from topkv.wire.errors import WireError

GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class WireLimits:
    """Upper bounds checked on every decoded header before any payload is accepted.

    A receiver allocates at most ``max_tensor_bytes`` per tensor (twice that per frame)
    because of a header, whatever the header says. The defaults admit Llama-3-70B at 32K
    tokens in fp16 as one full frame (5 GiB per tensor); raise ``max_tensor_bytes`` for
    longer contexts or stream per-layer frames instead, whose tensors are ``layers``
    times smaller.
    """

    max_tensor_bytes: int = 8 * GiB
    max_layers: int = 1024
    max_seq_len: int = 1 << 21
    max_kv_heads: int = 1024
    max_head_dim: int = 8192

    def __post_init__(self) -> None:
        for limit in fields(self):  # every limit, in field order
            value = getattr(self, limit.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise WireError(
                    f"WireLimits.{limit.name} must be a positive integer, got {value!r}"
                )


DEFAULT_LIMITS = WireLimits()
