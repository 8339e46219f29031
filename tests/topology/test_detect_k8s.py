"""Kubernetes node-label parsing and GPU label interpretation: fixtures, variants, fuzzing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from fuzzing import fuzz_arbitrary_text, fuzz_mutated_fixtures
from hypothesis import strategies as st

from topkv.topology.detect.errors import ParseError
from topkv.topology.detect.k8s import (
    GpuNodeLabels,
    K8sNode,
    interpret_gpu_labels,
    parse_node_labels,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "k8s-labels"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


# --------------------------------------------------------------------------- fixtures


def test_gfd_readme_abridged_yaml_list() -> None:
    (node,) = parse_node_labels(fixture("gfd-readme-a100-kubectl-get-nodes-yaml-abridged.txt"))
    assert node.name == ""  # the README abridged the name away
    assert len(node.labels) == 13
    assert node.labels["nvidia.com/gpu.machine"] == "NVIDIA DGX-2H"
    assert node.labels["nvidia.com/cuda.driver.minor"] == "06"  # a string, not the int 6
    assert node.labels["nvidia.com/cuda.driver.rev"] == ""
    gpu = interpret_gpu_labels(node)
    assert gpu == GpuNodeLabels(
        product="A100-SXM4-40GB",
        count=1,
        memory_mb=39538,
        clique=None,
        family="ampere",
        mig_strategy=None,
        mig_devices={},
        nvlink_domain=None,
        topkv={},
    )


def test_describe_node_labels_excerpt_without_header() -> None:
    (node,) = parse_node_labels(
        fixture("k8s-device-plugin-1501-h100-xe9680-describe-node-labels-excerpt.txt")
    )
    assert len(node.labels) == 18
    assert node.labels["nvidia.com/gpu.machine"] == "PowerEdge-XE9680"
    assert node.labels["nvidia.com/mig.capable"] == "true"
    gpu = interpret_gpu_labels(node)
    assert (gpu.product, gpu.count, gpu.memory_mb, gpu.family) == (
        "NVIDIA-H100-80GB-HBM3",
        8,
        81559,
        "hopper",
    )
    assert gpu.mig_devices == {} and gpu.clique is None


def test_mig_labels_grep_excerpt() -> None:
    (node,) = parse_node_labels(
        fixture("prem-operator-39-a100-sxm4-40gb-mig-7g40gb-labels-grep-excerpt.txt")
    )
    assert len(node.labels) == 10
    assert node.labels["nvidia.com/mig-7g.40gb.product"] == "NVIDIA-A100-SXM4-40GB-MIG-7g.40gb"
    gpu = interpret_gpu_labels(node)
    assert gpu.mig_devices == {"7g.40gb": 4}
    assert gpu.product is None and gpu.count is None


# --------------------------------------------------------------------------- other forms

LABELS = {
    "kubernetes.io/hostname": "gb200-n07",
    "nvidia.com/gpu.product": "NVIDIA-GB200",
    "nvidia.com/gpu.count": "4",
    "nvidia.com/gpu.memory": "189471",
    "nvidia.com/gpu.clique": "4b7c0f9a-1e2d-4c3b-9a8f-0123456789ab.32766",
    "nvidia.com/gpu.present": "true",
    "nvidia.com/mig.strategy": "mixed",
    "nvidia.com/mig-1g.23gb.count": "7",
    "topkv.io/nvlink-domain": "rack-a07",
    "topkv.io/nvlink-domain-kind": "nvl72",
    "topkv.io/rdma-nics": "mlx5_0.mlx5_1.mlx5_2.mlx5_3",
}


def _node_doc(name: str, labels: dict[str, str]) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"annotations": {"a": "b"}, "labels": labels, "name": name, "uid": "x"},
        "spec": {},
        "status": {"capacity": {"nvidia.com/gpu": "4"}},
    }


def test_single_node_yaml_and_json() -> None:
    doc = _node_doc("gb200-n07", LABELS)
    for text in (yaml.safe_dump(doc), json.dumps(doc, indent=4)):
        assert parse_node_labels(text) == [K8sNode("gb200-n07", LABELS)]


def test_list_yaml_and_json_keep_node_order() -> None:
    doc = {
        "apiVersion": "v1",
        "kind": "List",
        "items": [_node_doc("a", {"x": "1"}), _node_doc("b", LABELS)],
    }
    for text in (yaml.safe_dump(doc), json.dumps(doc)):
        assert parse_node_labels(text) == [K8sNode("a", {"x": "1"}), K8sNode("b", LABELS)]
    assert parse_node_labels("apiVersion: v1\nitems: []\nkind: List\n") == []


def test_yaml_unquoted_booleans_and_numbers_stay_strings() -> None:
    text = "metadata:\n  name: n1\n  labels:\n    gpu.present: true\n    minor: 06\n"
    assert parse_node_labels(text) == [K8sNode("n1", {"gpu.present": "true", "minor": "06"})]


def test_abridged_yaml_name_after_labels() -> None:
    text = (
        "apiVersion: v1\nkind: Node\nmetadata:\n  ...\n  labels:\n"
        '    nvidia.com/gpu.count: "8"\n    ...\n  name: h100-17\n  uid: 1234\n'
    )
    assert parse_node_labels(text) == [K8sNode("h100-17", {"nvidia.com/gpu.count": "8"})]


def test_jsonpath_label_map() -> None:
    assert parse_node_labels(json.dumps(LABELS)) == [K8sNode("", LABELS)]


def test_describe_nodes_two_nodes() -> None:
    text = (
        "Name:               n1\nRoles:              <none>\n"
        "Labels:             beta.kubernetes.io/arch=amd64\n"
        "                    nvidia.com/gpu.count=8\n"
        "                    topkv.io/nvlink-domain=n1-nvl8\n"
        "Annotations:        node.alpha.kubernetes.io/ttl: 0\n"
        "CreationTimestamp:  Mon, 01 Jan 2024 00:00:00 +0000\n\n\n"
        "Name:               n2\nRoles:              control-plane\n"
        "Labels:             <none>\nAnnotations:        <none>\n"
    )
    nodes = parse_node_labels(text)
    assert nodes == [
        K8sNode(
            "n1",
            {
                "beta.kubernetes.io/arch": "amd64",
                "nvidia.com/gpu.count": "8",
                "topkv.io/nvlink-domain": "n1-nvl8",
            },
        ),
        K8sNode("n2", {}),
    ]
    assert interpret_gpu_labels(nodes[0]).nvlink_domain == "n1-nvl8"


def test_show_labels_table() -> None:
    text = (
        "NAME     STATUS   ROLES    AGE   VERSION   LABELS\n"
        "node-a   Ready    <none>   5d    v1.29.1   kubernetes.io/os=linux,nvidia.com/gpu.count=4\n"
        "node-b   Ready    <none>   5d    v1.29.1   <none>\n"
    )
    assert parse_node_labels(text) == [
        K8sNode("node-a", {"kubernetes.io/os": "linux", "nvidia.com/gpu.count": "4"}),
        K8sNode("node-b", {}),
    ]


def test_key_value_lines_with_ansi_crlf_and_comments() -> None:
    text = "\x1b[01;31mnvidia.com/gpu.count\x1b[m=8\r\nnvidia.com/gpu.family=hopper  # H100\r\n"
    assert parse_node_labels(text) == [
        K8sNode("", {"nvidia.com/gpu.count": "8", "nvidia.com/gpu.family": "hopper"})
    ]


def test_interpret_topkv_and_clique_labels() -> None:
    gpu = interpret_gpu_labels(K8sNode("gb200-n07", LABELS))
    assert (gpu.product, gpu.count, gpu.memory_mb) == ("NVIDIA-GB200", 4, 189471)
    assert gpu.clique_cluster_uuid == "4b7c0f9a-1e2d-4c3b-9a8f-0123456789ab"
    assert gpu.clique_id == "32766"
    assert (gpu.mig_strategy, gpu.mig_devices) == ("mixed", {"1g.23gb": 7})
    assert gpu.nvlink_domain == "rack-a07"
    assert gpu.nvlink_domain_kind == "NVL72"
    assert gpu.rdma_nics == ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3")
    assert gpu.topkv == {
        "nvlink-domain": "rack-a07",
        "nvlink-domain-kind": "nvl72",
        "rdma-nics": "mlx5_0.mlx5_1.mlx5_2.mlx5_3",
    }
    bare = interpret_gpu_labels(K8sNode("cpu-only", {"kubernetes.io/os": "linux"}))
    assert bare.product is None and bare.nvlink_domain_kind is None and bare.rdma_nics == ()


@pytest.mark.parametrize("label", ["nvidia.com/gpu.count", "nvidia.com/mig-1g.5gb.count"])
def test_interpret_rejects_non_numeric_counts(label: str) -> None:
    with pytest.raises(ParseError, match=label.replace(".", r"\.")):
        interpret_gpu_labels(K8sNode("n", {label: "eight"}))


def test_empty_and_junk() -> None:
    assert parse_node_labels("") == []
    assert parse_node_labels(" \n...\n") == []
    with pytest.raises(ParseError, match="no labels found"):
        parse_node_labels("this is not kubectl output\n")


# --------------------------------------------------------------------------- fuzzing

ALL_TEXTS = [p.read_text() for p in sorted(FIXTURES.iterdir())] + [
    yaml.safe_dump(_node_doc("n", LABELS)),
    json.dumps(_node_doc("n", LABELS)),
]
ALPHABET = st.sampled_from(list("abnmelsidtv.-_/0123456789 \t\n:=\"'{}[],#-<>\x1b"))


def _only_parse_errors(text: str) -> None:
    try:
        nodes = parse_node_labels(text)
        for node in nodes:
            assert isinstance(node.name, str)
            assert all(isinstance(k, str) and isinstance(v, str) for k, v in node.labels.items())
            interpret_gpu_labels(node)
    except ParseError:
        return


@fuzz_arbitrary_text(ALPHABET)
def test_fuzz_arbitrary_text(text: str) -> None:
    _only_parse_errors(text)


@fuzz_mutated_fixtures(ALL_TEXTS, ALPHABET)
def test_fuzz_mutated_fixtures(text: str) -> None:
    _only_parse_errors(text)


def test_go_map_and_indented_describe_paste() -> None:
    assert parse_node_labels("map[kubernetes.io/arch:amd64 nvidia.com/gpu.count:8]\n") == [
        K8sNode("", {"kubernetes.io/arch": "amd64", "nvidia.com/gpu.count": "8"})
    ]
    text = (
        "    Name:               n1\n    Roles:              <none>\n"
        "    Labels:             nvidia.com/gpu.count=2\n"
        "                        nvidia.com/gpu.product=NVIDIA-L40S\n"
        "    Annotations:        x: y\n"
    )
    assert parse_node_labels(text) == [
        K8sNode("n1", {"nvidia.com/gpu.count": "2", "nvidia.com/gpu.product": "NVIDIA-L40S"})
    ]
