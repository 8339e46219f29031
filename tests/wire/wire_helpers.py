"""Shared builders for the wire tests (random tensors, forged headers)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from topkv.wire import HEADER_STRUCT, MAGIC, WIRE_VERSION, DType, crc64, request_key


def random_tensor(
    rng: np.random.Generator, shape: tuple[int, ...], dtype: DType
) -> npt.NDArray[Any]:
    """Random bits of the right width, viewed with the dtype's numpy storage type."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
    return raw.view(dtype.numpy_storage).reshape(shape)


def forge_header(**overrides: Any) -> bytes:
    """128 header bytes with any field set to anything, and a *valid* header CRC, so that
    validation beyond the CRC is exercised."""
    fields: dict[str, Any] = {
        "magic": MAGIC,
        "version": WIRE_VERSION,
        "flags": 0,
        "dtype": int(DType.FP16),
        "reserved0": bytes(3),
        "request_key": request_key("forged"),
        "model_id": 3,
        "seq_len": 2,
        "layers": 1,
        "layer_index": 0,
        "kv_heads": 1,
        "head_dim": 4,
        "k_bytes": 16,
        "v_bytes": 16,
        "k_crc": 0,
        "v_crc": 0,
        "reserved1": bytes(32),
    }
    unknown = set(overrides) - set(fields)
    assert not unknown, unknown
    fields.update(overrides)
    body = HEADER_STRUCT.pack(*fields.values(), 0)[:120]
    return body + crc64(body).to_bytes(8, "little")
