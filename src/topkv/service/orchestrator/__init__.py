"""The orchestrator's process: its HTTP API and models, the OpenAPI document, worker
registrations, leadership, the executor that drives remote workers, the ADP and experts
endpoints, and the client that talks to it."""
