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
from topkv.relay.orchestrator_config import RetryPolicy

log = logging.getLogger(__name__)
T = TypeVar("T")
Sleep = Callable[[float], None]
#: 4 tries, 0.5 / 1 / 2 s apart.
PUBLISH_RETRY = RetryPolicy(max_retries=3, backoff_s=0.5)

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
        self, client: Client, retry: RetryPolicy = PUBLISH_RETRY, sleep: Sleep = time.sleep
    ) -> None:
        """``retry``: ``max_retries`` more tries after a failure, ``delay(n)`` before each."""
        self._client, self._retry, self._sleep = client, retry, sleep

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
        attempts = self._retry.max_retries + 1
        for attempt in range(1, attempts + 1):
            try:
                return call()
            except ApiError as exc:
                code = exc.status.code or 0
                why = f"HTTP {code} {_HINTS.get(code, exc.status.reason or '')}".rstrip()
                if code == 404:
                    raise PublishError(f"{action} failed: {why}") from None
            except httpx2.HTTPError as exc:
                why = f"{exc.__class__.__name__}: {exc}"
            if attempt == attempts:
                break
            delay = self._retry.delay(attempt)
            log.warning(
                "%s failed (attempt %d of %d): %s; retrying in %.1f s",
                action,
                attempt,
                attempts,
                why,
                delay,
            )
            self._sleep(delay)
        raise PublishError(f"{action} failed {attempts} times; last: {why}")
