"""KV-cache element types and their sizes in bytes."""

from __future__ import annotations

from types import MappingProxyType
from typing import Final

from topkv.kv.errors import UnknownDtypeError

#: Bytes per element of each supported KV-cache dtype (``b_p`` in the paper's Eq. 1).
DTYPE_BYTES: Final = MappingProxyType({"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1})


def dtype_bytes(dtype: str) -> int:
    """Return bytes per element of ``dtype`` (case-insensitive), or raise UnknownDtypeError."""
    key = dtype.strip().lower()
    try:
        return DTYPE_BYTES[key]
    except KeyError:
        known = ", ".join(DTYPE_BYTES)
        raise UnknownDtypeError(f"unknown dtype {dtype!r}; expected one of: {known}") from None
