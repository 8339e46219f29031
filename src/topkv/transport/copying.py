"""Copying a tensor into shared memory, with or without the CRC-64 of its source.

Two implementations behind one pair of functions:

* **native** (``topkv._copycrc``, a small C extension built at install): one pass per
  64-byte block — load, fold into the CRC, non-temporal store — with the GIL released. The
  CRC costs no extra trip to memory and the destination is not read into the cache first,
  so copy + CRC runs at about one ``memcpy``'s speed.
* **fallback** (awscrt + numpy): each chunk of the source is checksummed and then copied
  while it is still in the core's cache (two library calls per chunk). Used when the
  extension is not built (no C compiler at install), when the CPU lacks PCLMULQDQ, or when
  ``TOPKV_NATIVE_COPY=0`` is set (for comparisons).

Both return the CRC of the **source**, not of the destination: the receiver's check of the
destination then also proves that the copy itself was right (end to end).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType

import numpy as np

from topkv.wire.checksum import crc64

#: Bytes per step of the fallback: small enough that the chunk is still in the core's L2
#: cache when it is copied right after its CRC was computed.
COPY_CHUNK = 1 << 20


def _load_native() -> tuple[ModuleType | None, str]:
    """The C extension if usable, and why not otherwise."""
    if os.environ.get("TOPKV_NATIVE_COPY", "1") == "0":
        return None, "disabled by TOPKV_NATIVE_COPY=0"
    try:
        from topkv import _copycrc  # type: ignore[attr-defined]
    except ImportError as exc:
        return None, f"extension not built ({exc}); reinstall with a C compiler present"
    if not _copycrc.SIMD:
        return None, "this CPU lacks PCLMULQDQ/SSE4.1; awscrt + numpy are faster"
    return _copycrc, "native"


_native, NATIVE_STATUS = _load_native()
#: True when copies go through the fused C extension.
NATIVE = _native is not None
#: The extension's implementation level: 2 AVX-512 VPCLMULQDQ, 1 PCLMULQDQ, None if unused.
NATIVE_LEVEL: int | None = _native.LEVEL if _native is not None else None

# Seams: tests replace these to simulate a copy that goes wrong after the CRC was taken.

_native_copy_crc: Callable[[memoryview, memoryview, int], int] | None = (
    _native.copy_crc64 if _native is not None else None
)
_native_copy: Callable[[memoryview, memoryview], None] | None = (
    _native.copy if _native is not None else None
)


def copy_path() -> str:
    """Which implementation copies: ``native-avx512``, ``native-pclmul`` or ``fallback``."""
    if NATIVE_LEVEL is None:
        return "fallback"
    return "native-avx512" if NATIVE_LEVEL >= 2 else "native-pclmul"


def _copy_chunk(dst: np.ndarray, src: np.ndarray) -> None:
    """Fallback: copy one chunk (numpy, GIL released)."""
    np.copyto(dst, src)


def copy_with_crc(dst: memoryview, src: memoryview, chunk: int = COPY_CHUNK) -> int:
    """Copy ``src`` into ``dst`` (same size) and return the CRC-64/NVME of the *source*."""
    if _native_copy_crc is not None:
        return _native_copy_crc(dst, src, 0)
    source = np.frombuffer(src, dtype=np.uint8)
    target = np.frombuffer(dst, dtype=np.uint8)
    crc = 0
    for start in range(0, source.size, chunk):
        piece = source[start : start + chunk]
        crc = crc64(piece, crc)
        _copy_chunk(target[start : start + chunk], piece)
    return crc


def copy_into(dst: memoryview, src: memoryview) -> None:
    """Copy without a checksum (native streaming copy, else numpy; GIL released)."""
    if _native_copy is not None:
        _native_copy(dst, src)
        return
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
