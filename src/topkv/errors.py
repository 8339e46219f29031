"""Base exception types shared by every TopKV layer.

Each layer defines specific subclasses; the CLI catches ``TopKVError`` and prints its
message as one line with a non-zero exit status instead of a traceback.
"""


class TopKVError(Exception):
    """Base class of every error TopKV raises on purpose (bad input, dead peer, ...)."""


class ConfigError(TopKVError):
    """A user-supplied file, flag or value is invalid."""
