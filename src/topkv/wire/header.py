"""The fixed 128-byte little-endian frame header, shared by full and per-layer frames.

Byte layout (``HEADER_STRUCT``, format ``<8sHHB3s16sIIIIIIQQQQ32sQ``)::

    off  size  type      field
      0     8  bytes     magic, b"KVCACHE1"
      8     2  u16       format version (1)
     10     2  u16       flags: bit 0 MLA (single latent tensor), bit 1 per-layer frame
     12     1  u8        dtype code (1 fp32, 2 fp16, 3 bf16, 4 fp8_e4m3, 5 fp8_e5m2)
     13     3  bytes     reserved, zero
     16    16  bytes     request key: BLAKE2b-128 of the UTF-8 request id
     32     4  u32       model id
     36     4  u32       seq_len (tokens)
     40     4  u32       layers (total layers of the model's KV cache)
     44     4  u32       layer index (0 in a full frame)
     48     4  u32       kv_heads
     52     4  u32       head_dim
     56     8  u64       K byte size
     64     8  u64       V byte size (0 with the MLA flag)
     72     8  u64       CRC-64/NVME of K
     80     8  u64       CRC-64/NVME of V (0 with the MLA flag)
     88    32  bytes     reserved, zero
    120     8  u64       CRC-64/NVME of bytes 0..119 of this header

The payload follows: K, then V, each laid out [layers][seq_len][kv_heads][head_dim] in a
full frame and [seq_len][kv_heads][head_dim] in a per-layer frame.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Self

from topkv.wire.checksum import as_byte_view, crc64
from topkv.wire.dtypes import DType
from topkv.wire.errors import (
    BadMagic,
    FrameChecksumMismatch,
    HeaderCorrupt,
    SizeLimitExceeded,
    SizeMismatch,
    TruncatedFrame,
    UnsupportedVersion,
)
from topkv.wire.limits import DEFAULT_LIMITS, WireLimits

MAGIC: Final = b"KVCACHE1"
WIRE_VERSION: Final = 1
HEADER_SIZE: Final = 128
HEADER_STRUCT: Final = struct.Struct("<8sHHB3s16sIIIIIIQQQQ32sQ")
HEADER_CRC_OFFSET: Final = 120
REQUEST_KEY_SIZE: Final = 16
#: Where the request key sits in an encoded header (a sink routes a frame by it unparsed).
REQUEST_KEY_OFFSET: Final = 16
REQUEST_KEY_END: Final = REQUEST_KEY_OFFSET + REQUEST_KEY_SIZE

_U32_MAX: Final = (1 << 32) - 1
_U64_MAX: Final = (1 << 64) - 1
_ZERO3: Final = bytes(3)
_ZERO32: Final = bytes(32)

assert HEADER_STRUCT.size == HEADER_SIZE


class Flags(enum.IntFlag):
    """Header flag bits; any other bit set makes a version-1 header corrupt."""

    NONE = 0
    MLA = 1
    """One latent tensor (K); V is absent (V size 0, V CRC 0)."""
    LAYER_FRAME = 2
    """The frame carries one layer (``layer_index`` of ``layers``), not the whole cache."""


KNOWN_FLAGS: Final = Flags.MLA | Flags.LAYER_FRAME


def request_key(request_id: str) -> bytes:
    """The 16-byte key a frame carries for ``request_id``: BLAKE2b with a 16-byte digest of
    its UTF-8 encoding. Receivers compare ``header.request_key == request_key(expected)``."""
    if not isinstance(request_id, str) or not request_id:
        raise HeaderCorrupt(f"request id must be a non-empty string, got {request_id!r}")
    return hashlib.blake2b(request_id.encode("utf-8"), digest_size=REQUEST_KEY_SIZE).digest()


def model_id_for(model_name: str) -> int:
    """A stable u32 model id for a model name (first 4 bytes of its BLAKE2b digest, little
    endian), for deployments that have no numeric model registry."""
    if not isinstance(model_name, str) or not model_name:
        raise HeaderCorrupt(f"model name must be a non-empty string, got {model_name!r}")
    digest = hashlib.blake2b(model_name.encode("utf-8"), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def _require_uint(name: str, value: object, maximum: int, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise HeaderCorrupt(
            f"header field {name} must be an integer in [{minimum}, {maximum}], got {value!r}"
        )
    return value


@dataclass(frozen=True, kw_only=True)
class FrameHeader:
    """Fields common to full and per-layer frame headers (use the subclasses).

    Constructing a header checks that every field fits its wire type and that the byte
    sizes equal the dimensions times the dtype size; limits are checked by :meth:`unpack`
    and :meth:`check_limits`.
    """

    request_key: bytes
    model_id: int
    dtype: DType
    seq_len: int
    layers: int
    kv_heads: int
    head_dim: int
    k_bytes: int
    v_bytes: int
    k_crc: int
    v_crc: int
    mla: bool = False

    _layer_frame: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not isinstance(self.request_key, bytes) or len(self.request_key) != REQUEST_KEY_SIZE:
            raise HeaderCorrupt(
                f"request_key must be {REQUEST_KEY_SIZE} bytes (use request_key(id)), "
                f"got {self.request_key!r}"
            )
        if not isinstance(self.dtype, DType):
            raise HeaderCorrupt(f"dtype must be a DType, got {self.dtype!r}")
        if not isinstance(self.mla, bool):
            raise HeaderCorrupt(f"mla must be a bool, got {self.mla!r}")
        _require_uint("model_id", self.model_id, _U32_MAX)
        for name in ("seq_len", "layers", "kv_heads", "head_dim"):
            _require_uint(name, getattr(self, name), _U32_MAX, minimum=1)
        for name in ("k_bytes", "v_bytes", "k_crc", "v_crc"):
            _require_uint(name, getattr(self, name), _U64_MAX)
        expected = self.tensor_bytes
        if self.k_bytes != expected:
            raise SizeMismatch(
                f"K size {self.k_bytes} bytes disagrees with dims "
                f"{'x'.join(map(str, self.tensor_shape))} x {self.dtype.itemsize} bytes "
                f"({self.dtype.wire_name}) = {expected}"
            )
        if self.mla:
            if self.v_bytes != 0:
                raise SizeMismatch(f"an MLA frame has no V tensor, but V size is {self.v_bytes}")
            if self.v_crc != 0:
                raise HeaderCorrupt(f"an MLA frame has no V tensor, but V CRC is {self.v_crc:#x}")
        elif self.v_bytes != expected:
            raise SizeMismatch(
                f"V size {self.v_bytes} bytes disagrees with dims "
                f"{'x'.join(map(str, self.tensor_shape))} x {self.dtype.itemsize} bytes "
                f"({self.dtype.wire_name}) = {expected}"
            )

    @property
    def tensor_shape(self) -> tuple[int, ...]:
        """Shape of K (and V): [layers][seq_len][kv_heads][head_dim] for a full frame."""
        return (self.layers, self.seq_len, self.kv_heads, self.head_dim)

    @property
    def tensor_bytes(self) -> int:
        """Bytes in K (and in V unless MLA), from the dimensions and dtype."""
        size = self.dtype.itemsize
        for dim in self.tensor_shape:
            size *= dim
        return size

    @property
    def payload_bytes(self) -> int:
        """Bytes that follow the header: K plus V."""
        return self.k_bytes + self.v_bytes

    @property
    def frame_bytes(self) -> int:
        """Header plus payload."""
        return HEADER_SIZE + self.payload_bytes

    @property
    def flags(self) -> Flags:
        flags = Flags.NONE
        if self.mla:
            flags |= Flags.MLA
        if self._layer_frame:
            flags |= Flags.LAYER_FRAME
        return flags

    def _layer_index(self) -> int:
        return 0

    def pack(self) -> bytes:
        """The 128 header bytes, header CRC included."""
        body = HEADER_STRUCT.pack(
            MAGIC,
            WIRE_VERSION,
            int(self.flags),
            int(self.dtype),
            _ZERO3,
            self.request_key,
            self.model_id,
            self.seq_len,
            self.layers,
            self._layer_index(),
            self.kv_heads,
            self.head_dim,
            self.k_bytes,
            self.v_bytes,
            self.k_crc,
            self.v_crc,
            _ZERO32,
            0,
        )
        return body[:HEADER_CRC_OFFSET] + crc64(body[:HEADER_CRC_OFFSET]).to_bytes(8, "little")

    def check_limits(self, limits: WireLimits = DEFAULT_LIMITS) -> None:
        """Raise :class:`SizeLimitExceeded` if any field is over ``limits``."""
        _check_limits(limits, {name: getattr(self, name) for name in _CAPS})

    @classmethod
    def unpack(cls, buf: object, limits: WireLimits = DEFAULT_LIMITS) -> Self:
        """Parse and validate the first 128 bytes of ``buf`` (untrusted).

        Checks, in order: length, magic, version, header CRC, reserved bytes, flags, dtype,
        frame kind, limits, then size consistency. Raises the matching :class:`WireError`.
        """
        header = unpack_header(buf, limits)
        if not isinstance(header, cls):
            raise HeaderCorrupt(
                f"expected a {cls.__name__} but the frame is a {type(header).__name__} "
                f"(flags {int(header.flags):#06x}); use the matching decoder"
            )
        return header


@dataclass(frozen=True, kw_only=True)
class KVHeader(FrameHeader):
    """Header of a full frame: every layer's K, then every layer's V."""


@dataclass(frozen=True, kw_only=True)
class LayerFrameHeader(FrameHeader):
    """Header of a per-layer streaming frame: layer ``layer_index`` of ``layers`` total.

    K and V are that one layer's tensors, laid out [seq_len][kv_heads][head_dim].
    """

    layer_index: int

    _layer_frame: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _require_uint("layer_index", self.layer_index, _U32_MAX)
        if not isinstance(self.layers, int) or self.layer_index >= self.layers:
            raise HeaderCorrupt(
                f"layer index {self.layer_index} is out of range for {self.layers!r} layers"
            )
        FrameHeader.__post_init__(self)

    @property
    def tensor_shape(self) -> tuple[int, ...]:
        """Shape of this layer's K (and V): [seq_len][kv_heads][head_dim]."""
        return (self.seq_len, self.kv_heads, self.head_dim)

    def _layer_index(self) -> int:
        return self.layer_index


#: Every header field a receiver caps, and the :class:`WireLimits` attribute capping it
#: (checked in this order).
_CAPS: Final = {
    "layers": "max_layers",
    "seq_len": "max_seq_len",
    "kv_heads": "max_kv_heads",
    "head_dim": "max_head_dim",
    "k_bytes": "max_tensor_bytes",
    "v_bytes": "max_tensor_bytes",
}


def _check_limits(limits: WireLimits, fields: Mapping[str, int]) -> None:
    """Raise :class:`SizeLimitExceeded` for the first of the :data:`_CAPS` fields of
    ``fields`` over its cap in ``limits``."""
    for name, limit in _CAPS.items():
        value, cap = fields[name], getattr(limits, limit)
        if value > cap:
            raise SizeLimitExceeded(
                f"header field {name}={value} exceeds the receiver's limit {cap} "
                "(raise it in WireLimits if this frame is legitimate)"
            )


def unpack_header(buf: object, limits: WireLimits = DEFAULT_LIMITS) -> KVHeader | LayerFrameHeader:
    """Parse the header at the start of ``buf``, whichever kind of frame it starts.

    ``buf`` may be longer than 128 bytes (only the first 128 are read) and is not copied
    beyond those bytes. Nothing is allocated from the header's fields.
    """
    view = as_byte_view(buf, "header buffer")
    if view.nbytes < HEADER_SIZE:
        raise TruncatedFrame(f"frame header needs {HEADER_SIZE} bytes, only {view.nbytes} arrived")
    raw = bytes(view[:HEADER_SIZE])
    if raw[:8] != MAGIC:
        raise BadMagic(f"bad magic {raw[:8]!r}, expected {MAGIC!r}: not a TopKV KV frame")
    (
        _magic,
        version,
        flag_bits,
        dtype_code,
        reserved0,
        req_key,
        model_id,
        seq_len,
        layers,
        layer_index,
        kv_heads,
        head_dim,
        k_bytes,
        v_bytes,
        k_crc,
        v_crc,
        reserved1,
        header_crc,
    ) = HEADER_STRUCT.unpack(raw)
    if version != WIRE_VERSION:
        raise UnsupportedVersion(
            f"frame format version {version} is not supported (this build speaks version "
            f"{WIRE_VERSION}); upgrade the older side"
        )
    actual_crc = crc64(raw[:HEADER_CRC_OFFSET])
    if actual_crc != header_crc:
        raise FrameChecksumMismatch("header", header_crc, actual_crc)
    if reserved0 != _ZERO3 or reserved1 != _ZERO32:
        raise HeaderCorrupt("reserved header bytes are not zero in a version-1 frame")
    if flag_bits & ~int(KNOWN_FLAGS):
        raise HeaderCorrupt(
            f"unknown flag bits {flag_bits & ~int(KNOWN_FLAGS):#06x} in a version-1 frame"
        )
    flags = Flags(flag_bits)
    dtype = DType.from_code(dtype_code)
    common: dict[str, Any] = {
        "request_key": req_key,
        "model_id": model_id,
        "dtype": dtype,
        "seq_len": seq_len,
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "k_bytes": k_bytes,
        "v_bytes": v_bytes,
        "k_crc": k_crc,
        "v_crc": v_crc,
        "mla": bool(flags & Flags.MLA),
    }
    _check_limits(limits, common)
    if flags & Flags.LAYER_FRAME:
        return LayerFrameHeader(layer_index=layer_index, **common)
    if layer_index != 0:
        raise HeaderCorrupt(f"a full frame must have layer index 0, got {layer_index}")
    return KVHeader(**common)


def expected_payload_bytes(
    header: FrameHeader | bytes | bytearray | memoryview, limits: WireLimits = DEFAULT_LIMITS
) -> int:
    """Validate a header before its payload arrives and return how many payload bytes follow.

    Pass the 128 received header bytes (or an already parsed header); the result has been
    checked against ``limits`` and the dims, so a receiver can allocate exactly that much.
    """
    if isinstance(header, FrameHeader):
        header.check_limits(limits)
        return header.payload_bytes
    return unpack_header(header, limits).payload_bytes


__all__ = [
    "HEADER_SIZE",
    "HEADER_STRUCT",
    "MAGIC",
    "WIRE_VERSION",
    "Flags",
    "FrameHeader",
    "KVHeader",
    "LayerFrameHeader",
    "expected_payload_bytes",
    "model_id_for",
    "request_key",
    "unpack_header",
]
