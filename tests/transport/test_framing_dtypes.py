"""Every record a transport writes names its dtype in the wire format's code space.

The transfer-open header and the per-layer frame header travel on the same stream and both
carry a dtype byte at offset 12; a reader must be able to decode either with the wire
format's table (docs/wire-format.md) and get back the layout's dtype.
"""

from __future__ import annotations

import pytest

from topkv import wire
from topkv.transport import framing
from topkv.transport.base import KVLayout, TransferDescriptor

KV_DTYPES = ("fp8", "fp16", "bf16", "fp32")
#: magic (8 bytes), version (u16), flags (u16), then the dtype byte: the same offset in the
#: transfer-open header and in the wire format's frame header.
DTYPE_OFFSET = 12


def _descriptor(dtype: str, latent: bool = False) -> TransferDescriptor:
    return TransferDescriptor(7, "model-x", KVLayout(3, 16, 2, 8, dtype, latent))


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_transfer_header_dtype_byte_is_the_wire_code(dtype: str) -> None:
    raw = framing.encode_transfer_header(_descriptor(dtype))
    assert raw[:8] == framing.TRANSFER_MAGIC
    code = raw[DTYPE_OFFSET]
    assert code == int(wire.DType.from_name(dtype))
    assert wire.DType.from_code(code) is wire.DType.from_name(dtype)


@pytest.mark.parametrize("latent", [False, True])
@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_layer_frame_from_the_transport_decodes_with_the_wire_decoder(
    dtype: str, latent: bool
) -> None:
    descriptor = _descriptor(dtype, latent)
    crcs = (11,) if latent else (11, 22)
    raw = framing.encode_layer_header(descriptor, 1, crcs)
    assert raw[DTYPE_OFFSET] == int(wire.DType.from_name(dtype))
    header = wire.unpack_header(raw)
    assert isinstance(header, wire.LayerFrameHeader)
    assert header.dtype is wire.DType.from_name(dtype)
    assert header.k_bytes == descriptor.layout.tensor_bytes
    assert header.dtype.itemsize == descriptor.layout.itemsize


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_transfer_header_and_layer_frames_agree_on_the_dtype(dtype: str) -> None:
    descriptor = _descriptor(dtype)
    opening = framing.encode_transfer_header(descriptor)
    layer = framing.encode_layer_header(descriptor, 0, (1, 2))
    assert opening[DTYPE_OFFSET] == layer[DTYPE_OFFSET]
    decoded, _streams = framing.decode_transfer_header(opening, framing.ReceiveLimits())
    assert decoded.layout.dtype == dtype
    assert framing.decode_layer_header(layer, decoded).crcs == (1, 2)
