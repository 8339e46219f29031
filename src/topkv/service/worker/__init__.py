"""The worker's process: the service (:mod:`.service`), its config, inbox, media, role,
sending, tiers, expert reports and its registration with the orchestrator."""
