"""The orchestrator's decode routing for an MoE model: :class:`topkv.policy.moe.router.MoERouter`
over the expert registry, then the plain routing rule for the transfer to the chosen worker.

The model is MoE when a decode worker reports experts (:attr:`ExpertRegistry.is_moe`);
:class:`~topkv.relay.routing.DecodeRouter` then asks :meth:`MoEChooser.choose` instead of
its dense rule. The request's decode length is ``moe_decode_tokens`` (default 128: the
order of the Azure 2023 conversation trace's median output, 129 tokens over the packaged
sample); its dispatch per token comes from the reports (experts per token x MoE layers
activations of the hidden state out and back, BF16).

Metrics (on the orchestrator's registry): ``moe_routed_total{strategy}``, per request;
``expert_load_factor{worker,layer,expert}`` and ``expert_straggler{worker,layer,expert}``
(1 while the replica is flagged), refreshed at each MoE decision.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge

from topkv.policy.clock import Clock
from topkv.policy.moe.experts import ExpertSnapshot
from topkv.policy.moe.router import MoERequest, MoERouter, MoETarget, dispatch_bytes_per_activation
from topkv.policy.route import DecodeWorkerView, PairViewLookup, RouteDecision, RoutingPolicy
from topkv.policy.select import TransportSelector
from topkv.policy.view import Endpoint, LinkLoad, TransferRequest
from topkv.relay.moe.experts import ExpertRegistry

#: Decode length assumed for a request (see the module docstring).
MOE_DECODE_TOKENS = 128


class MoEMetrics:
    """The MoE router's Prometheus series (module docstring)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.routed = Counter(
            "topkv_moe_routed_total",
            "Requests routed by the MoE router",
            ["strategy"],
            registry=registry,
        )
        self.load_factor = Gauge(
            "topkv_expert_load_factor",
            "Expert replica load factor",
            ["worker", "layer", "expert"],
            registry=registry,
        )
        self.straggler = Gauge(
            "topkv_expert_straggler",
            "1 while the replica is a straggler",
            ["worker", "layer", "expert"],
            registry=registry,
        )

    def observe(self, snapshot: ExpertSnapshot) -> None:
        for r in snapshot.replicas:
            labels = (r.worker_id, str(r.layer), str(r.expert))
            self.load_factor.labels(*labels).set(snapshot.load_factor(r))
            self.straggler.labels(*labels).set(1.0 if snapshot.is_straggler(r) else 0.0)


class MoEChooser:
    """One orchestrator's MoE decode routing (module docstring)."""

    def __init__(
        self,
        experts: ExpertRegistry,
        clock: Clock,
        strategy: str,
        metrics_registry: CollectorRegistry,
        decode_tokens: int = MOE_DECODE_TOKENS,
    ) -> None:
        self.experts = experts
        self.router = MoERouter(clock, strategy, experts.weights)
        self.decode_tokens = decode_tokens
        self.metrics = MoEMetrics(metrics_registry)

    def choose(
        self,
        source: Endpoint,
        workers: Mapping[str, DecodeWorkerView],
        domain_of: Callable[[str], str | None],
        pair_view: PairViewLookup,
        request: TransferRequest,
        selector: TransportSelector,
        routing: RoutingPolicy,
        load: LinkLoad,
        excluded: Collection[str],
    ) -> RouteDecision | None:
        """The decode worker for ``request`` and the transfer selection to it."""
        snapshot = self.experts.snapshot()
        self.metrics.observe(snapshot)
        shape = self.experts.model_shape()
        per_token, layers, hidden = shape if shape is not None else (1, 1, 1)
        targets = [
            MoETarget(
                w.worker_id,
                w.endpoint,
                domain_of(w.worker_id),
                w.free_slots,
                w.load,
                healthy=w.healthy,
            )
            for w in workers.values()
        ]
        moe_request = MoERequest(
            request,
            decode_tokens=self.decode_tokens,
            activations_per_token=per_token * layers,
            dispatch_bytes=dispatch_bytes_per_activation(hidden),
        )
        decision = self.router.decide(
            snapshot, source, targets, pair_view, moe_request, selector, load, excluded
        )
        if decision is None:
            return None
        chosen = workers[decision.worker_id]
        route = routing.choose_decode(source, [chosen], pair_view, request, selector, load)
        if route is None:
            return None
        self.metrics.routed.labels(self.router.strategy).inc()
        return dataclasses.replace(
            route,
            alternatives=decision.alternatives,
            rationale=f"moe {self.router.strategy}: {decision.rationale}",
        )
