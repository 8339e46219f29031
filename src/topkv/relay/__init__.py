"""KV relay: the orchestrator, its active-transfer registry, and the worker registry."""
