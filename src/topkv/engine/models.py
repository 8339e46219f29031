"""Load a Llama-family GQA model: the seeded random demo model, or a local HF directory.

Everything runs in float32 on the CPU unless a caller moves the model: float32 keeps greedy
decoding bit-reproducible, which is what lets the demo check token identity.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from topkv.engine.deps import require_model_extra
from topkv.engine.errors import UnsupportedModelError
from topkv.engine.layout import torch_dtype_name
from topkv.engine.spec import DemoModelConfig, KVModelSpec
from topkv.inputs import InputFileError, load_json

require_model_extra()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

#: ``model_type`` values whose cache is one full-attention K/V pair per layer, shaped
#: ``[batch, kv_heads, seq, head_dim]`` after RoPE: what the engine publishes and rebuilds.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class LoadedModel:
    """A causal LM ready for prefill/decode, plus where it came from."""

    model: PreTrainedModel
    model_id: str
    source: str  # "demo (seeded random weights)" or the directory it was loaded from
    seed: int | None = None

    @property
    def config(self) -> PretrainedConfig:
        return self.model.config

    @property
    def device(self) -> torch.device:
        """Where the weights live (the CPU unless the caller moved the model)."""
        return next(self.model.parameters()).device

    @property
    def decoder_layers(self) -> torch.nn.ModuleList:
        """The decoder layers, in forward order."""
        model: Any = self.model
        layers = model.get_decoder().layers
        if not isinstance(layers, torch.nn.ModuleList):
            raise UnsupportedModelError(f"{self.source}: the decoder has no list of layers")
        return layers


def demo_config_kwargs(config: DemoModelConfig) -> dict[str, Any]:
    """The transformers config arguments of a demo model's shape (Llama attention, SDPA,
    float32), shared by the Llama demo and the Mixtral-style MoE demo."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.layers,
        "num_attention_heads": config.heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "tie_word_embeddings": False,
        "attn_implementation": "sdpa",
        "dtype": "float32",
    }


def _llama_config(config: DemoModelConfig) -> LlamaConfig:
    return LlamaConfig(**demo_config_kwargs(config))


def build_demo_model(config: DemoModelConfig, seed: int) -> LoadedModel:
    """A small Llama-architecture model with weights drawn from ``seed``.

    Weights come from our own ``torch.Generator`` (not transformers' initialiser), filled in
    sorted parameter-name order, so the same (config, seed) gives identical weights in any
    process and with any transformers version that keeps Llama's parameter names.
    RMSNorm weights are 1; every other tensor is N(0, ``config.init_std``).
    """
    with torch.random.fork_rng(devices=[]):
        model = LlamaForCausalLM(_llama_config(config))
    model.train(False)  # inference mode for dropout/norm layers
    seed_parameters(model, config.init_std, seed)
    model_id = (
        f"topkv-demo-llama-{config.layers}L-{config.hidden_size}h-"
        f"{config.heads}q{config.kv_heads}kv-seed{seed}"
    )
    return LoadedModel(
        model=model, model_id=model_id, source="demo (seeded random weights)", seed=seed
    )


def seed_parameters(model: torch.nn.Module, std: float, seed: int) -> None:
    """Fill ``model``'s weights from ``seed``: in sorted parameter-name order, norm weights
    1, every other tensor N(0, ``std``) from our own generator."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.normal(0.0, std, size=tuple(param.shape), generator=generator))


def _check_supported(config: PretrainedConfig, path: Path) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{path}: model_type {model_type!r} is not supported; the engine handles "
            f"Llama-family GQA models ({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not isinstance(heads, int) or not isinstance(kv_heads, int) or heads % kv_heads != 0:
        raise UnsupportedModelError(
            f"{path}: num_attention_heads={heads} is not a multiple of "
            f"num_key_value_heads={kv_heads}; not a grouped-query attention model"
        )
    layer_types = getattr(config, "layer_types", None) or []
    sliding = getattr(config, "sliding_window", None) is not None and getattr(
        config, "use_sliding_window", True
    )
    if sliding or any(kind != "full_attention" for kind in layer_types):
        raise UnsupportedModelError(
            f"{path}: sliding-window attention layers are not supported (their cache keeps "
            "only the window, not one K/V per prompt token)"
        )


def load_model(path: str | Path) -> LoadedModel:
    """Load a local Hugging Face model directory (``--model-path``) in float32 on the CPU.

    Raises :class:`UnsupportedModelError` when the directory is missing, has no readable
    ``config.json`` or weights, or holds a model other than a Llama-family GQA one.
    """
    directory = Path(path)
    config_file = directory / "config.json"
    if not directory.is_dir():
        raise UnsupportedModelError(f"{directory}: no such model directory")
    if not config_file.is_file():
        raise UnsupportedModelError(
            f"{directory}: no config.json; pass a Hugging Face model directory "
            "(the one save_pretrained writes)"
        )
    try:
        load_json(config_file, what="a Hugging Face config.json")
    except InputFileError as exc:
        where = config_file if exc.line is None else f"{config_file}:{exc.line}"
        raise UnsupportedModelError(
            f"{where}: cannot read the model config: {exc.reason}"
        ) from None
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise UnsupportedModelError(f"{config_file}: cannot read the model config: {exc}") from exc
    _check_supported(config, directory)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            directory,
            local_files_only=True,
            dtype=torch.float32,
            attn_implementation="sdpa",
        )
    except (OSError, ValueError, RuntimeError) as exc:
        raise UnsupportedModelError(f"{directory}: cannot load the model weights: {exc}") from exc
    model.train(False)  # inference mode for dropout/norm layers
    return LoadedModel(model=model, model_id=directory.resolve().name, source=str(directory))


def kv_model_spec(loaded: LoadedModel) -> KVModelSpec:
    """Layers, KV heads, head size and dtype of the model's cache, for the wire/kv layers."""
    config: Any = loaded.config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    np_dtype = np.dtype(torch_dtype_name(next(loaded.model.parameters()).dtype))
    return KVModelSpec(
        model_id=loaded.model_id,
        layers=int(config.num_hidden_layers),
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=np_dtype.name,
        dtype_bytes=np_dtype.itemsize,
    )


def state_dict_digest(loaded: LoadedModel) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in sorted name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(loaded.model.state_dict().items()):
        array = tensor.detach().cpu().contiguous().numpy()
        digest.update(f"{name}|{array.dtype.str}|{array.shape}\n".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()
