"""Transports whose bytes a library writes straight into the sink's registered arena
(NIXL, Mooncake TE, CUDA IPC): the shared protocol, the two ends and the factory."""
