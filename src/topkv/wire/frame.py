"""Encode and decode KV frames without copying tensor bytes.

Sending: :func:`encode_kv` / :func:`encode_layer_frame` checksum the caller's tensors in
place and return an :class:`EncodedFrame` whose ``buffers`` (header bytes, then memoryviews
of K and V) can go straight to ``socket.sendmsg`` or any scatter-gather writer.

Receiving a whole frame: :func:`decode_kv` / :func:`decode_layer_frame` / :func:`decode_frame`
validate the header, check sizes and CRCs and return memoryviews (or numpy views) into the
received buffer.

Receiving in two steps (header, then payload into a buffer sized from the header): parse
the first 128 bytes with :func:`unpack_header`, allocate :func:`expected_payload_bytes`,
receive into it, then call :func:`decode_payload` (one buffer) or :func:`verify_payload`
(separate K and V buffers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt

from topkv.wire.checksum import as_byte_view, contiguous_view, crc64
from topkv.wire.dtypes import DType
from topkv.wire.errors import FrameChecksumMismatch, SizeMismatch, TruncatedFrame
from topkv.wire.header import (
    HEADER_SIZE,
    FrameHeader,
    KVHeader,
    LayerFrameHeader,
    request_key,
    unpack_header,
)
from topkv.wire.limits import DEFAULT_LIMITS, WireLimits

H = TypeVar("H", bound=FrameHeader)


@dataclass(frozen=True)
class EncodedFrame(Generic[H]):
    """A frame ready to send: ``buffers`` are the header bytes and views of the caller's
    K (and V) tensors, in wire order. The tensors must not change until the send is done."""

    header: H
    buffers: list[memoryview]

    @property
    def nbytes(self) -> int:
        """Total bytes on the wire (header plus payload)."""
        return sum(buf.nbytes for buf in self.buffers)

    def to_bytes(self) -> bytes:
        """The frame as one ``bytes`` object. This copies; meant for small frames and tests."""
        return b"".join(self.buffers)


@dataclass(frozen=True)
class DecodedFrame(Generic[H]):
    """A verified frame: ``k`` and ``v`` are byte memoryviews into the received buffer
    (``v`` is ``None`` for MLA). They are read-only if that buffer is."""

    header: H
    k: memoryview
    v: memoryview | None

    def k_array(self) -> npt.NDArray[np.generic]:
        """K as a numpy view shaped ``header.tensor_shape`` (no copy). bf16 and fp8 come
        back as their raw bits (uint16 / uint8); see :attr:`DType.numpy_storage`."""
        return _as_array(self.k, self.header)

    def v_array(self) -> npt.NDArray[np.generic] | None:
        """V as a numpy view like :meth:`k_array`; ``None`` for an MLA frame."""
        return None if self.v is None else _as_array(self.v, self.header)


def _as_array(view: memoryview, header: FrameHeader) -> npt.NDArray[np.generic]:
    return np.frombuffer(view, dtype=header.dtype.numpy_storage).reshape(header.tensor_shape)


def checksum_tensors(k: object, v: object | None = None) -> tuple[int, int]:
    """CRC-64/NVME of K and of V (0 when ``v`` is None), computed in place."""
    return crc64(k), (0 if v is None else crc64(v))


def _tensor_view(data: object, what: str, dtype: DType, expected: int) -> memoryview:
    itemsize = contiguous_view(data, what).itemsize
    if itemsize not in (1, dtype.itemsize):
        raise SizeMismatch(
            f"{what} has {itemsize}-byte elements but dtype {dtype.wire_name} has "
            f"{dtype.itemsize}-byte elements"
        )
    view = as_byte_view(data, what)
    if view.nbytes != expected:
        raise SizeMismatch(f"{what} has {view.nbytes} bytes but the dims and dtype say {expected}")
    return view


def _encode(
    header_type: type[H],
    k: object,
    v: object | None,
    *,
    request_id: str,
    model_id: int,
    dtype: DType | str,
    k_crc: int | None,
    v_crc: int | None,
    **dims: int,
) -> EncodedFrame[H]:
    wire_dtype = dtype if isinstance(dtype, DType) else DType.from_name(dtype)
    mla = v is None
    # Build the header once with placeholder CRCs: this validates dims and sizes before
    # any byte of the tensors is read.
    shape_only = header_type(
        request_key=request_key(request_id),
        model_id=model_id,
        dtype=wire_dtype,
        mla=mla,
        k_crc=0,
        v_crc=0,
        **_sizes(header_type, wire_dtype, mla, dims),
        **dims,
    )
    k_view = _tensor_view(k, "K", wire_dtype, shape_only.k_bytes)
    v_view = None if v is None else _tensor_view(v, "V", wire_dtype, shape_only.v_bytes)
    header = header_type(
        request_key=shape_only.request_key,
        model_id=model_id,
        dtype=wire_dtype,
        mla=mla,
        k_crc=crc64(k_view) if k_crc is None else k_crc,
        v_crc=(0 if v_view is None else crc64(v_view)) if v_crc is None else v_crc,
        k_bytes=shape_only.k_bytes,
        v_bytes=shape_only.v_bytes,
        **dims,
    )
    buffers = [memoryview(header.pack()), k_view]
    if v_view is not None:
        buffers.append(v_view)
    return EncodedFrame(header=header, buffers=buffers)


def _sizes(
    header_type: type[FrameHeader], dtype: DType, mla: bool, dims: dict[str, int]
) -> dict[str, int]:
    shape: tuple[str, ...] = ("seq_len", "kv_heads", "head_dim")
    if header_type is KVHeader:
        shape = ("layers", *shape)
    size = dtype.itemsize
    for name in shape:
        value = dims[name]
        size *= value if isinstance(value, int) and value > 0 else 0
    return {"k_bytes": size, "v_bytes": 0 if mla else size}


def encode_kv(
    k: object,
    v: object | None,
    *,
    request_id: str,
    model_id: int,
    dtype: DType | str,
    seq_len: int,
    layers: int,
    kv_heads: int,
    head_dim: int,
    k_crc: int | None = None,
    v_crc: int | None = None,
) -> EncodedFrame[KVHeader]:
    """Encode a full frame: every layer's K, then V, each [layers][seq_len][kv_heads][head_dim].

    ``k`` and ``v`` are C-contiguous buffers (numpy arrays, memoryviews, bytes) of exactly
    ``layers*seq_len*kv_heads*head_dim*dtype.itemsize`` bytes; ``v=None`` encodes an MLA
    frame whose single latent tensor is ``k`` (use ``kv_heads=1``, ``head_dim`` = latent
    width). CRCs are computed unless given (``k_crc``/``v_crc``, e.g. from
    :func:`checksum_tensors` run earlier). No tensor byte is copied.
    """
    return _encode(
        KVHeader,
        k,
        v,
        request_id=request_id,
        model_id=model_id,
        dtype=dtype,
        k_crc=k_crc,
        v_crc=v_crc,
        seq_len=seq_len,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
    )


def encode_layer_frame(
    k: object,
    v: object | None,
    *,
    request_id: str,
    model_id: int,
    dtype: DType | str,
    seq_len: int,
    layers: int,
    layer_index: int,
    kv_heads: int,
    head_dim: int,
    k_crc: int | None = None,
    v_crc: int | None = None,
) -> EncodedFrame[LayerFrameHeader]:
    """Encode one layer for streaming: layer ``layer_index`` of ``layers``, K then V, each
    [seq_len][kv_heads][head_dim]. ``v=None`` makes an MLA layer frame. No copies."""
    return _encode(
        LayerFrameHeader,
        k,
        v,
        request_id=request_id,
        model_id=model_id,
        dtype=dtype,
        k_crc=k_crc,
        v_crc=v_crc,
        seq_len=seq_len,
        layers=layers,
        layer_index=layer_index,
        kv_heads=kv_heads,
        head_dim=head_dim,
    )


def verify_payload(header: FrameHeader, k: object, v: object | None = None) -> None:
    """Check separately received K (and V) against ``header``: sizes, then CRCs.

    Raises :class:`SizeMismatch` or :class:`FrameChecksumMismatch` naming the tensor.
    """
    k_view = as_byte_view(k, "K")
    if k_view.nbytes != header.k_bytes:
        raise SizeMismatch(f"K has {k_view.nbytes} bytes, the header says {header.k_bytes}")
    if header.mla:
        if v is not None and as_byte_view(v, "V").nbytes != 0:
            raise SizeMismatch("an MLA frame has no V tensor, but V bytes were given")
    else:
        if v is None:
            raise SizeMismatch(f"V is missing; the header says {header.v_bytes} bytes")
        v_view = as_byte_view(v, "V")
        if v_view.nbytes != header.v_bytes:
            raise SizeMismatch(f"V has {v_view.nbytes} bytes, the header says {header.v_bytes}")
    actual = crc64(k_view)
    if actual != header.k_crc:
        raise FrameChecksumMismatch("k", header.k_crc, actual)
    if not header.mla:
        actual = crc64(v_view)
        if actual != header.v_crc:
            raise FrameChecksumMismatch("v", header.v_crc, actual)


def decode_payload(header: H, payload: object) -> DecodedFrame[H]:
    """Verify a payload (K then V, exactly ``header.payload_bytes``) received after
    ``header`` and return zero-copy views of K and V."""
    view = as_byte_view(payload, "payload")
    if view.nbytes < header.payload_bytes:
        raise TruncatedFrame(
            f"payload has {view.nbytes} bytes, the header announces {header.payload_bytes}"
        )
    if view.nbytes > header.payload_bytes:
        raise SizeMismatch(
            f"payload has {view.nbytes - header.payload_bytes} bytes more than the "
            f"{header.payload_bytes} the header announces"
        )
    k = view[: header.k_bytes]
    v = None if header.mla else view[header.k_bytes :]
    verify_payload(header, k, v)
    return DecodedFrame(header=header, k=k, v=v)


def decode_frame(
    buf: object, limits: WireLimits = DEFAULT_LIMITS
) -> DecodedFrame[KVHeader] | DecodedFrame[LayerFrameHeader]:
    """Decode and verify one complete frame of either kind from untrusted bytes.

    ``buf`` must hold exactly one frame (header plus payload). Returns views into ``buf``.
    """
    view = as_byte_view(buf, "frame")
    header = unpack_header(view, limits)
    payload = view[HEADER_SIZE:]
    if isinstance(header, LayerFrameHeader):
        return decode_payload(header, payload)
    return decode_payload(header, payload)


def decode_kv(buf: object, limits: WireLimits = DEFAULT_LIMITS) -> DecodedFrame[KVHeader]:
    """Decode and verify a full frame (see :func:`decode_frame`); a per-layer frame is
    rejected with :class:`HeaderCorrupt`."""
    view = as_byte_view(buf, "frame")
    return decode_payload(KVHeader.unpack(view, limits), view[HEADER_SIZE:])


def decode_layer_frame(
    buf: object, limits: WireLimits = DEFAULT_LIMITS
) -> DecodedFrame[LayerFrameHeader]:
    """Decode and verify a per-layer frame; a full frame is rejected with
    :class:`HeaderCorrupt`."""
    view = as_byte_view(buf, "frame")
    return decode_payload(LayerFrameHeader.unpack(view, limits), view[HEADER_SIZE:])
