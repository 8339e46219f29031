"""TopKV inside vLLM: the KV connector (``TopKVConnector``) and its helpers.

vLLM loads the connector with ``"kv_connector": "TopKVConnector",
"kv_connector_module_path": "topkv.integrations.vllm"``. Only :mod:`.connector` and the
modules it uses import vLLM; the block-layout helpers (:mod:`.layout`) and the front door
(:mod:`.router`) do not, so they work (and are tested) without vLLM installed.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "TopKVConnector":
        from topkv.integrations.vllm.connector import TopKVConnector

        return TopKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
