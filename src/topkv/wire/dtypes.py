"""Element types a KV frame can carry, with their one-byte wire codes.

The codes, sizes and names come from the one table, :mod:`topkv.dtypes`; this module is the
wire format's view of it (:class:`DType`, whose values are the header's dtype byte).
"""

from __future__ import annotations

import enum

import numpy as np

from topkv import dtypes as element_types
from topkv.wire.errors import HeaderCorrupt, UnknownDType


class DType(enum.IntEnum):
    """Element type of K and V; the value is the wire code (0 is never valid)."""

    FP32 = element_types.FP32.wire_code
    FP16 = element_types.FP16.wire_code
    BF16 = element_types.BF16.wire_code
    FP8_E4M3 = element_types.FP8_E4M3.wire_code
    FP8_E5M2 = element_types.FP8_E5M2.wire_code

    @property
    def element_type(self) -> element_types.ElementType:
        """This dtype's row of the one table (:mod:`topkv.dtypes`)."""
        return element_types.BY_WIRE_CODE[self.value]

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.element_type.itemsize

    @property
    def numpy_storage(self) -> np.dtype[np.generic]:
        """The numpy dtype decoded arrays use: the real type for fp32/fp16, and the
        same-width unsigned integer (raw bits) for bf16 and fp8, which numpy lacks.
        Reinterpret those bits in torch with ``torch.from_numpy(a).view(torch.bfloat16)``.
        """
        return np.dtype(self.element_type.numpy_storage)

    @property
    def wire_name(self) -> str:
        """Canonical lower-case name (``fp16``, ``bf16``, ``fp8_e4m3``, ...)."""
        return self.element_type.name

    @classmethod
    def from_name(cls, name: str) -> DType:
        """Parse ``fp32``/``fp16``/``bf16``/``fp8``/``fp8_e4m3``/``fp8_e5m2`` and the numpy
        or torch spellings (``float16``, ``torch.bfloat16``, ...). ``fp8`` means E4M3."""
        key = name.strip().lower().removeprefix("torch.")
        if key not in element_types.BY_NAME:
            known = ", ".join(t.name for t in element_types.ELEMENT_TYPES)
            raise UnknownDType(f"unknown dtype {name!r}; expected one of {known}")
        return cls(element_types.BY_NAME[key].wire_code)

    @classmethod
    def from_code(cls, code: int) -> DType:
        """The dtype for a wire code; :class:`HeaderCorrupt` for an unknown code."""
        if code not in element_types.BY_WIRE_CODE:
            raise HeaderCorrupt(
                f"unknown dtype code {code} in header; known codes are "
                + ", ".join(f"{t.wire_code}={t.name}" for t in element_types.ELEMENT_TYPES)
            )
        return cls(code)
