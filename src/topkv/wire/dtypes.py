"""Element types a KV frame can carry, with their one-byte wire codes."""

from __future__ import annotations

import enum

import numpy as np

from topkv.wire.errors import HeaderCorrupt, UnknownDType

_ITEMSIZE = {1: 4, 2: 2, 3: 2, 4: 1, 5: 1}
_STORAGE = {1: "<f4", 2: "<f2", 3: "<u2", 4: "u1", 5: "u1"}
_ALIASES = {
    "fp32": 1,
    "float32": 1,
    "float": 1,
    "fp16": 2,
    "float16": 2,
    "half": 2,
    "bf16": 3,
    "bfloat16": 3,
    "fp8": 4,
    "fp8_e4m3": 4,
    "float8_e4m3fn": 4,
    "e4m3": 4,
    "fp8_e5m2": 5,
    "float8_e5m2": 5,
    "e5m2": 5,
}


class DType(enum.IntEnum):
    """Element type of K and V; the value is the wire code (0 is never valid)."""

    FP32 = 1
    FP16 = 2
    BF16 = 3
    FP8_E4M3 = 4
    FP8_E5M2 = 5

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _ITEMSIZE[self.value]

    @property
    def numpy_storage(self) -> np.dtype[np.generic]:
        """The numpy dtype decoded arrays use: the real type for fp32/fp16, and the
        same-width unsigned integer (raw bits) for bf16 and fp8, which numpy lacks.
        Reinterpret those bits in torch with ``torch.from_numpy(a).view(torch.bfloat16)``.
        """
        return np.dtype(_STORAGE[self.value])

    @property
    def wire_name(self) -> str:
        """Canonical lower-case name (``fp16``, ``bf16``, ``fp8_e4m3``, ...)."""
        return self.name.lower()

    @classmethod
    def from_name(cls, name: str) -> DType:
        """Parse ``fp32``/``fp16``/``bf16``/``fp8``/``fp8_e4m3``/``fp8_e5m2`` and the numpy
        or torch spellings (``float16``, ``torch.bfloat16``, ...). ``fp8`` means E4M3."""
        key = name.strip().lower().removeprefix("torch.")
        if key not in _ALIASES:
            raise UnknownDType(
                f"unknown dtype {name!r}; expected one of fp32, fp16, bf16, fp8_e4m3, fp8_e5m2"
            )
        return cls(_ALIASES[key])

    @classmethod
    def from_code(cls, code: int) -> DType:
        """The dtype for a wire code; :class:`HeaderCorrupt` for an unknown code."""
        if code not in _ITEMSIZE:
            raise HeaderCorrupt(
                f"unknown dtype code {code} in header; known codes are "
                + ", ".join(f"{c}={cls(c).wire_name}" for c in sorted(_ITEMSIZE))
            )
        return cls(code)
