"""The orchestrator's routing: the decode worker and the ranked transports for one
transfer, with the caches that keep it cheap (:class:`DecodeRouter`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from topkv.policy.errors import PolicyError
from topkv.policy.route import RouteDecision, RouteScore, RoutingPolicy
from topkv.policy.select import TransportSelector
from topkv.policy.view import Endpoint, LinkLoad, LinkLoadTracker, PairView, TransferRequest
from topkv.relay.context import RelayContext, RelayPart
from topkv.relay.moe.experts import ExpertRegistry
from topkv.relay.moe.routing import MoEChooser
from topkv.relay.pairs import CachingSelector
from topkv.relay.runs import Exhausted, TransferRun
from topkv.relay.transfers import FailureKind, TransferRecord, TransferState
from topkv.relay.workers import WorkerInfo

WorkerPairView = Callable[[WorkerInfo, WorkerInfo], PairView]


class DecodeRouter(RelayPart):
    """Picks the decode worker for a transfer (``RoutingPolicy`` over ``selector``'s
    costs) and reserves one of its slots."""

    def __init__(
        self,
        context: RelayContext,
        *,
        selector: TransportSelector,
        routing: RoutingPolicy,
        pair_view: WorkerPairView,
        load: LinkLoadTracker,
    ) -> None:
        super().__init__(context)
        self.selector = selector
        self.routing = routing
        self._pair_view = pair_view
        # Live per-link load, kept as counters; the immutable snapshot the policies read
        # is built only when routing needs it and something changed since the last one.
        self.load = load
        # Routing costs per (source, request), reused while the source's registration, the
        # registry version and the load snapshot stay the same. Only when the selection
        # policy is declared pure (CachingSelector) and the routing rule is the stock one.
        self._reuse_scores = isinstance(selector, CachingSelector) and (
            type(routing) is RoutingPolicy
        )
        self._scores: dict[
            tuple[str, TransferRequest], tuple[WorkerInfo, LinkLoad, int, tuple[RouteScore, ...]]
        ] = {}
        self._requests: dict[tuple[int, int, str | None], TransferRequest] = {}
        self._pairs: dict[
            str,
            tuple[WorkerInfo, int, list[tuple[str, Endpoint]], dict[Endpoint, PairView]],
        ] = {}
        # An MoE model's decode routing (relay.moe.routing), once decode workers report experts.
        self.moe = MoEChooser(
            ExpertRegistry.of(self.view, self.clock),
            self.clock,
            self.config.moe_router,
            self.metrics.registry,
        )

    def registry_changed(self) -> None:
        """Forget the routing costs (a registration changed)."""
        self._scores.clear()

    async def route(
        self,
        record: TransferRecord,
        run: TransferRun,
        source: WorkerInfo,
        request: TransferRequest,
        excluded: set[str],
    ) -> RouteDecision:
        """Pick the decode worker and reserve one of its slots; waits (bounded) for one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.route_wait_s
        while True:
            decision = self._choose(source, request, excluded)
            if decision is not None:
                self.slots.reserve(run, decision.worker_id)
                if record.state == TransferState.QUEUED:
                    self.transfers.move(record, TransferState.PLANNED)
                return decision
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise Exhausted(
                    FailureKind.NO_DESTINATION,
                    f"no healthy decode worker with a free slot within "
                    f"{self.config.route_wait_s} s (excluded: {sorted(excluded) or 'none'})",
                )
            event = self.slots.capacity_changed
            assert event is not None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), remaining)

    def _choose(
        self, source: WorkerInfo, request: TransferRequest, excluded: set[str]
    ) -> RouteDecision | None:
        try:
            if self.moe.experts.is_moe:
                return self._choose_moe(source, request, excluded)
            if self._reuse_scores:
                scores = self._route_scores(source, request)
                return self.routing.choose_scored(
                    scores,
                    self.slots.views,
                    self.selector,
                    request,
                    self.load.snapshot(),
                    excluded,
                )
            by_endpoint = self._decoders_by_endpoint()

            def lookup(_src: Endpoint, dst: Endpoint) -> PairView:
                return self._pair_view(source, by_endpoint[dst])

            return self.routing.choose_decode(
                self.slots.endpoint(source),
                list(self.slots.views.values()),
                lookup,
                request,
                self.selector,
                self.load.snapshot(),
                excluded,
            )
        except PolicyError as exc:
            raise Exhausted(FailureKind.NO_DESTINATION, f"routing refused: {exc}") from exc

    def _choose_moe(
        self, source: WorkerInfo, request: TransferRequest, excluded: set[str]
    ) -> RouteDecision | None:
        by_endpoint = self._decoders_by_endpoint()

        def lookup(src: Endpoint, dst: Endpoint) -> PairView:
            # The KV's pair (source -> a decode worker), or a dispatch hop between two
            # workers (a decode target -> an expert host).
            src_info = source if src == self.slots.endpoint(source) else by_endpoint[src]
            return self._pair_view(src_info, by_endpoint[dst])

        def domain_of(worker_id: str) -> str | None:
            info = self.view.get(worker_id)
            return info.nvlink_domain if info is not None else None

        return self.moe.choose(
            self.slots.endpoint(source),
            self.slots.views,
            domain_of,
            lookup,
            request,
            self.selector,
            self.routing,
            self.load.snapshot(),
            excluded,
        )

    def _decoders_by_endpoint(self) -> dict[Endpoint, WorkerInfo]:
        return {self.slots.endpoint(info): info for info in self.view.workers("decode")}

    def _route_scores(self, source: WorkerInfo, request: TransferRequest) -> tuple[RouteScore, ...]:
        """Every decode worker's transfer cost from ``source`` (cached, see __init__)."""
        load = self.load.snapshot()
        version = self.view.version
        key = (source.worker_id, request)
        found = self._scores.get(key)
        if found is not None and found[0] is source and found[1] is load and found[2] == version:
            return found[3]
        targets, pairs = self._pairs_from(source, version)
        scores = self.routing.score(
            self.slots.endpoint(source),
            targets,
            lambda _src, dst: pairs[dst],
            request,
            self.selector,
            load,
        )
        if len(self._scores) >= 1024:
            self._scores.clear()
        self._scores[key] = (source, load, version, scores)
        return scores

    def _pairs_from(
        self, source: WorkerInfo, version: int
    ) -> tuple[list[tuple[str, Endpoint]], dict[Endpoint, PairView]]:
        """The decode workers and the pair view to each from ``source`` (cached until the
        registry changes: pair views depend on the registrations alone)."""
        found = self._pairs.get(source.worker_id)
        if found is not None and found[0] is source and found[1] == version:
            return found[2], found[3]
        by_endpoint = self._decoders_by_endpoint()
        targets = [(info.worker_id, endpoint) for endpoint, info in by_endpoint.items()]
        pairs = {endpoint: self._pair_view(source, info) for endpoint, info in by_endpoint.items()}
        if len(self._pairs) >= 1024:
            self._pairs.clear()
        self._pairs[source.worker_id] = (source, version, targets, pairs)
        return targets, pairs

    def request_for(self, record: TransferRecord) -> TransferRequest:
        """The policies' view of ``record`` (one shared object per distinct request)."""
        key = (
            record.size_bytes,
            record.layout.num_layers * self.config.chunks_per_layer,
            record.manual_override,
        )
        request = self._requests.get(key)
        if request is None:
            if len(self._requests) >= 1024:
                self._requests.clear()
            request = self._requests[key] = TransferRequest(*key)
        return request
