"""Guard for the optional ``model`` extra (torch + transformers)."""

from __future__ import annotations

import importlib
import importlib.util

from topkv.engine.errors import EngineUnavailable

INSTALL_HINT = "pip install 'topkv[model]'"


def model_extra_available() -> bool:
    """True when both torch and transformers are installed (without importing them)."""
    for name in ("torch", "transformers"):
        try:
            if importlib.util.find_spec(name) is None:
                return False
        except (ImportError, ValueError):  # ValueError: module set to None in sys.modules
            return False
    return True


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
