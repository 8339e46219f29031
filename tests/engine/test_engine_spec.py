"""Pure parts of topkv.engine: sizes, byte views, prompt ids, and the missing-extra error."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from topkv.engine import (
    DemoModelConfig,
    KVLayoutError,
    KVModelSpec,
    arrays_from_bytes,
    cache_nbytes,
    layer_nbytes,
    prompt_token_ids,
    tensor_nbytes,
)

SPEC = KVModelSpec(model_id="m", layers=12, kv_heads=2, head_dim=64, dtype="float32", dtype_bytes=4)


def test_byte_sizes_follow_the_layout() -> None:
    assert tensor_nbytes(SPEC, 1024) == 1024 * 2 * 64 * 4
    assert layer_nbytes(SPEC, 1024) == 2 * 1024 * 2 * 64 * 4
    assert cache_nbytes(SPEC, 1024) == 12 * 2 * 1024 * 2 * 64 * 4


@given(seq_len=st.integers(1, 64), seed=st.integers(0, 2**32 - 1))
def test_arrays_from_bytes_is_a_zero_copy_view_in_wire_layout(seq_len: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((seq_len, 2, 64), dtype=np.float32)
    v = rng.standard_normal((seq_len, 2, 64), dtype=np.float32)
    k_buf, v_buf = bytearray(k.tobytes()), bytearray(v.tobytes())
    k_view, v_view = arrays_from_bytes(SPEC, seq_len, k_buf, v_buf)
    assert np.array_equal(k_view, k) and np.array_equal(v_view, v)
    k_buf[0:4] = np.float32(123.0).tobytes()
    assert k_view[0, 0, 0] == np.float32(123.0)  # a view, not a copy


def test_arrays_from_bytes_rejects_a_wrong_size() -> None:
    good = bytes(tensor_nbytes(SPEC, 3))
    with pytest.raises(KVLayoutError, match="holds 1532 bytes, expected 1536"):
        arrays_from_bytes(SPEC, 3, good[:-4], good)
    with pytest.raises(KVLayoutError, match="V buffer"):
        arrays_from_bytes(SPEC, 3, good, good + b"\0")


def test_prompt_token_ids_are_deterministic_and_in_range() -> None:
    first = prompt_token_ids(500, seed=3, vocab_size=4096)
    assert first == prompt_token_ids(500, seed=3, vocab_size=4096)
    assert first != prompt_token_ids(500, seed=4, vocab_size=4096)
    assert prompt_token_ids(200, seed=3, vocab_size=4096) == first[:200]
    assert len(first) == 500 and min(first) >= 0 and max(first) < 4096
    # pinned values: the stream must not change across numpy versions or processes
    assert prompt_token_ids(5, seed=0, vocab_size=4096) == [3484, 2608, 2093, 1105, 1260]


def test_prompt_token_ids_rejects_bad_input() -> None:
    with pytest.raises(KVLayoutError, match="length"):
        prompt_token_ids(0, seed=1, vocab_size=10)
    with pytest.raises(KVLayoutError, match="vocab_size"):
        prompt_token_ids(5, seed=1, vocab_size=0)


def test_demo_config_rejects_non_gqa_shapes() -> None:
    with pytest.raises(KVLayoutError, match="multiple of kv_heads"):
        DemoModelConfig(heads=8, kv_heads=3)
    with pytest.raises(KVLayoutError, match="even"):
        DemoModelConfig(head_dim=63)
    with pytest.raises(KVLayoutError, match="layers"):
        DemoModelConfig(layers=0)


def test_engine_imports_without_torch_and_names_the_extra() -> None:
    script = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # makes `import torch` raise ImportError
        import topkv.engine as engine
        assert engine.prompt_token_ids(3, 1, 10)
        assert engine.model_extra_available() is False
        try:
            engine.build_demo_model
        except engine.EngineUnavailable as exc:
            print("ERR", exc)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert "ERR the model engine needs torch" in done.stdout
    assert "pip install 'topkv[model]'" in done.stdout
