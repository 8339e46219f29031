"""Strict JSON for every ``--json`` output: each number is finite or ``null``.

``json.dumps`` writes ``NaN`` and ``Infinity`` by default, which no strict JSON parser
accepts. :func:`finite` replaces every non-finite float (also numpy floats and arrays,
inside dicts, lists and tuples) by ``None``; :func:`dumps` applies it and then serializes with
``allow_nan=False``, so a non-finite number that slipped through raises instead of
producing invalid JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, NoReturn


def finite(value: Any) -> Any:
    """``value`` with every NaN / +-Infinity float replaced by ``None`` (recursively)."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item) and getattr(value, "shape", None) == ():
        return finite(item())
    tolist = getattr(value, "tolist", None)  # numpy arrays
    if callable(tolist):
        return finite(tolist())
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps(finite(value), allow_nan=False, **kwargs)``."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)


def _refuse(name: str) -> NoReturn:
    raise ValueError(f"non-finite JSON constant {name}")


def loads_strict(text: str) -> Any:
    """``json.loads`` that refuses ``NaN``, ``Infinity`` and ``-Infinity`` (for tests)."""
    return json.loads(text, parse_constant=_refuse)
