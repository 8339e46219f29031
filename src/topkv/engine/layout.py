"""Conversions between Hugging Face's cache layout and the wire layout.

Hugging Face cache layers hold K and V as ``[batch, kv_heads, seq_len, head_dim]``. The wire
format (SPEC section 5) and every tensor the engine publishes or accepts use, per layer,
``[seq_len][kv_heads][head_dim]``, C-contiguous. With batch 1 the conversion is::

    wire = hf[0].transpose(0, 1).contiguous()           # [S, H, D], one copy
    hf   = wire.permute(1, 0, 2).unsqueeze(0).contiguous()  # [1, H, S, D], one copy
"""

from __future__ import annotations

from topkv.engine.deps import require_model_extra
from topkv.engine.errors import KVLayoutError
from topkv.engine.spec import KVModelSpec, layer_shape

require_model_extra()

import numpy as np  # noqa: E402
import torch  # noqa: E402

#: A layer's K or V as received: a tensor or a numpy array in wire layout.
KVArray = torch.Tensor | np.ndarray


def hf_to_wire(hf: torch.Tensor) -> torch.Tensor:
    """One HF cache tensor ``[1, kv_heads, seq, head_dim]`` -> contiguous wire layout."""
    if hf.dim() != 4 or hf.shape[0] != 1:
        raise KVLayoutError(
            "expected a Hugging Face cache tensor [1, kv_heads, seq, head_dim], "
            f"got {tuple(hf.shape)}"
        )
    return hf[0].transpose(0, 1).contiguous()


def wire_to_hf(wire: KVArray) -> torch.Tensor:
    """Wire layout ``[seq, kv_heads, head_dim]`` (tensor or array) -> contiguous HF layout."""
    if wire.ndim != 3:
        raise KVLayoutError(
            f"expected a [seq, kv_heads, head_dim] tensor, got shape {tuple(wire.shape)}"
        )
    if isinstance(wire, np.ndarray):
        # Always one copy into a fresh writable array (also when the transpose happens to be
        # contiguous, e.g. seq_len 1), so torch.from_numpy shares it without the read-only
        # warning that views of received bytes would raise.
        return torch.from_numpy(np.array(wire.transpose(1, 0, 2), order="C", copy=True))[None]
    return wire.permute(1, 0, 2).unsqueeze(0).contiguous()


def kv_to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a numpy array; zero-copy when it is already contiguous on the CPU."""
    return tensor.detach().cpu().contiguous().numpy()


def layer_to_numpy(k: torch.Tensor, v: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """One layer's K and V (wire layout) as numpy arrays, zero-copy for contiguous CPU tensors."""
    return kv_to_numpy(k), kv_to_numpy(v)


def layer_from_numpy(k: np.ndarray, v: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V arrays as tensors; zero-copy when writable and contiguous."""

    def convert(array: np.ndarray) -> torch.Tensor:
        if array.flags.writeable and array.flags.c_contiguous:
            return torch.from_numpy(array)
        return torch.from_numpy(np.array(array, copy=True, order="C"))

    return convert(k), convert(v)


def check_layer(spec: KVModelSpec, index: int, seq_len: int, k: KVArray, v: KVArray) -> None:
    """Raise :class:`KVLayoutError` unless K and V match the wire layout for ``seq_len`` tokens."""
    expected = layer_shape(spec, seq_len)
    for name, tensor in (("K", k), ("V", v)):
        shape = tuple(tensor.shape)
        if shape != expected:
            raise KVLayoutError(
                f"layer {index} {name} has shape {shape}, expected {expected} "
                "([seq_len, kv_heads, head_dim])"
            )
        dtype = tensor.dtype if isinstance(tensor, np.ndarray) else torch_dtype_name(tensor.dtype)
        if str(dtype) != spec["dtype"]:
            raise KVLayoutError(f"layer {index} {name} has dtype {dtype}, expected {spec['dtype']}")


_TORCH_TO_NUMPY = {torch.float32: "float32", torch.float16: "float16", torch.float64: "float64"}


def torch_dtype_name(dtype: torch.dtype) -> str:
    """The numpy name of a torch floating dtype the wire can carry."""
    try:
        return _TORCH_TO_NUMPY[dtype]
    except KeyError:
        raise KVLayoutError(
            f"KV dtype {dtype} has no numpy equivalent; run the model in float32 or float16"
        ) from None
