"""``topkv label-node [--dry-run]``: discover this node and publish its ``topkv.io/*`` labels
and annotations on its Node object (docs/kubernetes.md)."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import typer

from topkv.errors import ConfigError
from topkv.inputs import read_text
from topkv.jsonout import dumps
from topkv.topology.build import discover_from_dir, discover_local
from topkv.topology.detect.errors import ParseError
from topkv.topology.detect.k8s import parse_node_labels

NODE_NAME_ENV = "NODE_NAME"


def _current_labels(path: Path, node: str) -> dict[str, str]:
    """The labels of ``node`` in a recorded ``kubectl get node(s)`` output."""
    try:
        nodes = parse_node_labels(read_text(path, what="the recorded Node object"))
    except ParseError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    for recorded in nodes:
        if recorded.name in (node, ""):
            return recorded.labels
    names = ", ".join(n.name for n in nodes) or "none"
    raise ConfigError(f"{path} records no Node {node!r} (it has: {names}); pass --node")


def register(app: typer.Typer) -> None:
    @app.command("label-node")
    def label_node_command(
        node: str = typer.Option(
            "", "--node", help=f"the Node to label (default: ${NODE_NAME_ENV}, else the hostname)"
        ),
        from_dir: Path | None = typer.Option(
            None, "--from", help="saved tool outputs to discover from (default: probe here)"
        ),
        dry_run: bool = typer.Option(False, "--dry-run", help="print the patch; send nothing"),
        node_object: Path | None = typer.Option(
            None,
            "--node-object",
            help="with --dry-run: a recorded `kubectl get node -o yaml|json` whose topkv.io "
            "labels the patch replaces",
        ),
        server: str | None = typer.Option(
            None, "--server", help="API server URL (default: in-cluster, else $KUBECONFIG)"
        ),
        log_level: str = typer.Option("warning", help="debug | info | warning | error"),
    ) -> None:
        """Publish this node's topology as topkv.io/* labels and annotations."""
        logging.basicConfig(level=getattr(logging, log_level.upper(), logging.WARNING))
        from topkv.integrations.kubernetes.labels import node_labels

        name = node or os.environ.get(NODE_NAME_ENV) or socket.gethostname()
        found = discover_from_dir(from_dir, name=name) if from_dir else discover_local(name=name)
        patch = node_labels(found)
        for key, why in patch.skipped.items():
            typer.echo(f"topkv: label {key} not sent: {why}", err=True)
        if dry_run:
            current = _current_labels(node_object, name) if node_object else {}
            typer.echo(dumps(patch.merge_patch(current), indent=2))
            return
        if node_object is not None:
            raise ConfigError("--node-object goes with --dry-run (a live run reads the Node)")
        from topkv.integrations.kubernetes.client import api_client
        from topkv.integrations.kubernetes.publish import NodePublisher

        sent = NodePublisher(api_client(server)).publish(patch)
        labels = sent["metadata"]["labels"]
        typer.echo(f"labelled Node {name}: {len(labels)} topkv.io labels", err=True)
