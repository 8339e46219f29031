"""Send-side pieces shared by every transport: checking and checksumming queued layers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from topkv.transport import framing
from topkv.transport.base import Buffer, TransferDescriptor
from topkv.transport.errors import FrameRejected


@dataclass(frozen=True)
class LayerItem:
    """One layer queued for sending: byte views of its tensors and known CRCs if any."""

    layer: int
    tensors: tuple[memoryview, ...]
    crcs: tuple[int, ...] | None
    ahead: bool = False  # CRCs computed by the transport's look-ahead checksum stage


def as_bytes_view(buffer: Buffer) -> memoryview:
    """A flat, read-only byte view of any C-contiguous buffer (numpy, torch CPU, bytes)."""
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise FrameRejected("tensor buffers must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def check_layer(
    descriptor: TransferDescriptor,
    layer: int,
    tensors: Sequence[Buffer],
    crcs: Sequence[int] | None,
) -> LayerItem:
    """Validate a ``send_layer`` call against the transfer's layout."""
    layout = descriptor.layout
    if not 0 <= layer < layout.num_layers:
        raise FrameRejected(f"layer {layer} out of range 0..{layout.num_layers - 1}")
    if len(tensors) != layout.tensors_per_layer:
        raise FrameRejected(
            f"layer {layer}: {len(tensors)} tensors given, layout needs {layout.tensors_per_layer}"
        )
    views = tuple(as_bytes_view(t) for t in tensors)
    for index, view in enumerate(views):
        if view.nbytes != layout.tensor_bytes:
            raise FrameRejected(
                f"layer {layer} tensor {index}: {view.nbytes} bytes, layout says "
                f"{layout.tensor_bytes}"
            )
    if crcs is not None and len(crcs) != len(views):
        raise FrameRejected(f"layer {layer}: {len(crcs)} CRCs for {len(views)} tensors")
    return LayerItem(layer, views, tuple(crcs) if crcs is not None else None)


def layer_crcs(item: LayerItem) -> tuple[int, ...]:
    """The item's CRC-64 values, computing those the producer did not supply."""
    if item.crcs is not None:
        return item.crcs
    return tuple(framing.crc64(view) for view in item.tensors)
