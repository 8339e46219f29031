"""Guard for the optional ``model`` extra (torch + transformers)."""

from __future__ import annotations

import importlib
import importlib.util

from topkv.engine.errors import EngineUnavailable

INSTALL_HINT = "pip install 'topkv[model]'"


def model_extra_available() -> bool:
    """True when both torch and transformers can be imported."""
    return all(importlib.util.find_spec(name) is not None for name in ("torch", "transformers"))


def require_model_extra() -> None:
    """Raise :class:`EngineUnavailable` with an install hint unless torch and transformers load."""
    missing = []
    for name in ("torch", "transformers"):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise EngineUnavailable(
            f"the model engine needs {' and '.join(missing)}, which is not installed; "
            f"install the model extra with: {INSTALL_HINT}"
        )
