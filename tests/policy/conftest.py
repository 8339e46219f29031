"""Topologies for the policy tests, built from tests/fixtures ``nvidia-smi topo -m``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from topkv.topology.detect.nvidia_smi import parse_topo_matrix
from topkv.topology.model import GPU, NIC, Cluster, Link, Node, NVLinkDomain
from topkv.topology.paths import make_link, nvlink_count, nvlink_generation_for

TOPO_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi-topo"


def node_from_topo(fixture: str, name: str, gpu_name: str) -> Node:
    """One node from a ``topo -m`` fixture: GPUs with NUMA, NICs, links, its NVL8 domain."""
    matrix = parse_topo_matrix((TOPO_DIR / fixture).read_text(encoding="utf-8"))
    generation = nvlink_generation_for(gpu_name)
    source = f"fixture {fixture}"
    links: list[Link] = [
        make_link(f"GPU{a}", f"GPU{b}", kind, generation, source)
        for a, b, kind in matrix.gpu_pairs()
    ]
    links += [
        make_link(f"GPU{g}", nic, kind, generation, source)
        for g, nic, kind in matrix.gpu_nic_pairs()
    ]
    nvlinked = sorted(
        {g for a, b, kind in matrix.gpu_pairs() if nvlink_count(kind) for g in (a, b)}
    )
    domain_id = f"{name}/nvl8"
    gpus = [
        GPU(
            index=i,
            name=gpu_name,
            numa=next(iter(matrix.rows[i].numa_affinity), None) if i in matrix.rows else None,
            nvlink_domain=domain_id if i in nvlinked else None,
        )
        for i in matrix.gpu_indices
    ]
    domains = (
        [NVLinkDomain(id=domain_id, kind="NVL8", members=[f"{name}/GPU{i}" for i in nvlinked])]
        if nvlinked
        else []
    )
    nics = [NIC(name=n.name, label=n.label) for n in matrix.nics]
    return Node(name=name, gpus=gpus, nics=nics, links=links, nvlink_domains=domains)


@pytest.fixture
def two_node_cluster() -> Callable[[str, str], Cluster]:
    """``(fixture, gpu_name) -> Cluster`` of two identical nodes ``node-0`` and ``node-1``."""

    def build(fixture: str, gpu_name: str) -> Cluster:
        return Cluster.replicate(node_from_topo(fixture, "node", gpu_name), 2)

    return build
