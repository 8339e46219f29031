"""Publish a :class:`~topkv.integrations.kubernetes.labels.LabelPatch` on a Node object
(``topkv label-node``): GET the Node for its current ``topkv.io/*`` labels, then one JSON
merge PATCH. Every API failure (403, 409, 429, 5xx, timeouts, refused connections) is
retried a bounded number of times with doubling backoff, each logged on one line; the last
one raises :class:`PublishError` saying what to fix."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx2
from lightkube import ApiError, Client
from lightkube.resources.core_v1 import Node as K8sNodeResource
from lightkube.types import PatchType

from topkv.errors import TopKVError
from topkv.integrations.kubernetes.labels import LabelPatch

log = logging.getLogger(__name__)
T = TypeVar("T")

_HINTS = {
    403: "forbidden: the service account needs get and patch on nodes "
    "(deploy/base/label-publisher.yaml's ClusterRole)",
    404: "no such Node: give the node's name (--node, or $NODE_NAME from the downward API)",
    409: "conflict: the Node changed meanwhile",
    429: "throttled by the API server",
}


class PublishError(TopKVError):
    """The Node could not be read or patched within the retries."""


class NodePublisher:
    """Labels one Node through ``client``; see the module docstring."""

    def __init__(
        self,
        client: Client,
        *,
        attempts: int = 4,
        backoff_s: float = 0.5,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._client = client
        self._attempts = attempts
        self._backoff_s = backoff_s
        self._sleep = sleep

    def current_labels(self, node: str) -> dict[str, str]:
        found = self._retried(
            f"reading Node {node}", lambda: self._client.get(K8sNodeResource, node)
        )
        return dict((found.metadata.labels if found.metadata else None) or {})

    def publish(self, patch: LabelPatch) -> dict[str, Any]:
        """Apply ``patch`` to its Node; answer the merge patch that was sent."""
        body = patch.merge_patch(self.current_labels(patch.node))
        self._retried(
            f"patching Node {patch.node}",
            lambda: self._client.patch(
                K8sNodeResource, patch.node, body, patch_type=PatchType.MERGE
            ),
        )
        return body

    def _retried(self, action: str, call: Callable[[], T]) -> T:
        delay = self._backoff_s
        for attempt in range(1, self._attempts + 1):
            try:
                return call()
            except ApiError as exc:
                code = exc.status.code or 0
                why = f"HTTP {code} {_HINTS.get(code, exc.status.reason or '')}".rstrip()
                if code == 404:
                    raise PublishError(f"{action} failed: {why}") from None
            except httpx2.HTTPError as exc:
                why = f"{exc.__class__.__name__}: {exc}"
            if attempt == self._attempts:
                raise PublishError(f"{action} failed {attempt} times; last: {why}")
            log.warning(
                "%s failed (attempt %d of %d): %s; retrying in %.1f s",
                action,
                attempt,
                self._attempts,
                why,
                delay,
            )
            self._sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")
