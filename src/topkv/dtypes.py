"""The one table of KV element types: name, wire code, bytes per element.

Every layer reads this table: the wire format's :class:`topkv.wire.DType` (its codes are the
header's dtype byte, docs/wire-format.md), KV sizing (:func:`topkv.kv.dtype_bytes`), the
transports' :class:`~topkv.transport.base.KVLayout` and their transfer-open header. It sits
at the bottom of the layer order because ``wire`` and ``kv``, which both need it, are
siblings that must not import each other. Pure data: no imports from the rest of topkv.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final


@dataclass(frozen=True)
class ElementType:
    """One element type a KV cache can hold."""

    #: Canonical lower-case name (the wire format's ``DType.wire_name``).
    name: str
    #: The one-byte code every header on the stream carries (never 0).
    wire_code: int
    #: Bytes per element (``b_p`` in the paper's Eq. 1).
    itemsize: int
    #: numpy dtype string of a decoded array: the real type where numpy has one, else the
    #: unsigned integer of the same width (raw bits).
    numpy_storage: str
    #: The short name KV layouts and KV sizing use (``fp8`` is E4M3); None: wire format only.
    kv_name: str | None
    #: Other accepted spellings (numpy, torch, short forms), lower case.
    aliases: tuple[str, ...] = ()


FP32: Final = ElementType("fp32", 1, 4, "<f4", "fp32", ("float32", "float"))
FP16: Final = ElementType("fp16", 2, 2, "<f2", "fp16", ("float16", "half"))
BF16: Final = ElementType("bf16", 3, 2, "<u2", "bf16", ("bfloat16",))
FP8_E4M3: Final = ElementType("fp8_e4m3", 4, 1, "u1", "fp8", ("float8_e4m3fn", "e4m3"))
FP8_E5M2: Final = ElementType("fp8_e5m2", 5, 1, "u1", None, ("float8_e5m2", "e5m2"))

#: Every element type, in wire-code order.
ELEMENT_TYPES: Final = (FP32, FP16, BF16, FP8_E4M3, FP8_E5M2)

#: Wire code -> element type.
BY_WIRE_CODE: Final[Mapping[int, ElementType]] = MappingProxyType(
    {t.wire_code: t for t in ELEMENT_TYPES}
)

#: Every accepted spelling (canonical name, KV name, aliases) -> element type.
BY_NAME: Final[Mapping[str, ElementType]] = MappingProxyType(
    {name: t for t in ELEMENT_TYPES for name in (t.name, t.kv_name, *t.aliases) if name}
)

#: The KV layouts' dtype names (``fp32``, ``fp16``, ``bf16``, ``fp8``) -> element type.
KV_DTYPES: Final[Mapping[str, ElementType]] = MappingProxyType(
    {t.kv_name: t for t in ELEMENT_TYPES if t.kv_name is not None}
)
