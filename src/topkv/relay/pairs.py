"""From registered workers to the policies' pair views (what paths join two workers).

A worker's registration says its node, GPUs, NVLink domain and media (RDMA, TCP, shared
memory); :func:`pair_view_for_workers` turns two registrations into the
:class:`~topkv.policy.view.PairView` the selection and routing policies read. A discovered
topology gives finer figures; pass such a lookup to the orchestrator instead.
"""

from __future__ import annotations

from topkv.policy.pairs import pair_view_from_facts
from topkv.policy.view import Endpoint, PairView
from topkv.relay.workers import WorkerInfo


def endpoint_of(info: WorkerInfo) -> Endpoint:
    """The worker's first GPU (GPU 0 when it registered none)."""
    return Endpoint(node=info.node, gpu=info.gpus[0] if info.gpus else 0)


def pair_view_for_workers(src: WorkerInfo, dst: WorkerInfo) -> PairView:
    """Candidate paths between two registered workers, with the reference figures.

    Same NVLink domain adds an NVLink (or NVSwitch) path; same node adds PCIe (served by
    shared memory when the workers share a host); both RDMA-capable adds RDMA; both
    TCP-capable adds TCP.
    """
    same_domain = (
        src.nvlink_domain is not None
        and src.nvlink_domain == dst.nvlink_domain
        and src.capabilities.nvlink
        and dst.capabilities.nvlink
    )
    nvswitch = src.capabilities.nvswitch and dst.capabilities.nvswitch
    return pair_view_from_facts(
        endpoint_of(src),
        endpoint_of(dst),
        same_nvlink_domain=same_domain,
        rdma_available=src.capabilities.rdma and dst.capabilities.rdma,
        tcp_available=src.capabilities.tcp and dst.capabilities.tcp,
        nvlink_transport="nvswitch" if nvswitch else "nvlink",
    )


class PairViewCache:
    """Memoised :func:`pair_view_for_workers`, keyed by both registrations (immutable)."""

    def __init__(self, limit: int = 4096) -> None:
        self._limit = limit
        self._views: dict[tuple[WorkerInfo, WorkerInfo], PairView] = {}

    def __call__(self, src: WorkerInfo, dst: WorkerInfo) -> PairView:
        key = (src, dst)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= self._limit:
                self._views.clear()
            view = pair_view_for_workers(src, dst)
            self._views[key] = view
        return view
