"""Errors raised by the decision policies."""

from __future__ import annotations

from topkv.errors import ConfigError, TopKVError


class PolicyError(TopKVError):
    """A policy could not reach a decision from the snapshot it was given."""


class NoPathError(PolicyError):
    """The pair has no usable path for the requested transport (or none at all)."""


class PolicyInputError(ConfigError):
    """A value given to a policy (endpoint, transport name, request) is invalid."""
