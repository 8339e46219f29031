"""Decode from received per-layer K/V, and the single-process reference it must match."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from topkv.engine.deps import require_model_extra
from topkv.engine.errors import KVLayoutError

require_model_extra()

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from topkv.engine.layout import KVArray, check_layer, wire_to_hf  # noqa: E402
from topkv.engine.models import LoadedModel, kv_model_spec  # noqa: E402
from topkv.engine.prefill import as_input_ids, check_token_ids, greedy_token  # noqa: E402


def _check_max_new_tokens(max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise KVLayoutError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


def _continue_greedy(
    loaded: LoadedModel,
    cache: DynamicCache,
    first_token: int,
    max_new_tokens: int,
    between_steps: Callable[[], None] | None = None,
) -> list[int]:
    """Feed tokens one at a time through ``cache`` until ``max_new_tokens`` are produced.

    No EOS stop: the demo compares fixed-length outputs. ``between_steps`` is called after
    each step but the last (the engine lets a waiting prefill chunk run there).
    """
    tokens = [first_token]
    with torch.inference_mode():
        while len(tokens) < max_new_tokens:
            if between_steps is not None and len(tokens) > 1:
                between_steps()
            step = torch.tensor([[tokens[-1]]], dtype=torch.long, device=loaded.device)
            output = loaded.model(input_ids=step, cache=cache, use_cache=True, logits_to_keep=1)
            tokens.append(greedy_token(output.logits))
    return tokens


def build_cache(
    loaded: LoadedModel, layers: Sequence[tuple[KVArray, KVArray]], prompt_len: int
) -> DynamicCache:
    """The model's ``DynamicCache`` filled from per-layer (K, V) in wire layout."""
    spec = kv_model_spec(loaded)
    if len(layers) != spec["layers"]:
        raise KVLayoutError(f"received {len(layers)} layers, the model has {spec['layers']}")
    for index, (k, v) in enumerate(layers):
        check_layer(spec, index, prompt_len, k, v)
    return DynamicCache(
        ddp_cache_data=[
            (wire_to_hf(k).to(loaded.device), wire_to_hf(v).to(loaded.device)) for k, v in layers
        ],
        config=loaded.config,
    )


class DecodeRunner:
    """Continues generation on a decode worker from a prefill worker's K/V."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded

    def generate(
        self,
        layers: Sequence[tuple[KVArray, KVArray]],
        first_token: int,
        prompt_len: int,
        max_new_tokens: int,
        between_steps: Callable[[], None] | None = None,
    ) -> list[int]:
        """Greedy tokens, starting with ``first_token`` (from prefill), ``max_new_tokens`` in all.

        ``layers[i]`` is layer i's (K, V), tensors or numpy arrays shaped
        ``[prompt_len, kv_heads, head_dim]`` in the model's dtype. ``between_steps``: called
        between decode steps (``_continue_greedy``).
        """
        _check_max_new_tokens(max_new_tokens)
        vocab = int(self.loaded.config.vocab_size)
        if not 0 <= first_token < vocab:
            raise KVLayoutError(f"first_token must be in [0, {vocab}), got {first_token}")
        cache = build_cache(self.loaded, layers, prompt_len)
        return _continue_greedy(self.loaded, cache, first_token, max_new_tokens, between_steps)


def reference_generate(
    loaded: LoadedModel, input_ids: Sequence[int] | torch.Tensor, max_new_tokens: int
) -> list[int]:
    """Single-process greedy generation: prefill then decode with one in-memory cache.

    Returns ``max_new_tokens`` tokens, the first being prefill's; the disaggregated path
    (``PrefillRunner`` -> transfer -> ``DecodeRunner``) must return exactly these.
    """
    _check_max_new_tokens(max_new_tokens)
    ids = as_input_ids(input_ids)
    check_token_ids(loaded, ids)
    cache = DynamicCache(config=loaded.config)
    with torch.inference_mode():
        output = loaded.model(
            input_ids=ids.to(loaded.device), cache=cache, use_cache=True, logits_to_keep=1
        )
        first_token = greedy_token(output.logits)
    return _continue_greedy(loaded, cache, first_token, max_new_tokens)
