"""Block-layout packing against each backend's own reading of its cache.

The oracles are the expressions vLLM's attention backends use to find K and V in a page
(CPU: the page flattened, keys ``[head_dim][block_size]`` then values
``[block_size][head_dim]``, as its reshape_and_cache kernel writes them (the kernel itself is
the oracle in test_vllm_cpu_kernel.py); FlashAttention >= 0.32: the last axis split; the
legacy 5-D layouts: their K/V axis), not our views.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from topkv.integrations.vllm.connector.layout import (  # noqa: E402
    BlockLayout,
    LayoutError,
    gather_tokens,
    parse_layout,
    scatter_tokens,
)


def _oracle(cache: torch.Tensor, layout: BlockLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as ``[blocks, block_size, heads, dim]``, the way each backend reads them."""
    if layout is BlockLayout.CPU_PACKED:
        b, h, n, c = cache.shape
        flat = cache.reshape(b, h, n * c)
        k = flat[..., : n * c // 2].reshape(b, h, c // 2, n).permute(0, 3, 1, 2)
        v = flat[..., n * c // 2 :].reshape(b, h, n, c // 2).permute(0, 2, 1, 3)
        return k, v
    if layout is BlockLayout.CUDA_SPLIT:
        k, v = cache.transpose(1, 2).split(cache.shape[-1] // 2, dim=-1)  # flash_attn.py
        return k, v
    if layout is BlockLayout.FLASH_ATTN:
        return cache.unbind(0)  # type: ignore[return-value]
    return cache.unbind(1)  # type: ignore[return-value]


def _cache(layout: BlockLayout, blocks: int, n: int, h: int, d: int, strided: bool) -> torch.Tensor:
    if layout is BlockLayout.CPU_PACKED:
        return torch.zeros(blocks, h, n, 2 * d)
    if layout is BlockLayout.CUDA_SPLIT:
        if strided:  # physical [B, N, H, C] (vLLM's LBNHC), logical [B, H, N, C]
            return torch.zeros(blocks, n, h, 2 * d).permute(0, 2, 1, 3)
        return torch.zeros(blocks, h, n, 2 * d)
    if layout is BlockLayout.FLASH_ATTN:
        return torch.zeros(2, blocks, n, h, d)
    return torch.zeros(blocks, 2, n, h, d)


@given(
    layout=st.sampled_from(list(BlockLayout)),
    block_size=st.sampled_from([1, 4, 32]),
    heads=st.integers(1, 3),
    head_dim=st.sampled_from([2, 8]),
    blocks=st.integers(2, 6),
    data=st.data(),
    strided=st.booleans(),
)
def test_scatter_then_gather_round_trips_and_lands_where_the_backend_reads(
    layout: BlockLayout,
    block_size: int,
    heads: int,
    head_dim: int,
    blocks: int,
    data: st.DataObject,
    strided: bool,
) -> None:
    cache = _cache(layout, blocks, block_size, heads, head_dim, strided)
    order = data.draw(st.permutations(range(blocks)))
    used = data.draw(st.integers(1, blocks))
    block_ids = list(order[:used])
    end = data.draw(st.integers(1, used * block_size))
    start = data.draw(st.integers(0, end))
    tokens = end - start
    k = torch.randn(tokens, heads, head_dim)
    v = torch.randn(tokens, heads, head_dim)

    scatter_tokens(cache, layout, block_ids, start, k, v)
    got_k, got_v = gather_tokens(cache, layout, block_ids, start, end)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert got_k.is_contiguous() and got_v.is_contiguous()

    ok, ov = _oracle(cache, layout)
    for t in range(start, end):
        block, slot = block_ids[t // block_size], t % block_size
        assert torch.equal(ok[block, slot], k[t - start])
        assert torch.equal(ov[block, slot], v[t - start])
    written = tokens * heads * head_dim * 2
    assert int((cache != 0).sum()) <= written  # nothing outside the range was touched


def test_bad_shapes_and_ranges_are_named() -> None:
    cache = torch.zeros(4, 2, 8, 16)
    with pytest.raises(LayoutError, match="5 dimensions"):
        gather_tokens(cache, BlockLayout.FLASH_ATTN, [0], 0, 1)
    with pytest.raises(LayoutError, match="cannot hold 17 tokens"):
        gather_tokens(cache, BlockLayout.CPU_PACKED, [0, 1], 0, 17)
    with pytest.raises(LayoutError, match="below the cache's 4 blocks"):
        gather_tokens(cache, BlockLayout.CPU_PACKED, [7], 0, 1)
    with pytest.raises(LayoutError, match="do not fit pages"):
        scatter_tokens(
            cache, BlockLayout.CUDA_SPLIT, [0], 0, torch.zeros(1, 3, 8), torch.zeros(1, 3, 8)
        )
    with pytest.raises(LayoutError, match="unknown block layout 'nhd'"):
        parse_layout("nhd")
    strided = torch.zeros(4, 8, 2, 16).permute(0, 2, 1, 3)
    with pytest.raises(LayoutError, match="contiguous"):
        gather_tokens(strided, BlockLayout.CPU_PACKED, [0], 0, 1)
