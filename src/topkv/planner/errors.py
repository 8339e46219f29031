"""Errors raised by the analytical planner."""

from __future__ import annotations

from topkv.errors import ConfigError


class PlannerInputError(ConfigError):
    """A planner argument (size, rate, time, transport name) is out of range."""
