"""The attempt loop of one transfer (:mod:`.loop`): route, attempt, retry, fail over or
reroute; the handoff that verifies and settles a landed copy (:mod:`.handoff`); and the
bounded executor calls both make (:mod:`.calls`, over :mod:`.bounded`)."""
