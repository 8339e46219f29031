"""Completion-time estimate of one transfer over one candidate path.

``estimated_s = chunks * setup_latency + (nbytes + queued_bytes) / bandwidth``

which is the planner's Eq. 2 (:func:`topkv.planner.transports.transfer_time_s`) applied to
the bytes this transfer must wait for and the bandwidth the path has now:

* ``bandwidth`` is the measured figure for the path when the
  :class:`~topkv.policy.bandwidth.BandwidthReader` has a fresh one, else the nominal one;
* ``queued_bytes`` is what the busiest link of the path must carry for others before this
  transfer is done. Under fair sharing, a link with ``k`` active flows holding ``B`` bytes
  in flight serves ``sum_i min(r_i, nbytes)`` bytes of theirs while ours completes, which
  is at most ``min(B, k * nbytes)`` and equal to it when the other flows are all larger or
  all smaller than ours. The estimate uses that bound, and the busiest link of the path
  (the one with the most queued bytes) as the bottleneck.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from topkv.planner.transports import GB
from topkv.policy.bandwidth import BandwidthReader, BandwidthSource
from topkv.policy.view import LinkLoad, PathCandidate, TransferRequest


@dataclass(frozen=True)
class CandidateEstimate:
    """One candidate path with its estimated completion time and the terms behind it."""

    transport: str
    estimated_s: float
    bandwidth_gbps: float
    source: BandwidthSource
    links: tuple[str, ...] = ()
    nbytes: int = 0
    chunks: int = 1
    setup_latency_s: float = 0.0
    queued_bytes: int = 0
    bottleneck_link: str | None = None

    @property
    def setup_s(self) -> float:
        """Total setup time: one setup latency per chunk."""
        return self.chunks * self.setup_latency_s

    @property
    def reason(self) -> str:
        """How the estimate was reached, in words (built on demand: selection is hot)."""
        queue = (
            f" + {_format_bytes(self.queued_bytes)} queued on {self.bottleneck_link}"
            if self.bottleneck_link
            else ""
        )
        return (
            f"{self.chunks} x {_format_seconds(self.setup_latency_s)} setup"
            f" + ({_format_bytes(self.nbytes)}{queue})"
            f" / {self.bandwidth_gbps:.4g} GB/s ({self.source})"
        )

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {key: getattr(self, key) for key in ESTIMATE_KEYS}
        out["links"] = list(self.links)
        return out


#: The keys of :meth:`CandidateEstimate.to_dict`, in order, each the attribute it holds.
ESTIMATE_KEYS: Final = (
    "transport",
    "estimated_s",
    "bandwidth_gbps",
    "source",
    "reason",
    "links",
    "setup_s",
    "queued_bytes",
    "bottleneck_link",
)


def _format_bytes(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.3g} {unit}" if unit != "B" else f"{nbytes} B"
        value /= 1000
    return f"{nbytes} B"  # pragma: no cover - loop always returns


def _format_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def _queued(candidate: PathCandidate, load: LinkLoad, nbytes: int) -> tuple[int, str | None]:
    """Bytes queued ahead on the path's busiest link, and that link (see the module doc)."""
    in_flight = load.bytes_in_flight
    if not in_flight:
        return 0, None
    flows = load.active_flows
    bottleneck: str | None = None
    queued = 0
    for link in candidate.links:
        # Bytes of other flows this link serves while ours completes: at most ``nbytes``
        # per flow (inlined: this runs per path per decision).
        on_link = in_flight.get(link, 0)
        count = flows.get(link, 0)
        if count > 0:
            on_link = min(on_link, count * nbytes)
        if on_link > queued:
            bottleneck, queued = link, on_link
    return queued, bottleneck


def estimate_path(
    candidate: PathCandidate,
    request: TransferRequest,
    load: LinkLoad,
    reader: BandwidthReader,
) -> CandidateEstimate:
    """Estimate how long ``request`` takes over ``candidate`` given ``load`` right now."""
    reading = reader.reading(candidate)
    queued, bottleneck = _queued(candidate, load, request.nbytes)
    # Eq. 2 (topkv.planner.transports.transfer_time_s), inlined: this runs per candidate
    # per routing decision, and the tests check the two agree.
    estimated = request.chunks * candidate.setup_latency_s + (request.nbytes + queued) / (
        reading.gbps * GB
    )
    return CandidateEstimate(
        transport=candidate.transport,
        estimated_s=estimated,
        bandwidth_gbps=reading.gbps,
        source=reading.source,
        links=candidate.links,
        nbytes=request.nbytes,
        chunks=request.chunks,
        setup_latency_s=candidate.setup_latency_s,
        queued_bytes=queued,
        bottleneck_link=bottleneck,
    )


def estimate_seconds(
    candidate: PathCandidate,
    request: TransferRequest,
    load: LinkLoad,
    reader: BandwidthReader,
) -> float:
    """``estimate_path(...).estimated_s`` (the same arithmetic), without building the
    estimate: what routing compares across many workers."""
    queued, _ = _queued(candidate, load, request.nbytes)
    return request.chunks * candidate.setup_latency_s + (request.nbytes + queued) / (
        reader.reading(candidate).gbps * GB
    )
