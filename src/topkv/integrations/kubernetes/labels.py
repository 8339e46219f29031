"""The ``topkv.io/*`` labels and annotations ``topkv label-node`` publishes for one node,
and the merge patch that sets them on its Node object. Pure: no API calls.

:func:`node_labels` turns a discovered node into a :class:`LabelPatch`: the labels
``nvlink-domain``, ``nvlink-domain-kind``, ``gpu-count``, ``gpu-model``, ``rdma-nics``,
``cxl-tier`` and ``topology-hash`` (the set :mod:`topkv.topology.detect.k8s` reads back), and
the :data:`TOPOLOGY_ANNOTATION` and :data:`NICS_ANNOTATION` annotations;
:meth:`LabelPatch.merge_patch` checks every label (:func:`check_label`) and removes stale
``topkv.io/*`` ones. Values and rules: docs/kubernetes.md ("Node labels").
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from topkv.errors import ConfigError
from topkv.topology.detect.k8s import TOPKV_LABEL_PREFIX, is_label_key
from topkv.topology.model import Cluster, Node

TOPOLOGY_ANNOTATION = TOPKV_LABEL_PREFIX + "topology"
NICS_ANNOTATION = TOPKV_LABEL_PREFIX + "rdma-nics"
MAX_LABEL_VALUE = 63
#: Kubernetes caps all annotations of an object together at 256 KiB.
MAX_ANNOTATIONS_BYTES = 256 * 1024
HASH_DIGITS = 40
_VALUE = re.compile(r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
_BAD_CHARS = re.compile(r"[^-A-Za-z0-9_.]+")


def is_label_value(value: str) -> bool:
    """Kubernetes label value syntax: empty, or <= 63 of [A-Za-z0-9._-], alnum at both ends."""
    return len(value) <= MAX_LABEL_VALUE and _VALUE.fullmatch(value) is not None


def check_label(key: str, value: str) -> None:
    """ConfigError unless ``key=value`` is a valid Kubernetes label."""
    if not is_label_key(key):
        raise ConfigError(f"{key!r} is not a valid Kubernetes label key")
    if not is_label_value(value):
        raise ConfigError(
            f"label {key}={value!r} breaks Kubernetes' value syntax (at most 63 characters "
            "from [A-Za-z0-9._-], alphanumeric at both ends)"
        )


def label_value(text: str) -> str:
    """``text`` in label syntax: runs of other characters become ``-``, ends trimmed to
    alphanumerics (the result may still be too long: the caller checks)."""
    cleaned = _BAD_CHARS.sub("-", text.strip())
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", cleaned)


def topology_json(node: Node) -> str:
    """The canonical topology JSON of ``node`` (sorted keys, no spaces): what is hashed."""
    cluster = Cluster(nodes=[node]).model_dump(mode="json")
    return json.dumps(cluster, sort_keys=True, separators=(",", ":"))


@dataclass
class LabelPatch:
    """What one run publishes: labels and annotations, and the labels it could not send."""

    node: str
    labels: dict[str, str]
    annotations: dict[str, str]
    skipped: dict[str, str] = field(default_factory=dict)  # key -> why

    def merge_patch(self, current_labels: dict[str, str] | None = None) -> dict[str, Any]:
        """The JSON merge patch for the Node: these labels, ``null`` for the node's other
        ``topkv.io/*`` labels, these annotations."""
        labels: dict[str, str | None] = {
            key: None
            for key in sorted(current_labels or {})
            if key.startswith(TOPKV_LABEL_PREFIX) and key not in self.labels
        }
        labels.update(self.labels)
        for key, value in labels.items():
            if value is not None:
                check_label(key, value)  # never send a label that breaks the syntax
        return {"metadata": {"labels": labels, "annotations": dict(self.annotations)}}


def node_labels(node: Node) -> LabelPatch:
    """The labels and annotations that describe ``node``; see the module docstring."""
    wanted: dict[str, str] = {}
    domain = node.nvlink_domains[0] if node.nvlink_domains else None
    if domain is not None:
        wanted["nvlink-domain"] = label_value(domain.id.replace("/", "."))
        wanted["nvlink-domain-kind"] = domain.kind
    else:
        wanted["nvlink-domain-kind"] = "none"
    wanted["gpu-count"] = str(len(node.gpus))
    models = sorted({g.name for g in node.gpus if g.name})
    if models:
        wanted["gpu-model"] = label_value("_".join(models))
    nics = sorted(n.name for n in node.nics)
    wanted["rdma-nics"] = ".".join(nics)
    cxl = next((t for t in node.memory_tiers if t.name == "cxl"), None)
    if cxl is None:
        wanted["cxl-tier"] = "none"
    else:
        wanted["cxl-tier"] = f"numa{cxl.numa}" if cxl.numa is not None else "present"
    text = topology_json(node)
    wanted["topology-hash"] = hashlib.sha256(text.encode()).hexdigest()[:HASH_DIGITS]

    patch = LabelPatch(node=node.name, labels={}, annotations={TOPOLOGY_ANNOTATION: text})
    if nics:
        patch.annotations[NICS_ANNOTATION] = ",".join(nics)
    for name, value in wanted.items():
        key = TOPKV_LABEL_PREFIX + name
        if is_label_value(value):
            patch.labels[key] = value
        else:
            patch.skipped[key] = (
                f"{value!r} does not fit a label value (at most 63 characters from "
                "[A-Za-z0-9._-]); the annotations keep the full topology"
            )
    size = sum(len(k) + len(v) for k, v in patch.annotations.items())
    if size > MAX_ANNOTATIONS_BYTES:
        raise ConfigError(
            f"the topology of node {node.name!r} is {size} bytes, over Kubernetes' 256 KiB "
            "limit on annotations"
        )
    return patch
