"""KV-cache wire format: a fixed 128-byte header, then K and V, checksummed with CRC-64/NVME.

See ``docs/wire-format.md`` for the byte table. Typical use::

    frame = encode_kv(k, v, request_id="req-1", model_id=7, dtype="fp16",
                      seq_len=4096, layers=80, kv_heads=8, head_dim=128)
    sock.sendmsg(frame.buffers)                      # header + K + V, no copies

    header = unpack_header(first_128_bytes, limits)  # untrusted: checked before allocating
    payload = bytearray(expected_payload_bytes(header))
    ...receive into payload...
    decoded = decode_payload(header, payload)        # verifies sizes and CRCs
    k = decoded.k_array()                            # numpy view, shape [L][S][H][D]
"""

from topkv.wire.checksum import CRC64_CHECK, CRC64_VARIANT, as_byte_view, crc64
from topkv.wire.dtypes import DType
from topkv.wire.errors import (
    BadMagic,
    BufferLayoutError,
    FrameChecksumMismatch,
    HeaderCorrupt,
    SizeLimitExceeded,
    SizeMismatch,
    TruncatedFrame,
    UnknownDType,
    UnsupportedVersion,
    WireError,
)
from topkv.wire.frame import (
    DecodedFrame,
    EncodedFrame,
    checksum_tensors,
    decode_frame,
    decode_kv,
    decode_layer_frame,
    decode_payload,
    encode_kv,
    encode_layer_frame,
    verify_payload,
)
from topkv.wire.header import (
    HEADER_SIZE,
    HEADER_STRUCT,
    MAGIC,
    WIRE_VERSION,
    Flags,
    FrameHeader,
    KVHeader,
    LayerFrameHeader,
    expected_payload_bytes,
    model_id_for,
    request_key,
    unpack_header,
)
from topkv.wire.limits import DEFAULT_LIMITS, WireLimits

__all__ = [
    "CRC64_CHECK",
    "CRC64_VARIANT",
    "DEFAULT_LIMITS",
    "HEADER_SIZE",
    "HEADER_STRUCT",
    "MAGIC",
    "WIRE_VERSION",
    "BadMagic",
    "BufferLayoutError",
    "DType",
    "DecodedFrame",
    "EncodedFrame",
    "Flags",
    "FrameChecksumMismatch",
    "FrameHeader",
    "HeaderCorrupt",
    "KVHeader",
    "LayerFrameHeader",
    "SizeLimitExceeded",
    "SizeMismatch",
    "TruncatedFrame",
    "UnknownDType",
    "UnsupportedVersion",
    "WireError",
    "WireLimits",
    "as_byte_view",
    "checksum_tensors",
    "crc64",
    "decode_frame",
    "decode_kv",
    "decode_layer_frame",
    "decode_payload",
    "encode_kv",
    "encode_layer_frame",
    "expected_payload_bytes",
    "model_id_for",
    "request_key",
    "unpack_header",
    "verify_payload",
]
