"""What runs inside vLLM: TopKVConnector (:mod:`.kv_connector`), its scheduler and worker
sides, the block layout, the transfer parameters, the media and the registration."""
