"""Errors raised by the model engine adapters."""

from topkv.errors import TopKVError


class EngineError(TopKVError):
    """Base class of every error the engine raises on purpose."""


class EngineUnavailable(EngineError):
    """torch or transformers is not installed (the optional ``model`` extra)."""


class UnsupportedModelError(EngineError):
    """A model directory is missing, unreadable, or not a Llama-family GQA model."""


class KVLayoutError(EngineError):
    """Received K/V tensors do not match the model's per-layer layout."""
