"""Prometheus metrics of the relay, one :class:`CollectorRegistry` per orchestrator.

:class:`RelayMetrics` holds the transfer metrics (``topkv_transfers_total``, bytes, in flight
and queued, retries, failures, and the transfer, handoff and throughput histograms);
:class:`AdpMetrics` adds the Adaptive Decoder Pool's on the same registry when it runs;
:func:`serve_metrics` serves them (:class:`MetricsServer`). Every name and what it counts:
docs/orchestrator.md ("Metrics").
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
#: Conversions: the paper's target is 10 s, a cold start about 5 minutes.
_CONVERSION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_GBPS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 512.0)


class RelayMetrics:
    """The relay's counters, gauges and histograms in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.transfers = Counter(
            "topkv_transfers", "Finished transfers", ["mode", "outcome"], registry=r
        )
        self.bytes = Counter(
            "topkv_transfer_bytes", "Bytes delivered (verified)", ["mode"], registry=r
        )
        self.in_flight = Gauge(
            "topkv_transfers_in_flight", "Transfers holding a concurrency slot", registry=r
        )
        self.queued = Gauge(
            "topkv_transfers_queued", "Transfers waiting for a concurrency slot", registry=r
        )
        self.retries = Counter("topkv_transfer_retries", "Retries on the same path", registry=r)
        self.checksum_failures = Counter(
            "topkv_checksum_failures", "Attempts that delivered corrupted bytes", registry=r
        )
        self.failovers = Counter(
            "topkv_transfer_failovers", "Failovers to the next transport", registry=r
        )
        self.reroutes = Counter(
            "topkv_transfer_reroutes", "Reroutes to another decode worker", registry=r
        )
        self.attempt_failures = Counter(
            "topkv_transfer_attempt_failures", "Failed attempts by reason", ["kind"], registry=r
        )
        self.transfer_seconds = Histogram(
            "topkv_transfer_seconds",
            "Successful attempt: start to verified copy at the destination",
            ["mode"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.handoff_seconds = Histogram(
            "topkv_handoff_seconds",
            "End to end: submit to the verified KV handed to decode",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._outcomes: dict[tuple[str, str], Counter] = {}
        self._modes: dict[str, tuple[Counter, Histogram, Histogram]] = {}
        self.throughput = Histogram(
            "topkv_transfer_throughput_gbps",
            "Per delivered transfer: decimal GB/s over the successful attempt",
            ["mode"],
            buckets=_GBPS_BUCKETS,
            registry=r,
        )

    def track(self, in_flight: Callable[[], float], queued: Callable[[], float]) -> None:
        """Read the two gauges from the orchestrator at scrape time (no per-transfer cost)."""
        self.in_flight.set_function(in_flight)
        self.queued.set_function(queued)

    def outcome(self, mode: str, outcome: str) -> Counter:
        """The ``transfers_total`` child for ``mode`` and ``outcome`` (children are cached)."""
        key = (mode, outcome)
        child = self._outcomes.get(key)
        if child is None:
            child = self._outcomes[key] = self.transfers.labels(mode, outcome)
        return child

    def for_mode(self, mode: str) -> tuple[Counter, Histogram, Histogram]:
        """Cached children for ``mode``: bytes, transfer seconds, throughput."""
        found = self._modes.get(mode)
        if found is None:
            found = self._modes[mode] = (
                self.bytes.labels(mode),
                self.transfer_seconds.labels(mode),
                self.throughput.labels(mode),
            )
        return found

    def exposition(self) -> bytes:
        """The text exposition format (what ``/metrics`` returns)."""
        return generate_latest(self.registry)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Current value of one sample (0.0 when it was never set): for tests and reports."""
        found = self.registry.get_sample_value(name, labels or {})
        return float(found) if found is not None else 0.0


class AdpMetrics:
    """The Adaptive Decoder Pool's gauges, counters and histogram (module docstring)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.rush = Gauge("topkv_adp_rush", "1 while the ADP sees a rush, else 0", registry=r)
        self.pool = Gauge(
            "topkv_adp_pool_workers", "Workers serving each pool now", ["pool"], registry=r
        )
        self.converted = Gauge(
            "topkv_adp_converted_workers", "Native decode workers serving prefill", registry=r
        )
        self.conversions = Counter(
            "topkv_conversions", "Finished ADP conversions", ["from", "to"], registry=r
        )
        self.failures = Counter(
            "topkv_conversion_failures",
            "ADP conversions that did not finish (refused, worker died, not re-registered)",
            ["from", "to"],
            registry=r,
        )
        self.seconds = Histogram(
            "topkv_conversion_seconds",
            "ADP conversion: decided to re-registered in the other pool",
            ["to"],
            buckets=_CONVERSION_BUCKETS,
            registry=r,
        )
        for pool in ("prefill", "decode"):
            self.pool.labels(pool).set(0)


class MetricsServer:
    """``/metrics`` over HTTP on its own thread (prometheus_client's server)."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = str(self._server.server_address[0])
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(metrics: RelayMetrics, host: str = "127.0.0.1", port: int = 0) -> MetricsServer:
    """Serve ``metrics`` at ``http://host:port/metrics`` (port 0 picks a free one)."""
    server, thread = start_http_server(port, addr=host, registry=metrics.registry)
    return MetricsServer(server, thread)
