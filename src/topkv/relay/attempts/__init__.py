"""The attempt loop of one transfer (:mod:`.loop`): route, attempt, retry or fail over, and
the hand-off that verifies and settles a landed copy (:mod:`.handoff`)."""
