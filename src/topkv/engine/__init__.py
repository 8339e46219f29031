"""Adapters that run a real model's prefill and decode and expose per-layer KV.

Importing ``topkv.engine`` never needs torch: the pure pieces (errors, :class:`DemoModelConfig`,
:class:`KVModelSpec`, byte sizes, prompt ids) load eagerly, and the torch-backed names load on
first access. Without the ``model`` extra, that access raises :class:`EngineUnavailable`
with the install command.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from topkv.engine.deps import INSTALL_HINT, model_extra_available, require_model_extra
from topkv.engine.errors import EngineError, EngineUnavailable, KVLayoutError, UnsupportedModelError
from topkv.engine.spec import (
    DemoModelConfig,
    KVModelSpec,
    arrays_from_bytes,
    cache_nbytes,
    layer_nbytes,
    layer_shape,
    prompt_token_ids,
    tensor_nbytes,
)

if TYPE_CHECKING:
    from topkv.engine.decode import DecodeRunner, build_cache, reference_generate
    from topkv.engine.layout import (
        hf_to_wire,
        kv_to_numpy,
        layer_from_numpy,
        layer_to_numpy,
        wire_to_hf,
    )
    from topkv.engine.models import (
        LoadedModel,
        build_demo_model,
        kv_model_spec,
        load_model,
        state_dict_digest,
    )
    from topkv.engine.prefill import LayerCallback, LayerTiming, PrefillResult, PrefillRunner

_LAZY = {
    "DecodeRunner": "decode",
    "build_cache": "decode",
    "reference_generate": "decode",
    "hf_to_wire": "layout",
    "kv_to_numpy": "layout",
    "layer_from_numpy": "layout",
    "layer_to_numpy": "layout",
    "wire_to_hf": "layout",
    "LoadedModel": "models",
    "build_demo_model": "models",
    "kv_model_spec": "models",
    "load_model": "models",
    "state_dict_digest": "models",
    "LayerCallback": "prefill",
    "LayerTiming": "prefill",
    "PrefillResult": "prefill",
    "PrefillRunner": "prefill",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'topkv.engine' has no attribute {name!r}")
    require_model_extra()
    return getattr(importlib.import_module(f"topkv.engine.{module}"), name)


__all__ = [
    "INSTALL_HINT",
    "DecodeRunner",
    "DemoModelConfig",
    "EngineError",
    "EngineUnavailable",
    "KVLayoutError",
    "KVModelSpec",
    "LayerCallback",
    "LayerTiming",
    "LoadedModel",
    "PrefillResult",
    "PrefillRunner",
    "UnsupportedModelError",
    "arrays_from_bytes",
    "build_cache",
    "build_demo_model",
    "cache_nbytes",
    "hf_to_wire",
    "kv_model_spec",
    "kv_to_numpy",
    "layer_from_numpy",
    "layer_nbytes",
    "layer_shape",
    "layer_to_numpy",
    "load_model",
    "model_extra_available",
    "prompt_token_ids",
    "reference_generate",
    "require_model_extra",
    "state_dict_digest",
    "tensor_nbytes",
    "wire_to_hf",
]
