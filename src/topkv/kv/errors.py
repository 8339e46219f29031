"""Errors raised by KV sizing, the model catalog and the config reader."""

from __future__ import annotations

from topkv.errors import ConfigError


class ModelConfigError(ConfigError):
    """A model description (catalog entry, ``config.json``, ModelSpec field) is invalid."""


class UnknownModelError(ModelConfigError):
    """A model name is not in the catalog."""


class UnknownDtypeError(ConfigError):
    """A dtype name is not one of the supported KV-cache element types."""
