"""The one place where transports encode and decode frames and compute checksums.

Three fixed-size records travel on a transport's stream (TCP connection, shm control
socket): the transfer header (opens a transfer), the per-layer frame header (followed by the
tensor bytes on TCP; pointing into the segment on shm) and a control record (acks, errors,
cancellation, shm segment management). Every decoder checks sizes against
:class:`ReceiveLimits` *before* the caller allocates anything.

Per-layer frames are the wire format's (:mod:`topkv.wire`) ``LayerFrameHeader`` followed by
K and V; the transfer-open and control records are transport-level. Both headers name the
dtype by its wire code (:mod:`topkv.dtypes`, the one table; docs/wire-format.md), at the same
offset 12. CRC-64/NVME from
:mod:`topkv.wire` is the checksum; :func:`crc64` continues a
running value so verification streams over received chunks.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from topkv import wire
from topkv.dtypes import BY_WIRE_CODE, KV_DTYPES
from topkv.transport.base import KVLayout, TransferDescriptor
from topkv.transport.errors import FrameRejected

TRANSFER_MAGIC = b"KVOPEN01"
CONTROL_MAGIC = b"TKVCTRL1"
MAGIC_SIZE = 8
PROTOCOL_VERSION = 1

_FLAG_LATENT = 1
MODEL_ID_MAX = 48

# magic, version, flags, dtype, streams, request_id, seq_len, layers, kv_heads, head_dim,
# tensor_bytes, model_id
_TRANSFER = struct.Struct("<8sHHBxHQIIIIQ48s")
TRANSFER_HEADER_SIZE = 128
_TRANSFER_PAD = TRANSFER_HEADER_SIZE - _TRANSFER.size

# magic, kind, status, reserved, request_id, arg0, arg1, text_len
_CONTROL = struct.Struct("<8sBBHIQQQI")
CONTROL_HEADER_SIZE = 64
_CONTROL_PAD = CONTROL_HEADER_SIZE - _CONTROL.size
CONTROL_TEXT_MAX = 512


def crc64(data: object, previous: int = 0) -> int:
    """CRC-64/NVME of ``data`` (any buffer), continuing from ``previous`` (topkv.wire)."""
    return wire.crc64(data, previous)


@dataclass(frozen=True)
class ReceiveLimits:
    """Bounds applied to untrusted headers before any allocation."""

    max_transfer_bytes: int = 64 << 30
    max_layers: int = 4096
    max_streams: int = 64

    def check(self, descriptor: TransferDescriptor) -> None:
        layout = descriptor.layout
        if layout.num_layers > self.max_layers:
            raise FrameRejected(
                f"transfer {descriptor.request_id}: {layout.num_layers} layers exceeds the "
                f"limit of {self.max_layers}"
            )
        if layout.total_bytes > self.max_transfer_bytes:
            raise FrameRejected(
                f"transfer {descriptor.request_id}: {layout.total_bytes} bytes exceeds the "
                f"receive limit of {self.max_transfer_bytes} bytes"
            )


def validate_layout(layout: KVLayout) -> None:
    """Reject layouts that cannot describe a real KV cache."""
    if layout.dtype not in KV_DTYPES:
        raise FrameRejected(f"unknown dtype {layout.dtype!r}; known: {sorted(KV_DTYPES)}")
    for name in ("num_layers", "seq_len", "kv_heads", "head_dim"):
        value = getattr(layout, name)
        if value <= 0:
            raise FrameRejected(f"layout field {name} must be positive, got {value}")


# -- transfer header -------------------------------------------------------------------------


def encode_transfer_header(descriptor: TransferDescriptor, streams: int = 1) -> bytes:
    layout = descriptor.layout
    validate_layout(layout)
    model = descriptor.model_id.encode()
    if len(model) > MODEL_ID_MAX:
        raise FrameRejected(f"model id longer than {MODEL_ID_MAX} bytes: {descriptor.model_id!r}")
    return (
        _TRANSFER.pack(
            TRANSFER_MAGIC,
            PROTOCOL_VERSION,
            _FLAG_LATENT if layout.latent else 0,
            KV_DTYPES[layout.dtype].wire_code,
            streams,
            descriptor.request_id,
            layout.seq_len,
            layout.num_layers,
            layout.kv_heads,
            layout.head_dim,
            layout.tensor_bytes,
            model,
        )
        + b"\0" * _TRANSFER_PAD
    )


def decode_transfer_header(
    data: bytes | memoryview, limits: ReceiveLimits
) -> tuple[TransferDescriptor, int]:
    """Decode and validate a transfer header; returns (descriptor, stream count)."""
    if len(data) != TRANSFER_HEADER_SIZE:
        raise FrameRejected(f"transfer header must be {TRANSFER_HEADER_SIZE} bytes")
    (
        magic,
        version,
        flags,
        dtype_code,
        streams,
        request_id,
        seq_len,
        layers,
        kv_heads,
        head_dim,
        tensor_bytes,
        model,
    ) = _TRANSFER.unpack_from(data)
    if magic != TRANSFER_MAGIC:
        raise FrameRejected(f"bad transfer magic {magic!r}")
    if version != PROTOCOL_VERSION:
        raise FrameRejected(f"unsupported protocol version {version}")
    element_type = BY_WIRE_CODE.get(dtype_code)
    if element_type is None or element_type.kv_name is None:
        raise FrameRejected(f"unknown dtype code {dtype_code}")
    if not 1 <= streams <= limits.max_streams:
        raise FrameRejected(f"stream count {streams} outside 1..{limits.max_streams}")
    layout = KVLayout(
        num_layers=layers,
        seq_len=seq_len,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=element_type.kv_name,
        latent=bool(flags & _FLAG_LATENT),
    )
    validate_layout(layout)
    if layout.tensor_bytes != tensor_bytes:
        raise FrameRejected(
            f"header says {tensor_bytes} bytes per tensor but its shape gives {layout.tensor_bytes}"
        )
    try:
        model_id = model.rstrip(b"\0").decode()
    except UnicodeDecodeError as exc:
        raise FrameRejected("model id is not UTF-8") from exc
    descriptor = TransferDescriptor(request_id=request_id, model_id=model_id, layout=layout)
    limits.check(descriptor)
    return descriptor, streams


# -- layer frame header (the wire format's per-layer frame) ---------------------------------

LAYER_MAGIC = wire.MAGIC
LAYER_HEADER_SIZE = wire.HEADER_SIZE


@dataclass(frozen=True)
class LayerHeader:
    """What a transport needs from a per-layer frame header."""

    request_id: int
    layer: int
    tensor_bytes: int
    crcs: tuple[int, ...]


def encode_layer_header(descriptor: TransferDescriptor, layer: int, crcs: tuple[int, ...]) -> bytes:
    """The wire format's 128-byte per-layer frame header (:class:`wire.LayerFrameHeader`)."""
    layout = descriptor.layout
    try:
        header = wire.LayerFrameHeader(
            request_key=wire.request_key(str(descriptor.request_id)),
            model_id=wire.model_id_for(descriptor.model_id),
            dtype=_wire_dtype(layout),
            seq_len=layout.seq_len,
            layers=layout.num_layers,
            layer_index=layer,
            kv_heads=layout.kv_heads,
            head_dim=layout.head_dim,
            k_bytes=layout.tensor_bytes,
            v_bytes=0 if layout.latent else layout.tensor_bytes,
            k_crc=crcs[0],
            v_crc=0 if layout.latent else crcs[1],
            mla=layout.latent,
        )
    except wire.WireError as exc:
        raise FrameRejected(f"cannot encode layer {layer}: {exc}") from exc
    return header.pack()


def decode_layer_header(data: bytes | memoryview, descriptor: TransferDescriptor) -> LayerHeader:
    """Decode an untrusted per-layer frame header and check it belongs to ``descriptor``."""
    layout = descriptor.layout
    try:
        header = wire.LayerFrameHeader.unpack(data, _wire_limits(layout))
    except wire.WireError as exc:
        raise FrameRejected(f"bad layer frame header: {exc}") from exc
    if header.request_key != wire.request_key(str(descriptor.request_id)):
        raise FrameRejected(f"layer frame for another request on transfer {descriptor.request_id}")
    expected = (
        layout.num_layers,
        layout.seq_len,
        layout.kv_heads,
        layout.head_dim,
        _wire_dtype(layout),
        layout.latent,
    )
    got = (
        header.layers,
        header.seq_len,
        header.kv_heads,
        header.head_dim,
        header.dtype,
        header.mla,
    )
    if got != expected:
        raise FrameRejected(
            f"layer {header.layer_index} frame shape {got} disagrees with the transfer {expected}"
        )
    crcs = (header.k_crc,) if layout.latent else (header.k_crc, header.v_crc)
    return LayerHeader(descriptor.request_id, header.layer_index, header.k_bytes, crcs)


def _wire_dtype(layout: KVLayout) -> wire.DType:
    """The wire format's dtype of a layout (the same wire code as the transfer header's)."""
    return wire.DType.from_code(KV_DTYPES[layout.dtype].wire_code)


def _wire_limits(layout: KVLayout) -> wire.WireLimits:
    """Per-transfer limits: a layer frame may not exceed the shape already accepted."""
    return wire.WireLimits(
        max_tensor_bytes=layout.tensor_bytes,
        max_layers=layout.num_layers,
        max_seq_len=layout.seq_len,
        max_kv_heads=layout.kv_heads,
        max_head_dim=layout.head_dim,
    )


# -- control records -------------------------------------------------------------------------


class ControlKind(enum.IntEnum):
    ACK = 1  # receiver -> sender: transfer received and verified (status=OK) or failed
    CANCEL = 2  # either way: abort request_id
    SEGMENT = 3  # shm sender -> receiver: map segment arg0 (id) of arg1 bytes; text = name
    SEGMENT_MAPPED = 4  # shm receiver -> sender: segment arg0 is mapped (name may go)
    USE_SEGMENT = 7  # shm sender -> receiver: request_id's layers are in segment arg0
    RELEASE = 5  # shm receiver -> sender: segment arg0 may be reused
    DONE = 6  # sender -> receiver: every layer of request_id has been sent on this stream


class ControlStatus(enum.IntEnum):
    OK = 0
    CHECKSUM = 1
    REJECTED = 2
    CANCELLED = 3
    ERROR = 4


@dataclass(frozen=True)
class Control:
    kind: ControlKind
    request_id: int = 0
    status: ControlStatus = ControlStatus.OK
    arg0: int = 0
    arg1: int = 0
    text: str = ""


def encode_control(control: Control) -> bytes:
    text = control.text.encode()[:CONTROL_TEXT_MAX]
    return (
        _CONTROL.pack(
            CONTROL_MAGIC,
            control.kind,
            control.status,
            0,
            0,
            control.request_id,
            control.arg0,
            control.arg1,
            len(text),
        )
        + b"\0" * _CONTROL_PAD
        + text
    )


def decode_control_header(data: bytes | memoryview) -> tuple[Control, int]:
    """Decode a control header; returns (control without text, text length to read)."""
    if len(data) != CONTROL_HEADER_SIZE:
        raise FrameRejected(f"control header must be {CONTROL_HEADER_SIZE} bytes")
    magic, kind, status, _r, _r2, request_id, arg0, arg1, text_len = _CONTROL.unpack_from(data)
    if magic != CONTROL_MAGIC:
        raise FrameRejected(f"bad control magic {magic!r}")
    if text_len > CONTROL_TEXT_MAX:
        raise FrameRejected(f"control text of {text_len} bytes exceeds {CONTROL_TEXT_MAX}")
    try:
        control = Control(ControlKind(kind), request_id, ControlStatus(status), arg0, arg1)
    except ValueError as exc:
        raise FrameRejected(f"unknown control kind/status {kind}/{status}") from exc
    return control, text_len
