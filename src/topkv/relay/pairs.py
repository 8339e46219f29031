"""From registered workers to the policies' pair views (what paths join two workers).

A worker's registration says its node, GPUs, NVLink domain and media (RDMA, TCP, shared
memory); :func:`pair_view_for_workers` turns two registrations into the
:class:`~topkv.policy.view.PairView` the selection and routing policies read. A discovered
topology gives finer figures; pass such a lookup to the orchestrator instead.
"""

from __future__ import annotations

from topkv.policy.pairs import pair_view_from_facts
from topkv.policy.select import Selection, TransportSelector, cost_function
from topkv.policy.view import NO_LOAD, Endpoint, LinkLoad, PairView, TransferRequest
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
        self._views: dict[tuple[str, str], tuple[WorkerInfo, WorkerInfo, PairView]] = {}

    def __call__(self, src: WorkerInfo, dst: WorkerInfo) -> PairView:
        key = (src.worker_id, dst.worker_id)
        found = self._views.get(key)
        # Same registration objects -> same view (an update replaces the object).
        if found is not None and found[0] is src and found[1] is dst:
            return found[2]
        if len(self._views) >= self._limit:
            self._views.clear()
        view = pair_view_for_workers(src, dst)
        self._views[key] = (src, dst, view)
        return view


class CachingSelector:
    """Memoises a *stateless* selection policy (nominal bandwidth, no measurements).

    A pure policy's selection depends only on the pair, the request and the load on the
    pair's links, so the cache key is the pair (by identity: :class:`PairViewCache` hands
    out one object per pair of registrations), the request, and the bytes and flows on
    every link the pair's paths cross. Do not wrap a policy whose bandwidth reader learns
    from measurements: its answer changes without its inputs changing.
    """

    def __init__(self, inner: TransportSelector, limit: int = 65_536) -> None:
        self.inner = inner
        self._inner_cost = cost_function(inner)
        self._limit = limit
        self._links: dict[int, tuple[PairView, tuple[str, ...]]] = {}
        self._cache: dict[tuple[object, ...], tuple[PairView, Selection]] = {}

    @property
    def name(self) -> str:
        return self.inner.name

    def select(
        self, pair: PairView, request: TransferRequest, load: LinkLoad = NO_LOAD
    ) -> Selection:
        if load.bytes_in_flight or load.active_flows:
            known = self._links.get(id(pair))
            if known is None or known[0] is not pair:
                links = tuple(dict.fromkeys(link for c in pair.candidates for link in c.links))
                known = (pair, links)
                self._links[id(pair)] = known
            signature: tuple[object, ...] = tuple(
                (load.bytes_on(link), load.flows_on(link)) for link in known[1]
            )
        else:
            signature = ()
        key = (id(pair), request, signature)
        found = self._cache.get(key)
        if found is not None and found[0] is pair:
            return found[1]
        selection = self.inner.select(pair, request, load)
        if len(self._cache) >= self._limit:
            self._cache.clear()
            self._links.clear()
        self._cache[key] = (pair, selection)
        return selection

    def cost(self, pair: PairView, request: TransferRequest, load: LinkLoad = NO_LOAD) -> float:
        """The chosen path's estimate (the inner policy's, computed afresh: it is cheaper
        than building this cache's key)."""
        return self._inner_cost(pair, request, load)
