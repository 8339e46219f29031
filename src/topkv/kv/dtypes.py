"""Bytes per element of a KV-cache dtype, read from the one table (:mod:`topkv.dtypes`)."""

from __future__ import annotations

from topkv.dtypes import KV_DTYPES
from topkv.kv.errors import UnknownDtypeError


def dtype_bytes(dtype: str) -> int:
    """Bytes per element (``b_p`` in the paper's Eq. 1) of the KV dtype ``dtype``
    (``fp32``, ``fp16``, ``bf16``, ``fp8``; case-insensitive), or raise UnknownDtypeError."""
    key = dtype.strip().lower()
    if key not in KV_DTYPES:
        known = ", ".join(KV_DTYPES)
        raise UnknownDtypeError(f"unknown dtype {dtype!r}; expected one of: {known}")
    return KV_DTYPES[key].itemsize
