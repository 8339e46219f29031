"""MoE-aware decode routing: the four routers (:mod:`.router`) over one snapshot of the
expert replicas (:mod:`.experts`). docs/moe.md explains the design."""
