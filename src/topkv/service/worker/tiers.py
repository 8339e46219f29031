"""The worker's side of its KV tiers: the calls its handlers make, and ``GET /metrics``.

A worker started with ``--device-kv-capacity K`` (:attr:`WorkerConfig.tiers`) keeps at
most K KV caches on its device tier (:mod:`topkv.service.tiers.tiered`); without it every call
here does nothing and ``/metrics`` shows no tier. The tier model (latency and bandwidth per
tier and direction, EMA-updated from every measured move), the tiers' use and the moves
between them are exported in Prometheus text format.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from topkv.service.kvstore import CapacityExceeded, HeldKV, KVStore
from topkv.service.messages import DecodeResult
from topkv.service.tiers.config import TierConfig
from topkv.service.tiers.device import DEVICE
from topkv.service.tiers.tiered import DecodeTicket, TieredKV, TierTrail, open_tiered_kv


class _TierCollector(Collector):
    def __init__(self, tiers: TieredKV) -> None:
        self.tiers = tiers

    def collect(self) -> Iterator[Metric]:
        t = self.tiers
        bw = GaugeMetricFamily(
            "topkv_kv_tier_bandwidth_gbps",
            "KV tier bandwidth (EMA of measured moves; nominal until measured)",
            labels=["tier", "direction", "source"],
        )
        lat = GaugeMetricFamily(
            "topkv_kv_tier_latency_seconds",
            "KV tier per-operation latency (EMA of measured small moves)",
            labels=["tier", "direction"],
        )
        for r in t.model.snapshot():
            bw.add_metric([r.tier, r.direction, r.source], r.bandwidth_gbps)
            lat.add_metric([r.tier, r.direction], r.latency_s)
        yield bw
        yield lat
        used = GaugeMetricFamily("topkv_kv_tier_used_bytes", "bytes held per tier", labels=["tier"])
        cap = GaugeMetricFamily(
            "topkv_kv_tier_capacity_bytes", "configured bytes per tier", labels=["tier", "emulated"]
        )
        for name, store in t.stores.items():
            used.add_metric([name], store.used_bytes)
            cap.add_metric([name, str(store.spec.emulated).lower()], store.spec.capacity_bytes)
        device = t.device_tier
        if device.spec.capacity_bytes:  # a device tier bounded in bytes (a torch arena)
            used.add_metric([DEVICE], device.used_bytes)
            cap.add_metric([DEVICE, str(device.stand_in).lower()], device.spec.capacity_bytes)
        yield used
        yield cap
        dev = GaugeMetricFamily("topkv_kv_tier_device_caches", "KV caches on the device tier")
        dev.add_metric([], len(t.on_device()))
        yield dev
        info = GaugeMetricFamily(
            "topkv_kv_tier_device_info",
            "what holds the device tier: a GPU (kind gpu, its name) or a stand-in",
            labels=["kind", "device", "stand_in"],
        )
        named = device.describe().get("device")
        info.add_metric([device.kind, str(named or "none"), str(device.stand_in).lower()], 1)
        yield info
        yield _counter(
            "topkv_kv_tier_moved_bytes", "bytes moved between tiers", ["src", "dst"],
            t.bytes_moved.items(),
        )  # fmt: skip
        yield _counter(
            "topkv_kv_tier_events", "demotions, promotions, prefetches, failovers, refusals",
            ["event"], (((name,), n) for name, n in t.counters.items()),
        )  # fmt: skip
        yield _counter(
            "topkv_kv_tier_failures", "failed tier writes and reads", ["tier", "kind"],
            t.failures.items(),
        )  # fmt: skip


def _counter(
    name: str, doc: str, labels: list[str], values: Iterable[tuple[tuple[str, ...], int]]
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=labels)
    for key, n in values:
        family.add_metric(list(key), n)
    return family


class WorkerTiers:
    """The worker's tiers, or nothing (``config`` None)."""

    def __init__(self, config: TierConfig | None) -> None:
        self.tiers: TieredKV | None = None if config is None else open_tiered_kv(config)
        self.registry = CollectorRegistry()
        if self.tiers is not None:
            self.registry.register(_TierCollector(self.tiers))

    async def admitted(self, kv: HeldKV, store: KVStore) -> None:
        """A verified copy is in ``store``: make room on the device. When no tier can take
        the least needed cache, the copy leaves the store and CapacityExceeded is raised."""
        if self.tiers is None:
            return
        try:
            await asyncio.to_thread(self.tiers.admit, kv)
        except CapacityExceeded:
            store.pop(kv.request_id)
            await asyncio.to_thread(kv.free)
            raise

    def begin_decode(self, kv: HeldKV, tokens: int) -> DecodeTicket | None:
        return None if self.tiers is None else self.tiers.begin_decode(kv, tokens)

    def end_decode(self, ticket: DecodeTicket | None, stamps: list[float], tokens: int) -> None:
        """The decode ended (``stamps``: its start and end, if it ran)."""
        if self.tiers is not None and ticket is not None:
            seconds = stamps[1] - stamps[0] if len(stamps) == 2 else 0.0
            self.tiers.end_decode(ticket, seconds, tokens)

    async def released(self, request_id: int) -> TierTrail | None:
        if self.tiers is None:
            return None
        return await asyncio.to_thread(self.tiers.forget, request_id)

    def annotate(self, result: DecodeResult, ticket: DecodeTicket | None) -> DecodeResult:
        """The decode answer with its tier fields: tiers visited, promotion and exposed ms."""
        if ticket is None:
            return result
        trail = ticket.trail
        return result.model_copy(
            update={
                "tiers": list(trail.tiers),
                "promotion_ms": trail.promotion_s * 1e3,
                "exposed_promotion_ms": trail.exposed_promotion_s * 1e3,
                "tier_failures": list(trail.failures),
            }
        )

    def describe(self) -> dict[str, object] | None:
        """What ``GET /v1/info`` says about the tiers."""
        t = self.tiers
        if t is None:
            return None
        return {
            "device_capacity": t.capacity,
            "device_tier": t.device_tier.describe(),
            "tiers": [
                {
                    "name": spec.name,
                    "kind": spec.kind,
                    "capacity_bytes": spec.capacity_bytes,
                    "emulated": spec.emulated,
                    "backing": spec.backing,
                }
                for spec in [t.device, *(s.spec for s in t.stores.values())]
            ],
        }

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.close()
