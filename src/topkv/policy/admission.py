"""Admission: whether a request can *ever* be served, decided once, before it queues.

A request is never servable when

* its sequence (prompt + output tokens) is longer than the model's context
  (``ModelSpec.max_context``, from ``max_position_embeddings``; unknown = no limit), or
* the KV memory it needs on a decode instance is more than the largest decode instance
  can hold (bytes, or slots when decode instances count requests instead).

Such a request is *rejected* and counted, never silently dropped; waiting (back-pressure)
is only for requests that fit once other requests leave. Pure: callers pass the numbers,
so the simulator and a live front end decide alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from topkv.policy.errors import PolicyInputError

#: Reason codes of a rejection (stable strings, used as JSON keys).
LONGER_THAN_CONTEXT = "longer_than_context"
KV_EXCEEDS_DECODE_MEMORY = "kv_exceeds_decode_memory"
REJECTION_REASONS: tuple[str, ...] = (LONGER_THAN_CONTEXT, KV_EXCEEDS_DECODE_MEMORY)


@dataclass(frozen=True)
class AdmissionLimits:
    """What bounds every request: the model's context and the largest decode instance."""

    #: Longest sequence (prompt + output tokens) the model takes; None = unknown, no limit.
    max_context_tokens: int | None
    #: Most KV memory (bytes, or slots) any one decode instance holds; 0 = none at all.
    max_decode_kv: float

    def __post_init__(self) -> None:
        if self.max_context_tokens is not None and self.max_context_tokens <= 0:
            raise PolicyInputError(f"max context {self.max_context_tokens} must be positive")
        if not self.max_decode_kv >= 0:
            raise PolicyInputError(f"decode KV capacity {self.max_decode_kv} must be >= 0")

    @classmethod
    def of(cls, max_context_tokens: int | None, decode_kv: Iterable[float]) -> AdmissionLimits:
        """Limits from the model's context and every decode instance's KV capacity."""
        return cls(max_context_tokens, max(decode_kv, default=0.0))


@dataclass(frozen=True)
class Admission:
    """The decision for one request: admitted, or rejected with a reason code and text."""

    admitted: bool
    reason: str = ""
    detail: str = ""


ADMITTED = Admission(True)


def admit(sequence_tokens: int, kv_need: float, limits: AdmissionLimits) -> Admission:
    """Admit a request of ``sequence_tokens`` (prompt + output) needing ``kv_need`` of
    decode KV memory, or reject it because it can never be served under ``limits``."""
    context = limits.max_context_tokens
    if context is not None and sequence_tokens > context:
        return Admission(
            False,
            LONGER_THAN_CONTEXT,
            f"{sequence_tokens} tokens (prompt + output) exceed the model's context {context}",
        )
    if kv_need > limits.max_decode_kv:
        return Admission(
            False,
            KV_EXCEEDS_DECODE_MEMORY,
            f"needs {kv_need:.6g} of KV memory, the largest decode instance holds "
            f"{limits.max_decode_kv:.6g}",
        )
    return ADMITTED
