"""The emulated two-node cluster the demo's workers are placed on.

Both nodes are copies of one real ``nvidia-smi topo -m`` capture of an 8x H100 NV18 server
(shipped in ``topkv/data``, see its README). Workers sit on GPUs of it; the selection
policy sees the discovered paths (NVLink inside a node, RDMA through the nearest NICs
across nodes) exactly as it would on the real machines. All worker processes actually run
on this host, so every path is *emulated*: the bytes move over shared memory (same-node
paths) or TCP (cross-node paths), paced to the chosen path's bandwidth and setup latency,
time-dilated (see :mod:`topkv.transport.emulated`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from topkv.demo.emulation import DemoLinks
from topkv.demo.errors import DemoError
from topkv.packaged import packaged_file
from topkv.policy import Endpoint, PairView, Selection
from topkv.policy.adapters import pair_view_from_cluster
from topkv.relay.workers import Role, WorkerCapabilities, WorkerInfo
from topkv.topology.build import discover_from_files
from topkv.topology.detect.errors import ParseError
from topkv.topology.model import Cluster
from topkv.topology.paths import nearest_nics
from topkv.transport.media import real_medium

DEFAULT_FIXTURE = "sglang-30401-h100-8gpu-nv18-8nic.txt"
GPU_NAME = "NVIDIA H100 80GB HBM3"


@dataclass(frozen=True)
class Placement:
    """One demo worker: its id, role and the GPU of the emulated cluster it sits on."""

    worker_id: str
    role: Role
    node: str
    gpu: int

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.node, self.gpu)


#: prefill0 node-0:GPU0, prefill1 node-1:GPU0, decode0 node-0:GPU1, decode1 node-1:GPU1.
DEFAULT_PLACEMENTS = (
    Placement("prefill0", "prefill", "node-0", 0),
    Placement("prefill1", "prefill", "node-1", 0),
    Placement("decode0", "decode", "node-0", 1),
    Placement("decode1", "decode", "node-1", 1),
)


def find_fixture(name: str = DEFAULT_FIXTURE) -> Path:
    """The ``topo -m`` capture: a file shipped in ``topkv/data``, else a path to one."""
    packaged = packaged_file(name)
    if packaged is not None:
        return packaged
    path = Path(name)
    if not path.is_file():
        raise DemoError(
            f"{name}: no such topology capture (neither a file nor one shipped in topkv/data)"
        )
    return path


def two_node_cluster(fixture: Path) -> Cluster:
    """Two identical nodes ``node-0`` and ``node-1`` built from one ``topo -m`` capture."""
    try:
        node = discover_from_files({"nvidia-smi-topo": fixture}, name="node", gpu_name=GPU_NAME)
    except ParseError as exc:
        raise DemoError(f"cannot build the demo topology from {fixture}: {exc}") from None
    return Cluster.replicate(node, 2)


def worker_info(
    placement: Placement, cluster: Cluster, address: str = "", capacity: int = 1
) -> WorkerInfo:
    """The registry record of a demo worker on its emulated GPU (``capacity``: decode
    slots, which the relay's routing counts)."""
    gpu = cluster.gpu(placement.node, placement.gpu)
    nics = nearest_nics(cluster.node(placement.node), placement.gpu)
    return WorkerInfo(
        worker_id=placement.worker_id,
        role=placement.role,
        node=placement.node,
        host_id="local",
        gpus=(placement.gpu,),
        nvlink_domain=gpu.nvlink_domain,
        capabilities=WorkerCapabilities(
            nvlink=gpu.nvlink_domain is not None, rdma=bool(nics), tcp=True, shm=True
        ),
        address=address,
        capacity=capacity,
    )


@dataclass(frozen=True)
class LinkChoice:
    """A transfer's path: its class, modelled bandwidth and setup, and the medium under it."""

    mode: str
    bandwidth_gbps: float
    setup_s: float
    medium: str

    @classmethod
    def from_selection(cls, selection: Selection) -> LinkChoice:
        chosen = selection.chosen
        return cls(
            chosen.transport,
            chosen.bandwidth_gbps,
            chosen.setup_latency_s,
            real_medium(chosen.transport),  # every path is emulated on this one host
        )


def pair_view(cluster: Cluster, src: Endpoint, dst: Endpoint) -> PairView:
    return pair_view_from_cluster(cluster, src, dst)


#: ``link_for(source, destination, transport, nbytes, chunks)``: a transport's path.
LinkFor = Callable[[str, str, str, int, int], LinkChoice]


def demo_links(
    placements: Sequence[Placement], link_for: LinkFor, bytes_per_token: int, layers: int
) -> DemoLinks:
    """The same-node (NVLink) and cross-node (RDMA) paths of the first prefill worker."""
    source = next(p for p in placements if p.role == "prefill")
    decode = [p for p in placements if p.role == "decode"]
    near = next(p for p in decode if p.node == source.node)
    far = next(p for p in decode if p.node != source.node)
    nbytes = bytes_per_token * layers
    same = link_for(source.worker_id, near.worker_id, "nvlink", nbytes, layers)
    cross = link_for(source.worker_id, far.worker_id, "rdma", nbytes, layers)
    return DemoLinks(same.mode, same.bandwidth_gbps * 1e9, cross.mode, cross.bandwidth_gbps * 1e9)
