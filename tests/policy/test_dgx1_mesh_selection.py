"""A DGX-1 hybrid cube mesh: one NVLink-connected group, yet some pairs only meet over SYS.

Algorithm 1's "same NVLink domain" must mean "reachable over NVLink" for such pairs,
otherwise it would pick NVLink for a pair that has no NVLink path.
"""

from __future__ import annotations

from pathlib import Path

from topkv.policy.adapters import pair_view_from_cluster
from topkv.policy.select import PaperPolicy
from topkv.policy.view import Endpoint, TransferRequest
from topkv.topology.build import discover_from_files
from topkv.topology.model import Cluster

DATA = Path(__file__).resolve().parents[1] / "topology" / "data" / "unseen" / "nvidia-smi-topo"


def _dgx1() -> Cluster:
    node = discover_from_files(
        {"nvidia-smi-topo": DATA / "dlperf-dgx1-v100-hybrid-cube-mesh-fenced-legend.txt"}
    )
    return node if isinstance(node, Cluster) else Cluster(nodes=[node])


def test_paper_policy_on_dgx1_mesh_uses_the_matrix() -> None:
    cluster = _dgx1()
    name = cluster.nodes[0].name
    request = TransferRequest(nbytes=1 << 30)
    pairs = [(a, b) for a in range(8) for b in range(8) if a < b]
    links = {(a, b): cluster.node(name).link(f"GPU{a}", f"GPU{b}") for a, b in pairs}
    nvlinked = {p for p, link in links.items() if link is not None and link.type.startswith("NV")}
    assert 0 < len(nvlinked) < len(pairs)  # a mesh: some pairs NVLinked, some not
    for a, b in pairs:
        view = pair_view_from_cluster(cluster, Endpoint(name, a), Endpoint(name, b))
        choice = PaperPolicy().select(view, request).choice
        assert choice == ("nvlink" if (a, b) in nvlinked else "pcie"), (a, b, choice)
