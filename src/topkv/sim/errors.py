"""Errors raised by the simulator (all are :class:`topkv.errors.TopKVError`).

A malformed trace is :class:`topkv.traces.TraceFormatError`.
"""

from __future__ import annotations

from topkv.errors import ConfigError, TopKVError


class SimError(TopKVError):
    """The simulation cannot run as configured."""


class ClusterSpecError(ConfigError):
    """A cluster name is unknown or a cluster YAML file is invalid."""
