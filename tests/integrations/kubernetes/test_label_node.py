"""``topkv label-node``: the labels and annotations of a discovered node (from recorded tool
outputs), the merge patch against recorded Node objects (tests/fixtures/k8s-labels), the
label syntax rules, and publishing through the API stand-in (``api_standin``) with retries."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest

pytest.importorskip("lightkube", reason="the kubernetes extra: pip install -e '.[kubernetes]'")

from api_standin import ApiStandIn
from typer.testing import CliRunner

from topkv.cli.main import _typer_app
from topkv.errors import ConfigError
from topkv.integrations.kubernetes.client import api_client
from topkv.integrations.kubernetes.labels import (
    NICS_ANNOTATION,
    TOPOLOGY_ANNOTATION,
    check_label,
    is_label_value,
    label_value,
    node_labels,
)
from topkv.integrations.kubernetes.publish import NodePublisher, PublishError
from topkv.topology.build import discover_from_dir
from topkv.topology.detect.k8s import interpret_gpu_labels, is_label_key, parse_node_labels
from topkv.topology.model import NIC, Node

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
K8S = FIXTURES / "k8s-labels"
RECORDED = sorted(K8S.glob("*.txt"))


@pytest.fixture
def outputs(tmp_path: Path) -> Path:
    """Saved outputs of an 8x H100 NV18 node with 8 RDMA NICs (nvidia-smi topo + ibstat)."""
    d = tmp_path / "outputs"
    d.mkdir()
    shutil.copy(
        FIXTURES / "nvidia-smi-topo" / "sglang-30401-h100-8gpu-nv18-8nic.txt",
        d / "nvidia-smi-topo.txt",
    )
    shutil.copy(
        FIXTURES / "rdma" / "nccl-tests-128-cx6-hdr-ib-ibstat-partial.txt", d / "ibstat.txt"
    )
    return d


def _all_valid(labels: dict[str, str | None]) -> None:
    for key, value in labels.items():
        assert is_label_key(key), key
        if value is not None:
            assert is_label_value(value), (key, value)


def test_the_labels_describe_the_node_and_read_back(outputs: Path) -> None:
    node = discover_from_dir(outputs, name="gpu-node-7", gpu_name="H100")
    patch = node_labels(node)
    labels = patch.labels
    _all_valid(dict(labels))
    assert labels["topkv.io/gpu-count"] == "8"
    assert labels["topkv.io/nvlink-domain-kind"] == node.nvlink_domains[0].kind == "NVL8"
    assert labels["topkv.io/nvlink-domain"] == label_value(
        node.nvlink_domains[0].id.replace("/", ".")
    )
    assert labels["topkv.io/rdma-nics"] == ".".join(sorted(n.name for n in node.nics))
    assert labels["topkv.io/cxl-tier"] == "none"
    assert "H100" in labels["topkv.io/gpu-model"]
    # The hash is of exactly the topology JSON in the annotation, which round-trips.
    text = patch.annotations[TOPOLOGY_ANNOTATION]
    assert labels["topkv.io/topology-hash"] == hashlib.sha256(text.encode()).hexdigest()[:40]
    assert json.loads(text)["nodes"][0]["name"] == "gpu-node-7"
    assert patch.annotations[NICS_ANNOTATION].split(",") == sorted(n.name for n in node.nics)
    # What TopKV's own label reader makes of them.
    read = interpret_gpu_labels(
        parse_node_labels("\n".join(f"{k}={v}" for k, v in labels.items()))[0]
    )
    assert read.nvlink_domain_kind == "NVL8"
    assert read.rdma_nics == tuple(sorted(n.name for n in node.nics))


@pytest.mark.parametrize("recorded", RECORDED, ids=[p.name[:40] for p in RECORDED])
def test_the_patch_against_recorded_node_objects(outputs: Path, recorded: Path) -> None:
    (k8s_node, *_rest) = parse_node_labels(recorded.read_text())
    current = {**k8s_node.labels, "topkv.io/stale-label": "x", "topkv.io/gpu-count": "4"}
    node = discover_from_dir(outputs, name=k8s_node.name or "node0")
    patch = node_labels(node).merge_patch(current)
    labels = patch["metadata"]["labels"]
    _all_valid(labels)
    assert labels["topkv.io/stale-label"] is None  # removed
    assert labels["topkv.io/gpu-count"] == "8"  # replaced
    assert not any(k in labels for k in k8s_node.labels if not k.startswith("topkv.io/"))
    assert set(patch["metadata"]["annotations"]) == {TOPOLOGY_ANNOTATION, NICS_ANNOTATION}


def test_label_syntax_rules_and_values_that_cannot_be_sent() -> None:
    assert is_label_value("") and is_label_value("NVIDIA-H100-80GB-HBM3")
    for bad in ("-a", "a-", "a b", "x" * 64, "a/b", "é"):
        assert not is_label_value(bad), bad
    assert label_value(" NVIDIA H100 80GB HBM3 ") == "NVIDIA-H100-80GB-HBM3"
    assert label_value("node0/nvl8 (x)") == "node0-nvl8-x"
    with pytest.raises(ConfigError, match="breaks Kubernetes' value syntax"):
        check_label("topkv.io/gpu-model", "a b")
    with pytest.raises(ConfigError, match="not a valid Kubernetes label key"):
        check_label("topkv.io/" + "k" * 64, "v")
    # Sixteen NICs do not fit 63 characters: the label is left out, the annotation keeps them.
    nics = [NIC(name=f"mlx5_bond_{i}") for i in range(16)]
    patch = node_labels(Node(name="n", nics=nics))
    assert "topkv.io/rdma-nics" not in patch.labels
    assert "does not fit a label value" in patch.skipped["topkv.io/rdma-nics"]
    assert len(patch.annotations[NICS_ANNOTATION].split(",")) == 16
    _all_valid(patch.merge_patch({"topkv.io/rdma-nics": "old"})["metadata"]["labels"])
    assert (
        patch.merge_patch({"topkv.io/rdma-nics": "old"})["metadata"]["labels"]["topkv.io/rdma-nics"]
        is None
    )


def test_dry_run_prints_the_patch(outputs: Path, tmp_path: Path) -> None:
    recorded = K8S / "gfd-readme-a100-kubectl-get-nodes-yaml-abridged.txt"
    name = parse_node_labels(recorded.read_text())[0].name or "gpu-node-a"
    res = CliRunner().invoke(
        _typer_app,
        [
            "label-node",
            "--dry-run",
            "--from",
            str(outputs),
            "--node",
            name,
            "--node-object",
            str(recorded),
        ],
    )
    assert res.exit_code == 0, res.output
    patch = json.loads(res.stdout)
    assert patch["metadata"]["labels"]["topkv.io/gpu-count"] == "8"
    assert (
        json.loads(patch["metadata"]["annotations"][TOPOLOGY_ANNOTATION])["nodes"][0]["name"]
        == name
    )
    recorded = tmp_path / "node.yaml"
    recorded.write_text("kind: Node\nmetadata:\n  name: real\n  labels:\n    a: b\n")
    res = CliRunner().invoke(
        _typer_app,
        [
            "label-node",
            "--dry-run",
            "--from",
            str(outputs),
            "--node",
            "nope",
            "--node-object",
            str(recorded),
        ],
    )
    assert res.exit_code != 0 and "records no Node 'nope'" in str(res.exception)


def test_publish_through_the_stand_in_with_bounded_retries(
    outputs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    standin = ApiStandIn()
    try:
        standin.nodes["gpu-node-7"] = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": "gpu-node-7",
                "labels": {"kubernetes.io/hostname": "gpu-node-7", "topkv.io/stale-label": "x"},
            },
        }
        sleeps: list[float] = []
        publisher = NodePublisher(api_client(standin.url), sleep=sleeps.append)
        patch = node_labels(discover_from_dir(outputs, name="gpu-node-7"))
        standin.fail_next(500, 409)
        with caplog.at_level(logging.WARNING, logger="topkv.integrations.kubernetes.publish"):
            publisher.publish(patch)
        assert sleeps == [0.5, 1.0]
        assert "reading Node gpu-node-7 failed (attempt 1 of 4): HTTP 500" in caplog.text
        assert "conflict: the Node changed meanwhile" in caplog.text
        labels = standin.nodes["gpu-node-7"]["metadata"]["labels"]
        assert labels["kubernetes.io/hostname"] == "gpu-node-7"  # not touched
        assert "topkv.io/stale-label" not in labels
        assert labels == {"kubernetes.io/hostname": "gpu-node-7", **patch.labels}
        annotations = standin.nodes["gpu-node-7"]["metadata"]["annotations"]
        assert annotations[TOPOLOGY_ANNOTATION] == patch.annotations[TOPOLOGY_ANNOTATION]

        standin.fail_next(403, 403, 403, 403)
        with pytest.raises(PublishError, match=r"failed 4 times; last: HTTP 403 forbidden"):
            publisher.publish(patch)
        with pytest.raises(PublishError, match="no such Node"):
            publisher.publish(node_labels(Node(name="absent")))

        res = CliRunner().invoke(
            _typer_app,
            ["label-node", "--from", str(outputs), "--node", "gpu-node-7", "--server", standin.url],
        )
        assert res.exit_code == 0, res.output
        assert "labelled Node gpu-node-7" in res.stderr
    finally:
        standin.close()
