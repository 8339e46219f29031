"""Errors of the service layer (HTTP APIs, worker processes, the cluster supervisor)."""

from __future__ import annotations

from topkv.errors import TopKVError


class ServiceError(TopKVError):
    """A service could not start, or a peer service answered with an error."""


class ServiceUnreachable(ServiceError):
    """An HTTP endpoint of another service did not answer (dead, wrong URL, firewalled)."""


class ClusterError(ServiceError):
    """The local cluster supervisor could not start or keep its processes."""
