"""Each GPU's nearest NICs, written in the configuration format of the tool that takes it.

* ``ucx``: ``UCX_NET_DEVICES=<dev>:<port>[,...]`` per local rank (UCX docs, "UCX_NET_DEVICES"),
  emitted as a shell ``case "$LOCAL_RANK"`` block.
* ``nccl``: ``NCCL_IB_HCA`` is one process-wide list (NCCL picks the nearest HCA per GPU
  itself); we emit the union of every GPU's nearest HCAs with the leading ``=`` that makes
  NCCL match names exactly (NCCL env docs, "NCCL_IB_HCA").
* ``mooncake``: Mooncake Transfer Engine's NIC priority matrix JSON,
  ``{"cuda:<i>": [[preferred...], [other reachable...]], "cpu:<numa>": [...]}``.
* ``sglang``: the JSON GPU-id -> comma-separated devices map that SGLang's
  ``--disaggregation-ib-device`` accepts when given a ``.json`` file.
"""

from __future__ import annotations

from typing import Literal

from topkv.jsonout import dumps
from topkv.topology.model import NIC, Node, TopologyError
from topkv.topology.paths import nearest_nics

NicMapFormat = Literal["ucx", "nccl", "mooncake", "sglang"]
FORMATS: tuple[str, ...] = ("ucx", "nccl", "mooncake", "sglang")


def _hca(nic: NIC) -> str:
    return f"{nic.name}:{nic.port or 1}"


def gpu_nic_map(node: Node) -> dict[int, list[NIC]]:
    """GPU index -> nearest NICs (ties kept, in NIC order)."""
    if not node.nics:
        raise TopologyError(
            f"node {node.name!r} has no NICs: nothing to map (give ibstat/ibv_devinfo/"
            "rdma link output or a topo matrix with NIC columns)"
        )
    if not node.gpus:
        raise TopologyError(f"node {node.name!r} has no GPUs: nothing to map")
    return {g.index: nearest_nics(node, g.index) for g in node.gpus}


def render(node: Node, fmt: str) -> str:
    """The NIC map of ``node`` in format ``fmt`` (one of :data:`FORMATS`)."""
    mapping = gpu_nic_map(node)
    if fmt == "ucx":
        lines = ['case "${LOCAL_RANK:-0}" in']
        for idx, nics in mapping.items():
            lines.append(f"  {idx}) export UCX_NET_DEVICES={','.join(_hca(n) for n in nics)} ;;")
        lines.append("esac")
        return "\n".join(lines)
    if fmt == "nccl":
        seen: list[str] = []
        for nics in mapping.values():
            for n in nics:
                if _hca(n) not in seen:
                    seen.append(_hca(n))
        return f"export NCCL_IB_HCA=={','.join(seen)}"
    if fmt == "mooncake":
        matrix: dict[str, list[list[str]]] = {}
        for idx, nics in mapping.items():
            preferred = [n.name for n in nics]
            others = [n.name for n in node.nics if n.name not in preferred]
            matrix[f"cuda:{idx}"] = [preferred, others]
        for numa in sorted({n.id for n in node.numa_nodes if not n.cpuless}):
            local = [n.name for n in node.nics if n.numa == numa]
            others = [n.name for n in node.nics if n.name not in local]
            matrix[f"cpu:{numa}"] = [local or others, others if local else []]
        return dumps(matrix, indent=2)
    if fmt == "sglang":
        return dumps({str(i): ",".join(n.name for n in nics) for i, nics in mapping.items()})
    raise TopologyError(f"unknown NIC map format {fmt!r}; choose one of {', '.join(FORMATS)}")
