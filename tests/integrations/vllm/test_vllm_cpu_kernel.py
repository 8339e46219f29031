"""The cpu-packed layout against vLLM's own CPU kernel: what ``cpu_attn_reshape_and_cache``
writes, ``gather_tokens`` reads back token for token (and ``scatter_tokens`` writes pages
the kernel's reader would find). Skips without vLLM."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
ops = pytest.importorskip("vllm._custom_ops")

from topkv.integrations.vllm.connector.layout import BlockLayout, gather_tokens, scatter_tokens  # noqa: E402


@pytest.mark.parametrize("isa", ["vec", "vec16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_reads_what_the_cpu_kernel_wrote(isa: str, dtype: torch.dtype) -> None:
    blocks, heads, block_size, head_dim = 5, 2, 32, 64
    cache = torch.zeros(blocks, heads, block_size, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = cache.view(blocks, heads, 2 * block_size, head_dim).chunk(2, dim=2)
    block_ids = [3, 0, 4]  # a request's pages, out of order
    tokens = 70  # two full pages and part of a third
    generator = torch.Generator().manual_seed(1)
    k = torch.randn(tokens, heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(tokens, heads, head_dim, generator=generator).to(dtype)
    slots = torch.tensor(
        [block_ids[t // block_size] * block_size + t % block_size for t in range(tokens)]
    )
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)

    got_k, got_v = gather_tokens(cache, BlockLayout.CPU_PACKED, block_ids, 0, tokens)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)

    copy = torch.zeros_like(cache)
    scatter_tokens(copy, BlockLayout.CPU_PACKED, block_ids, 0, k, v)
    assert torch.equal(copy, cache)
