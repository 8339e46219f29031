"""Errors of the end-to-end demo."""

from __future__ import annotations

from topkv.errors import TopKVError


class DemoError(TopKVError):
    """The demo cannot run as asked (bad option, missing trace, a worker failed)."""


class WorkerFailed(DemoError):
    """A demo worker process died or reported an error; the message says which and why."""
