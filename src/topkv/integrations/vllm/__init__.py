"""TopKV inside vLLM and around it, in three rooms:

* :mod:`.connector`: what runs inside vLLM (TopKVConnector, its scheduler and worker sides);
  only it imports vLLM;
* :mod:`.frontdoor`: the OpenAI-compatible front door over vLLM instances;
* :mod:`.stack`: a local prefill/decode stack of vLLM instances and the runners built on it.

vLLM loads the connector with ``"kv_connector": "TopKVConnector",
"kv_connector_module_path": "topkv.integrations.vllm"``; the front door and the block-layout
helpers work (and are tested) without vLLM installed.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "TopKVConnector":
        from topkv.integrations.vllm.connector.kv_connector import TopKVConnector

        return TopKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
