"""Errors raised by the simulator (all are :class:`topkv.errors.TopKVError`)."""

from __future__ import annotations

from topkv.errors import ConfigError, TopKVError


class SimError(TopKVError):
    """The simulation cannot run as configured."""


class TraceFormatError(ConfigError):
    """A trace file is malformed; the message names the file and the line."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        self.path = path
        self.line = line
        self.reason = reason
        super().__init__(f"{path}:{line}: {reason}")


class ClusterSpecError(ConfigError):
    """A cluster name is unknown or a cluster YAML file is invalid."""
