"""Block-layout packing: vLLM's paged KV cache of one layer <-> TopKV's wire layout.

The wire carries one layer as K then V, each ``[tokens][kv_heads][head_dim]`` row-major;
vLLM keeps a layer's KV in pages of ``block_size`` tokens, laid out as the attention backend
wants (:class:`BlockLayout`: ``cpu-packed``, ``cuda-split``, ``flash-attn``, ``flashinfer``;
:func:`parse_layout`). :func:`kv_views` views any of them as K and V without copying, so
:func:`gather_tokens` and :func:`scatter_tokens` serve every backend. The layouts:
docs/vllm.md ("Block layouts").
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

from topkv.errors import ConfigError


class LayoutError(ConfigError):
    """A KV cache tensor, block list or token range that does not fit the layout."""


class BlockLayout(enum.StrEnum):
    CPU_PACKED = "cpu-packed"
    CUDA_SPLIT = "cuda-split"
    FLASH_ATTN = "flash-attn"
    FLASHINFER = "flashinfer"


def parse_layout(name: str) -> BlockLayout:
    try:
        return BlockLayout(name)
    except ValueError:
        known = ", ".join(layout.value for layout in BlockLayout)
        raise LayoutError(f"unknown block layout {name!r} (known: {known})") from None


def _expect_dims(cache: torch.Tensor, dims: int, layout: BlockLayout) -> None:
    if cache.dim() != dims:
        raise LayoutError(
            f"a {layout} KV cache has {dims} dimensions, this one has shape {tuple(cache.shape)}"
        )


def kv_views(cache: torch.Tensor, layout: BlockLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer's cache as views ``[num_blocks, block_size, kv_heads, head_dim]``."""
    if layout is BlockLayout.CPU_PACKED or layout is BlockLayout.CUDA_SPLIT:
        _expect_dims(cache, 4, layout)
        blocks, heads, block_size, content = cache.shape
        if content % 2:
            raise LayoutError(f"the last axis ({content}) holds K and V: it must be even")
        head_dim = content // 2
        if layout is BlockLayout.CUDA_SPLIT:
            k, v = cache[..., :head_dim], cache[..., head_dim:]
            return k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        if cache.stride(3) != 1 or cache.stride(2) != content:
            raise LayoutError(
                "a cpu-packed cache needs each page's [block_size, 2*head_dim] contiguous"
            )
        page = block_size * head_dim  # elements of the keys (or the values) of one page
        sb, sh = cache.stride(0), cache.stride(1)
        offset = cache.storage_offset()
        # keys [head_dim][block_size] at the page's start, values [block_size][head_dim] after
        k_t = cache.as_strided(
            (blocks, heads, head_dim, block_size), (sb, sh, block_size, 1), offset
        )
        v = cache.as_strided(
            (blocks, heads, block_size, head_dim), (sb, sh, head_dim, 1), offset + page
        )
        return k_t.permute(0, 3, 1, 2), v.permute(0, 2, 1, 3)
    _expect_dims(cache, 5, layout)
    if layout is BlockLayout.FLASH_ATTN:
        if cache.shape[0] != 2:
            raise LayoutError(f"a flash-attn cache starts with axis 2, got {tuple(cache.shape)}")
        return cache[0], cache[1]
    if cache.shape[1] != 2:
        raise LayoutError(f"a flashinfer cache has 2 on axis 1, got {tuple(cache.shape)}")
    return cache[:, 0], cache[:, 1]


def _block_index(
    view: torch.Tensor, block_ids: Sequence[int], start: int, end: int
) -> tuple[torch.Tensor, int]:
    """The blocks holding tokens ``[start, end)`` as an index tensor, and ``start``'s offset
    in the first of them."""
    blocks, block_size = view.shape[0], view.shape[1]
    if not 0 <= start <= end:
        raise LayoutError(f"token range [{start}, {end}) is not a range")
    if end > len(block_ids) * block_size:
        raise LayoutError(
            f"{len(block_ids)} blocks of {block_size} tokens cannot hold {end} tokens"
        )
    first, last = start // block_size, -(-end // block_size)
    chosen = list(block_ids[first:last])
    if any(not 0 <= b < blocks for b in chosen):
        raise LayoutError(f"block ids {chosen} are not all below the cache's {blocks} blocks")
    return torch.tensor(chosen, dtype=torch.long, device=view.device), start - first * block_size


def gather_tokens(
    cache: torch.Tensor, layout: BlockLayout, block_ids: Sequence[int], start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``[start, end)`` of a request whose pages are ``block_ids``: contiguous K and V,
    each ``[end - start, kv_heads, head_dim]`` (the wire layout), copied out of the cache."""
    out = []
    for view in kv_views(cache, layout):
        index, offset = _block_index(view, block_ids, start, end)
        pages = view.index_select(0, index)  # [n, block_size, heads, dim], a copy
        tokens = pages.reshape(-1, *pages.shape[2:])[offset : offset + end - start]
        out.append(tokens.contiguous())
    return out[0], out[1]


def scatter_tokens(
    cache: torch.Tensor,
    layout: BlockLayout,
    block_ids: Sequence[int],
    start: int,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write wire-layout ``k`` and ``v`` (``[tokens, kv_heads, head_dim]``) as tokens
    ``[start, start + tokens)`` of the request whose pages are ``block_ids``."""
    if k.shape != v.shape:
        raise LayoutError(f"K {tuple(k.shape)} and V {tuple(v.shape)} differ in shape")
    end = start + k.shape[0]
    for view, data in zip(kv_views(cache, layout), (k, v), strict=True):
        if tuple(data.shape[1:]) != tuple(view.shape[2:]):
            raise LayoutError(
                f"tokens of shape {tuple(data.shape[1:])} do not fit pages of "
                f"{tuple(view.shape[2:])} (kv_heads, head_dim)"
            )
        index, offset = _block_index(view, block_ids, start, end)
        block_size = view.shape[1]
        for i, block in enumerate(index.tolist()):
            lo = offset if i == 0 else 0
            token0 = i * block_size + lo - offset  # first token of ``data`` for this page
            count = min(block_size - lo, data.shape[0] - token0)
            view[block, lo : lo + count].copy_(data[token0 : token0 + count])
