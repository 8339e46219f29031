"""TopKV: topology-aware KV-cache transfer for disaggregated LLM inference."""

__version__ = "0.1.0"
