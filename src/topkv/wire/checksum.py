"""CRC-64/NVME checksums over buffers, without copies.

The variant is CRC-64/NVME (also called CRC-64/ROCKSOFT in some catalogs): polynomial
0xAD93D23594C93659, reflected input and output, initial value and final XOR
0xFFFFFFFFFFFFFFFF, check value (CRC of ASCII ``"123456789"``) 0xAE8B14860A799888. The
implementation is awscrt's (aws-c-checksums), which uses carry-less multiply instructions
where the CPU has them. The running value is chainable: ``crc64(b, crc64(a)) == crc64(a + b)``.
"""

from __future__ import annotations

from typing import Final

import numpy as np
from awscrt import checksums as _awscrt_checksums

from topkv.wire.errors import BufferLayoutError, WireError

CRC64_VARIANT: Final = "CRC-64/NVME"
CRC64_CHECK: Final = 0xAE8B14860A799888
"""CRC-64/NVME of ``b"123456789"``, the catalog check value."""

_U64_MAX: Final = (1 << 64) - 1
# Feed the C routine at most this many bytes per call, so that no binding's int-sized
# length parameter can overflow whatever the buffer size.
_CHUNK_BYTES: Final = 1 << 30


def contiguous_view(data: object, what: str = "buffer") -> memoryview:
    """A memoryview over ``data`` in its own format, after checking it is C-contiguous.

    Raises :class:`BufferLayoutError` for objects without the buffer protocol (including
    ``str``) and for non-C-contiguous buffers. Never copies.
    """
    if isinstance(data, str):
        raise BufferLayoutError(f"{what} is a str; pass bytes or an array, not text")
    try:
        view = memoryview(data)  # type: ignore[arg-type]
    except TypeError as exc:
        raise BufferLayoutError(
            f"{what} of type {type(data).__name__} does not expose the buffer protocol; "
            "pass bytes, a memoryview or a numpy array (torch: tensor.view(torch.uint8).numpy())"
        ) from exc
    if not view.c_contiguous:
        raise BufferLayoutError(
            f"{what} is not C-contiguous (shape {view.shape}, strides {view.strides}); "
            "make it contiguous first (numpy: np.ascontiguousarray) so it can be sent as is"
        )
    return view


def as_byte_view(data: object, what: str = "buffer") -> memoryview:
    """A flat, 1-byte-per-item memoryview over the same memory as ``data`` (no copy).

    ``data`` is anything C-contiguous exposing the buffer protocol: ``bytes``,
    ``bytearray``, ``memoryview``, ``mmap`` or a numpy array of any dtype.
    """
    view = contiguous_view(data, what)
    if view.format == "B" and view.ndim == 1:
        return view
    try:
        return view.cast("B")
    except (TypeError, ValueError) as exc:
        if isinstance(data, np.ndarray):
            # Non-native formats (big-endian, structured): numpy can still reinterpret.
            return data.reshape(-1).view(np.uint8).data
        raise BufferLayoutError(
            f"{what} with buffer format {view.format!r} cannot be viewed as bytes: {exc}"
        ) from exc


def crc64(data: object, crc: int = 0) -> int:
    """CRC-64/NVME of ``data``, continuing from a previous running value ``crc``.

    Works in place on any C-contiguous buffer (``bytes``, ``memoryview``, numpy array); the
    bytes are read once, never copied. Pass the previous result as ``crc`` to checksum a
    tensor that arrives in pieces.
    """
    if not 0 <= crc <= _U64_MAX:
        raise WireError(f"crc must be an unsigned 64-bit value, got {crc}")
    view = as_byte_view(data)
    size = view.nbytes
    if size <= _CHUNK_BYTES:
        return int(_awscrt_checksums.crc64nvme(view, crc))
    for start in range(0, size, _CHUNK_BYTES):
        crc = int(_awscrt_checksums.crc64nvme(view[start : start + _CHUNK_BYTES], crc))
    return crc
