"""Services: the orchestrator's HTTP API, worker processes, and the local cluster supervisor."""
