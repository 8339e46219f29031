"""KV-cache sizing: model shapes, the paper's model catalog and Hugging Face config reading.

Pure: no I/O except :func:`load_hf_config`, which reads one local file.
"""

from topkv.kv.catalog import catalog, get_model
from topkv.kv.dtypes import dtype_bytes
from topkv.kv.errors import ModelConfigError, UnknownDtypeError, UnknownModelError
from topkv.kv.hf_config import SUPPORTED_MODEL_TYPES, load_hf_config, spec_from_hf_dict
from topkv.kv.spec import ATTENTION_KINDS, LAYER_TYPES, AttentionKind, LayerType, ModelSpec

__all__ = [
    "ATTENTION_KINDS",
    "LAYER_TYPES",
    "SUPPORTED_MODEL_TYPES",
    "AttentionKind",
    "LayerType",
    "ModelConfigError",
    "ModelSpec",
    "UnknownDtypeError",
    "UnknownModelError",
    "catalog",
    "dtype_bytes",
    "get_model",
    "load_hf_config",
    "spec_from_hf_dict",
]
