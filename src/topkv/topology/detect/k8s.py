"""Kubernetes node labels as a topology source.

:func:`parse_node_labels` reads what people run and paste:

- ``kubectl get node X -o yaml`` (one Node) or ``kubectl get nodes -o yaml`` (a List),
  also abridged copies with ``...`` lines that are no longer valid YAML;
- ``kubectl get node(s) -o json`` and ``-o jsonpath='{.metadata.labels}'`` (a bare map);
- ``kubectl describe node(s)`` (``Name:`` and the ``Labels:`` block with its continuation
  lines), also excerpts that lost the ``Labels:`` header;
- ``kubectl get nodes --show-labels`` (a table whose last column is ``k=v,k=v``);
- plain ``key=value`` or ``key: value`` lines, e.g. from ``grep`` or ``kubectl label --list``;
- old kubectl's jsonpath map printing ``map[key:value key:value]``.

Nodes whose name is not in the text get ``name=""``. Empty input yields ``[]`` (as does a
List with no items); non-empty text without any label raises :class:`ParseError`.

:func:`interpret_gpu_labels` turns GPU Feature Discovery's ``nvidia.com/*`` labels and
TopKV's own ``topkv.io/*`` labels into typed fields (see docs/parsers.md for the label set).
"""

from __future__ import annotations

import json
import re
import textwrap
from dataclasses import dataclass, field
from typing import Any

import yaml

from topkv.inputs import NoAliasBaseLoader
from topkv.topology.detect.errors import ParseError

TOPKV_LABEL_PREFIX = "topkv.io/"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\x1b[()][0-9A-Za-z]")
_DNS_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_LABEL_KEY = re.compile(
    rf"(?:{_DNS_LABEL}(?:\.{_DNS_LABEL})*/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?"
)
_KV_EQUALS = re.compile(r"^\s*(?P<key>[^\s=:\"']+)=(?P<value>.*?)\s*$")
_KV_COLON = re.compile(
    r"^(?P<indent>\s*)(?:\"(?P<qkey>[^\"]+)\"|(?P<key>[^\s:\"'#-][^\s:\"']*))\s*:\s*(?P<value>.*?)\s*,?\s*$"
)


@dataclass(frozen=True)
class K8sNode:
    """A Kubernetes node's name (``""`` when unknown) and labels."""

    name: str
    labels: dict[str, str]


def is_label_key(key: str) -> bool:
    """Kubernetes label key syntax: optional ``dns.prefix/`` then a name of up to 63 chars."""
    if len(key) > 317 or not _LABEL_KEY.fullmatch(key):
        return False
    name = key.rsplit("/", 1)[-1]
    return len(name) <= 63


def _scalar(value: Any) -> str | None:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return ""
    if isinstance(value, str | int | float):
        return str(value)
    return None


def _labels_from_map(raw: Any) -> dict[str, str] | None:
    if not isinstance(raw, dict):
        return None
    labels: dict[str, str] = {}
    for key, value in raw.items():
        text = _scalar(value)
        if not isinstance(key, str) or text is None:
            return None
        labels[key] = text
    return labels


def _node_from_object(obj: dict[Any, Any]) -> K8sNode | None:
    meta = obj.get("metadata")
    holder = meta if isinstance(meta, dict) else obj
    raw_labels = holder.get("labels")
    if raw_labels is None and not isinstance(meta, dict):
        return None
    labels = _labels_from_map(raw_labels if raw_labels is not None else {})
    if labels is None:
        return None
    name = holder.get("name")
    return K8sNode(name=name if isinstance(name, str) else "", labels=labels)


def _nodes_from_document(doc: Any) -> list[K8sNode] | None:
    """Nodes from a decoded YAML/JSON document, or ``None`` if it is not node-shaped."""
    if isinstance(doc, list):
        found = [_nodes_from_document(item) for item in doc]
        if found and all(f is not None for f in found):
            return [node for nodes in found if nodes for node in nodes]
        return None
    if not isinstance(doc, dict):
        return None
    if "items" in doc:
        items = doc["items"]
        if items is None or items == "":
            return []
        if not isinstance(items, list):
            return None
        nodes = [n for item in items if isinstance(item, dict) and (n := _node_from_object(item))]
        return nodes if nodes or not items else None
    node = _node_from_object(doc)
    if node is not None:
        return [node]
    # a bare label map (jsonpath, or a YAML excerpt): string keys to string values, as
    # Kubernetes has them, among them a prefixed one (every node has kubernetes.io/os ...);
    # a JSON number or list there, or only plain keys, is some other document
    labels = _labels_from_map(doc) if all(isinstance(v, str) for v in doc.values()) else None
    if labels and all(is_label_key(k) for k in labels) and any("/" in k for k in labels):
        return [K8sNode(name="", labels=labels)]
    return None


def _decode_structured(text: str) -> list[K8sNode] | None:
    stripped = text.strip()
    if stripped[:1] in {"{", "["}:
        try:
            return _nodes_from_document(json.loads(stripped))
        except (ValueError, RecursionError):
            pass
    try:
        # every scalar a string; aliases refused (kubectl writes none; nothing expands)
        doc = yaml.load(text, Loader=NoAliasBaseLoader)
    except (yaml.YAMLError, ValueError, RecursionError):
        return None
    return _nodes_from_document(doc)


def _unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] == '"':
        try:
            decoded = json.loads(value)
        except ValueError:
            return value[1:-1]
        return decoded if isinstance(decoded, str) else value[1:-1]
    if len(value) >= 2 and value[0] == value[-1] == "'":
        return value[1:-1].replace("''", "'")
    return re.sub(r"\s+#.*$", "", value)


# A top-level field of ``kubectl describe node`` other than Name/Labels ("Annotations:",
# "Taints:", "Capacity:"...): its indented continuation lines are not labels.
_DESCRIBE_SECTION = re.compile(r"^(?!Labels:|Name:)[A-Z][A-Za-z ]{1,40}:(\s|$)")


class _NodeBuilder:
    def __init__(self, name: str = "") -> None:
        self.name = name
        self.labels: dict[str, str] = {}

    def build(self) -> K8sNode:
        return K8sNode(name=self.name, labels=self.labels)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _scan_lines(text: str) -> list[K8sNode]:
    """Line-oriented reading of describe output, --show-labels tables, broken YAML and
    plain key=value/key: value lines."""
    nodes: list[_NodeBuilder] = []
    loose = _NodeBuilder()
    mode: str | None = None  # "describe" | "yaml" | "table"
    block: _NodeBuilder | None = None
    block_indent = 0
    described: _NodeBuilder | None = None
    names_at: dict[int, str] = {}
    for raw in text.split("\n"):
        line = raw.rstrip()
        content = line.strip()
        if not content or content in {"...", "---"} or content.startswith("```"):
            continue
        indent = _indent(line)
        names_at = {i: n for i, n in names_at.items() if i <= indent}
        if mode == "table":
            tokens = content.split()
            if len(tokens) >= 2:
                node = _NodeBuilder(tokens[0])
                for item in tokens[-1].split(","):
                    if (m := _KV_EQUALS.match(item)) and is_label_key(m.group("key")):
                        node.labels[m.group("key")] = m.group("value")
                nodes.append(node)
            continue
        if re.match(r"^NAME\s+.*\bLABELS$", content) and indent == 0:
            mode = "table"
            continue
        if indent == 0 and (m := re.match(r"^Name:\s*(\S+)\s*$", line)):
            described = _NodeBuilder(m.group(1))
            nodes.append(described)
            mode = None
            continue
        if indent == 0 and (m := re.match(r"^Labels:\s*(.*)$", line)):
            if described is None:
                described = _NodeBuilder()
                nodes.append(described)
            mode, block = "describe", described
            first = m.group(1).strip()
            if (kv := _KV_EQUALS.match(first)) and is_label_key(kv.group("key")):
                block.labels[kv.group("key")] = _unquote(kv.group("value"))
            continue
        if mode == "describe" and block is not None:
            if indent > 0 and (kv := _KV_EQUALS.match(line)) and is_label_key(kv.group("key")):
                block.labels[kv.group("key")] = _unquote(kv.group("value"))
                continue
            if indent == 0:
                mode, block = None, None
        if mode == "describe-other":
            if indent > 0:
                continue  # an Annotations:/Taints:/... block of describe output: not labels
            mode = None
        if described is not None and indent == 0 and _DESCRIBE_SECTION.match(line):
            mode = "describe-other"
            continue
        if mode == "yaml" and block is not None:
            if indent > block_indent:
                m = _KV_COLON.match(line)
                key = (m.group("qkey") or m.group("key")) if m else None
                if m and key and is_label_key(key):
                    block.labels[key] = _unquote(m.group("value"))
                continue
            mode = None
        m = _KV_COLON.match(line)
        if m and m.group("key") == "labels" and m.group("value") in {"", "{}"}:
            block = _NodeBuilder(names_at.get(indent, ""))
            nodes.append(block)
            block_indent = indent
            mode = "yaml" if m.group("value") == "" else None
            continue
        if m and m.group("key") == "name" and m.group("value"):
            name = _unquote(m.group("value"))
            names_at[indent] = name
            if block is not None and block_indent == indent and not block.name:
                block.name = name
            continue
        key = (m.group("qkey") or m.group("key")) if m else None
        if m and key and "/" in key and is_label_key(key):
            loose.labels[key] = _unquote(m.group("value"))
        elif (kv := _KV_EQUALS.match(line)) and is_label_key(kv.group("key")):
            loose.labels[kv.group("key")] = _unquote(kv.group("value"))
    if loose.labels:
        nodes.append(loose)
    return [node.build() for node in nodes]


_GO_MAP = re.compile(r"map\[(.*)\]", re.DOTALL)


def _go_map_labels(body: str) -> dict[str, str]:
    """Old kubectl jsonpath printing of a map: ``map[a/b:c d:e]``."""
    labels: dict[str, str] = {}
    for item in body.split():
        key, sep, value = item.partition(":")
        if not sep or not is_label_key(key):
            raise ParseError(f"kubectl node labels: {item[:40]!r} in map[...] is not key:value")
        labels[key] = value
    return labels


def parse_node_labels(text: str) -> list[K8sNode]:
    """Nodes and their labels from any of the kubectl outputs listed in the module doc."""
    text = _ANSI.sub("", text).replace("\r\n", "\n").replace("\r", "\n")
    if not text.strip():
        return []
    text = textwrap.dedent(text)  # a whole paste indented (e.g. inside a Markdown list)
    if go_map := _GO_MAP.fullmatch(text.strip()):
        return [K8sNode(name="", labels=_go_map_labels(go_map.group(1)))]
    looks_described = re.search(r"(?m)^(Labels|Name):", text) is not None
    looks_table = re.search(r"(?m)^NAME\s+.*\bLABELS\s*$", text) is not None
    if not looks_described and not looks_table:
        structured = _decode_structured(text)
        if structured is not None:
            return structured
    nodes = _scan_lines(text)
    if not nodes:
        first = next(line.strip() for line in text.split("\n") if line.strip())
        if first in {"...", "---"} and all(
            ln.strip() in {"", "...", "---"} for ln in text.split("\n")
        ):
            return []
        raise ParseError(f"kubectl node labels: no labels found (first line: {first[:60]!r})")
    return nodes


# --------------------------------------------------------------------------- interpretation


@dataclass(frozen=True)
class GpuNodeLabels:
    """GPU facts from GPU Feature Discovery labels plus TopKV's own ``topkv.io/*`` labels.

    ``memory_mb`` is per GPU (GFD's ``nvidia.com/gpu.memory``, MiB); ``mig_devices`` maps a
    MIG profile (``7g.40gb``) to its ``nvidia.com/mig-<profile>.count``; ``topkv`` holds
    every ``topkv.io/*`` label with the prefix removed.
    """

    product: str | None
    count: int | None
    memory_mb: int | None
    clique: str | None
    family: str | None
    mig_strategy: str | None
    mig_devices: dict[str, int] = field(default_factory=dict)
    nvlink_domain: str | None = None
    topkv: dict[str, str] = field(default_factory=dict)

    @property
    def nvlink_domain_kind(self) -> str | None:
        """``NVL72``, ``NVL8`` or ``none`` from ``topkv.io/nvlink-domain-kind``."""
        kind = self.topkv.get("nvlink-domain-kind")
        if kind is None or not kind.strip():
            return None
        return "none" if kind.strip().lower() == "none" else kind.strip().upper()

    @property
    def rdma_nics(self) -> tuple[str, ...]:
        """RDMA device names from ``topkv.io/rdma-nics`` (``.``-separated, ``,`` accepted)."""
        value = self.topkv.get("rdma-nics", "")
        return tuple(n for n in re.split(r"[.,;\s]+", value) if n)

    @property
    def clique_cluster_uuid(self) -> str | None:
        """The MNNVL ClusterUUID part of ``nvidia.com/gpu.clique`` (``<uuid>.<clique id>``)."""
        if not self.clique or "." not in self.clique:
            return None
        return self.clique.rsplit(".", 1)[0] or None

    @property
    def clique_id(self) -> str | None:
        """The CliqueId part of ``nvidia.com/gpu.clique``."""
        if not self.clique or "." not in self.clique:
            return None
        return self.clique.rsplit(".", 1)[1] or None


def _int_label(labels: dict[str, str], key: str) -> int | None:
    value = labels.get(key)
    if value is None or not value.strip():
        return None
    if not re.fullmatch(r"\s*\d{1,12}\s*", value):
        raise ParseError(f"node labels: {key}={value[:40]!r} is not a non-negative integer")
    return int(value)


def _text_label(labels: dict[str, str], key: str) -> str | None:
    value = labels.get(key)
    return value.strip() or None if value is not None else None


def interpret_gpu_labels(node: K8sNode) -> GpuNodeLabels:
    """Typed view of one node's GPU labels; malformed numbers raise :class:`ParseError`."""
    labels = node.labels
    mig: dict[str, int] = {}
    for key in labels:
        m = re.fullmatch(r"nvidia\.com/mig-(.+)\.count", key)
        if m:
            count = _int_label(labels, key)
            if count is not None:
                mig[m.group(1)] = count
    topkv = {
        key.removeprefix(TOPKV_LABEL_PREFIX): value
        for key, value in labels.items()
        if key.startswith(TOPKV_LABEL_PREFIX)
    }
    return GpuNodeLabels(
        product=_text_label(labels, "nvidia.com/gpu.product"),
        count=_int_label(labels, "nvidia.com/gpu.count"),
        memory_mb=_int_label(labels, "nvidia.com/gpu.memory"),
        clique=_text_label(labels, "nvidia.com/gpu.clique"),
        family=_text_label(labels, "nvidia.com/gpu.family"),
        mig_strategy=_text_label(labels, "nvidia.com/mig.strategy"),
        mig_devices=mig,
        nvlink_domain=_text_label(labels, TOPKV_LABEL_PREFIX + "nvlink-domain"),
        topkv=topkv,
    )
