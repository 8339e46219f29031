"""Which prefill and which decode instance serve a request: TopKV's registry and policies.

Prefill: the registered prefill instance with the fewest requests in flight here (then by
id). Decode: :class:`~topkv.policy.route.RoutingPolicy` over every registered decode
instance (cheapest transfer by :class:`~topkv.policy.select.CostPolicy` on the pair's paths
from :func:`~topkv.relay.pairs.pair_view_for_workers`, then least loaded, then id); free
slots are the registration's capacity less the requests in flight. The chosen path class
becomes a medium: shm when both share a host and the class rides on host memory, tcp else.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass

from topkv.integrations.vllm.params import shm_socket_path
from topkv.policy.route import DecodeWorkerView, RouteScore, RoutingPolicy
from topkv.policy.select import CostPolicy
from topkv.policy.view import TransferRequest
from topkv.relay.pairs import endpoint_of, pair_view_for_workers
from topkv.relay.registry_base import WorkerRegistry
from topkv.relay.workers import WorkerInfo
from topkv.transport.media import real_medium


@dataclass(frozen=True)
class Route:
    prefill: WorkerInfo
    decode: WorkerInfo
    medium: str  # shm | tcp
    destination: str  # where the prefill instance sends the KV
    path_class: str
    rationale: str


class NoInstance(Exception):
    """No registered instance of a role can take the request (the front door answers 503)."""


class Picker:
    def __init__(self, registry: WorkerRegistry, shm_dir: str) -> None:
        self.registry = registry
        self.shm_dir = shm_dir
        self.in_flight: Counter[str] = Counter()
        self._routing = RoutingPolicy()
        self._selector = CostPolicy()

    def pick(self, kv_bytes: int, exclude: Collection[str] = ()) -> Route:
        prefills = [w for w in self.registry.workers("prefill") if w.worker_id not in exclude]
        if not prefills:
            raise NoInstance("no prefill instance is registered")
        prefill = min(prefills, key=lambda w: (self.in_flight[w.worker_id], w.worker_id))
        decodes = {
            w.worker_id: w
            for w in self.registry.workers("decode")
            if w.worker_id not in exclude and w.address
        }
        if not decodes:
            raise NoInstance("no decode instance is registered")
        request = TransferRequest(nbytes=max(kv_bytes, 1))
        source = endpoint_of(prefill)
        scores: list[RouteScore] = []
        for worker in decodes.values():  # one lookup per worker: endpoints may coincide
            scores += RoutingPolicy.score(
                source,
                [(worker.worker_id, endpoint_of(worker))],
                lambda _s, _d, w=worker: pair_view_for_workers(prefill, w),  # type: ignore[misc]
                request,
                self._selector,
            )
        scores.sort(key=lambda s: (s.cost, s.worker_id))
        views = {
            wid: DecodeWorkerView(
                wid,
                endpoint_of(w),
                free_slots=max(w.capacity - self.in_flight[wid], 0),
                load=float(self.in_flight[wid]),
            )
            for wid, w in decodes.items()
        }
        decision = self._routing.choose_scored(scores, views, self._selector, request)
        if decision is None:
            raise NoInstance("every decode instance is full (capacity reached)")
        decode = decodes[decision.worker_id]
        path = decision.selection.choice
        same_host = bool(prefill.host_id) and prefill.host_id == decode.host_id
        medium = real_medium(path) if same_host else "tcp"
        destination = (
            "shm://" + shm_socket_path(self.shm_dir, decode.worker_id)
            if medium == "shm"
            else decode.address
        )
        return Route(prefill, decode, medium, destination, path, decision.rationale)
