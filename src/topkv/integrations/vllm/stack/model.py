"""A tiny Llama for vLLM, written by TopKV: seeded random weights and a byte-level tokenizer.

No hub access: the weights are :func:`topkv.engine.models.build_demo_model`'s (drawn from
our own seeded generator), saved as safetensors with their ``config.json``; the tokenizer is
built with ``tokenizers`` (256 byte tokens, ``<s>``, ``</s>``) so vLLM can serve text and
chat requests. ``head_dim`` 64 is a size vLLM's CPU attention supports.
"""

from __future__ import annotations

import json
from pathlib import Path

from topkv.engine.spec import DemoModelConfig

#: The tokenizer's vocabulary: 256 byte-level symbols, then <s> and </s>.
VOCAB_SIZE = 258
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def tiny_llama_config(layers: int = 4, hidden: int = 256) -> DemoModelConfig:
    return DemoModelConfig(
        layers=layers,
        hidden_size=hidden,
        heads=hidden // 64,
        kv_heads=max(1, hidden // 128),
        head_dim=64,
        intermediate_size=hidden * 2,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=4096,
    )


def _write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    vocab["<s>"], vocab["</s>"] = 256, 257
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def write_tiny_llama(directory: Path, seed: int = 0, layers: int = 4, hidden: int = 256) -> Path:
    """Write the model to ``directory`` (created); returns it. Same seed, same bytes."""
    from topkv.engine.models import build_demo_model

    directory.mkdir(parents=True, exist_ok=True)
    loaded = build_demo_model(tiny_llama_config(layers, hidden), seed)
    loaded.model.config.bos_token_id = 256
    loaded.model.config.eos_token_id = 257
    loaded.model.save_pretrained(directory, safe_serialization=True)
    _write_tokenizer(directory)
    return directory
