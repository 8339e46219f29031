"""Links with capacity, shared by concurrent flows with max-min fairness.

Every KV transfer shard is a :class:`Flow` over a path of :class:`SimLink` objects. When a
flow starts, ends or changes its rate cap, the rates of all flows in the same connected
component (flows transitively sharing a link) are recomputed by progressive filling: raise
every unfrozen flow's rate equally until a link saturates or a flow reaches its cap, freeze
those flows, repeat. The result is the max-min fair allocation across all links of each
path. Each link integrates its allocated rate into fixed-width time bins, which gives the
per-link utilization time series.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from topkv.sim.errors import SimError
from topkv.sim.events import EventLoop

_REL_EPS = 1e-9
_DONE_BYTES = 1e-3  # a flow with less than this many bytes left is complete


class SimLink:
    """One direction of a physical link (NVLink port, PCIe lane group, NIC, ...).

    ``capacity`` is in bytes per second.
    """

    __slots__ = (
        "_cnt",
        "_last_t",
        "_rem",
        "allocated",
        "bins",
        "bytes_carried",
        "capacity",
        "flows",
        "index",
        "kind",
        "name",
    )

    def __init__(self, index: int, name: str, kind: str, capacity: float) -> None:
        if not capacity > 0 or math.isinf(capacity):
            raise SimError(f"link {name!r} needs a finite capacity > 0, got {capacity}")
        self.index = index
        self.name = name
        self.kind = kind
        self.capacity = capacity
        self.flows: set[Flow] = set()
        self.allocated = 0.0  # sum of the rates of the flows on this link (bytes/s)
        self.bins: list[float] = []  # bytes carried per utilization bin
        self.bytes_carried = 0.0
        self._last_t = 0.0
        self._rem = 0.0
        self._cnt = 0

    @property
    def load(self) -> float:
        """Allocated share of the capacity now, 0..1."""
        return self.allocated / self.capacity


class Flow:
    """Bytes moving over a path; ``on_done`` runs when the last byte arrives.

    A flow may be a *bundle* of identical parallel shards (the TP shards of one KV
    transfer): ``links`` then concatenates the shards' paths, a link appearing once per
    shard that crosses it, and ``rate``/``remaining`` are per shard. The shards move in
    lockstep at the rate of the most constrained one, which is when the transfer completes.
    """

    __slots__ = ("cap", "last_t", "links", "nbytes", "on_done", "rate", "remaining", "version")

    def __init__(
        self,
        nbytes: float,
        links: tuple[SimLink, ...],
        on_done: Callable[[], None],
        cap: float,
    ) -> None:
        self.nbytes = nbytes
        self.remaining = nbytes
        self.links = links
        self.on_done = on_done
        self.cap = cap
        self.rate = 0.0
        self.last_t = 0.0
        self.version = 0


@dataclass(frozen=True)
class UtilizationSeries:
    """Per-bin utilization (0..1) of one link."""

    link: str
    kind: str
    bin_s: float
    utilization: tuple[float, ...]


class LinkNetwork:
    """All links of a cluster and the flows currently on them."""

    def __init__(self, loop: EventLoop, bin_s: float = 1.0) -> None:
        if not bin_s > 0:
            raise SimError(f"utilization bin width must be > 0, got {bin_s}")
        self.loop = loop
        self.bin_s = bin_s
        self.links: list[SimLink] = []
        self.active_flows = 0
        self.recomputes = 0

    def add_link(self, name: str, kind: str, capacity: float) -> SimLink:
        link = SimLink(len(self.links), name, kind, capacity)
        self.links.append(link)
        return link

    # -- flows ---------------------------------------------------------------------------

    def start_flows(
        self,
        specs: Sequence[tuple[float, tuple[SimLink, ...], Callable[[], None]]],
        cap: float = math.inf,
    ) -> list[Flow]:
        """Start several flows at once (one rate recomputation); returns them.

        Each spec is ``(nbytes, path_links, on_done)``. ``cap`` bounds each flow's rate
        (bytes/s), e.g. the rate at which a pipelined prefill produces the KV cache.
        """
        now = self.loop.now()
        flows: list[Flow] = []
        for nbytes, links, on_done in specs:
            if not links:
                raise SimError("a flow needs at least one link")
            flow = Flow(float(nbytes), links, on_done, cap)
            flow.last_t = now
            flows.append(flow)
            for link in links:
                link.flows.add(flow)
        self.active_flows += len(flows)
        self._recompute(flows)
        return flows

    def set_cap(self, flows: Iterable[Flow], cap: float) -> None:
        """Change the rate cap of still-running flows and recompute their component."""
        live = [f for f in flows if f.remaining > 0]
        for flow in live:
            flow.cap = cap
        if live:
            self._recompute(live)

    # -- internals -----------------------------------------------------------------------

    def _component(self, seeds: Iterable[Flow]) -> tuple[list[Flow], list[SimLink]]:
        """All flows and links connected (through shared links) to ``seeds``."""
        flows: set[Flow] = set()
        links: set[SimLink] = set()
        stack = [f for f in seeds if f.remaining > 0]
        flows.update(stack)
        while stack:
            flow = stack.pop()
            for link in flow.links:
                if link not in links:
                    links.add(link)
                    for other in link.flows:
                        if other not in flows:
                            flows.add(other)
                            stack.append(other)
        return list(flows), list(links)

    def _components(self, seeds: Iterable[Flow]) -> list[tuple[list[Flow], list[SimLink]]]:
        """The connected components that contain ``seeds``, each once."""
        out: list[tuple[list[Flow], list[SimLink]]] = []
        seen: set[Flow] = set()
        for seed in seeds:
            if seed in seen or seed.remaining <= 0:
                continue
            component = self._component([seed])
            seen.update(component[0])
            out.append(component)
        return out

    def _account(self, link: SimLink, now: float) -> None:
        """Integrate the link's allocated rate from its last update to ``now`` into bins."""
        t0 = link._last_t
        if now <= t0:
            return
        rate = link.allocated
        link._last_t = now
        if rate <= 0:
            return
        link.bytes_carried += rate * (now - t0)
        width = self.bin_s
        bins = link.bins
        first = int(t0 / width)
        last = int(now / width)
        if len(bins) <= last:
            bins.extend([0.0] * (last + 1 - len(bins)))
        if first == last:
            bins[first] += rate * (now - t0)
            return
        bins[first] += rate * ((first + 1) * width - t0)
        for i in range(first + 1, last):
            bins[i] += rate * width
        bins[last] += rate * (now - last * width)

    def _recompute(self, seeds: Iterable[Flow]) -> None:
        for flows, links in self._components(seeds):
            self._fill(flows, links)

    def _fill(self, flows: list[Flow], links: list[SimLink]) -> None:
        """Max-min fair rates for one connected component; schedule its first finisher."""
        now = self.loop.now()
        self.recomputes += 1
        for flow in flows:
            elapsed = now - flow.last_t
            if elapsed > 0:
                flow.remaining -= flow.rate * elapsed
                if flow.remaining < 0:
                    flow.remaining = 0.0
            flow.last_t = now
        for link in links:
            self._account(link, now)
            link._rem = link.capacity
            link._cnt = 0
            link.allocated = 0.0
        for flow in flows:  # a link listed k times in a bundle's path counts k times
            for link in flow.links:
                link._cnt += 1
        # progressive filling
        unfrozen = set(flows)
        while unfrozen:
            level = math.inf
            for link in links:
                if link._cnt > 0:
                    share = link._rem / link._cnt
                    if share < level:
                        level = share
            min_cap = min(f.cap for f in unfrozen)
            if min_cap <= level:
                level = min_cap
                limit = level * (1 + _REL_EPS)
                frozen = [f for f in unfrozen if f.cap <= limit]
            else:
                limit = level * (1 + _REL_EPS)
                frozen = []
                for link in links:
                    if link._cnt > 0 and link._rem / link._cnt <= limit:
                        frozen.extend(f for f in link.flows if f in unfrozen)
            if level < 0:
                level = 0.0
            for flow in frozen:
                if flow not in unfrozen:
                    continue
                unfrozen.discard(flow)
                flow.rate = level
                for link in flow.links:
                    link._rem -= level
                    link._cnt -= 1
                    link.allocated += level
        # Only the component's earliest finisher gets an event: any change to the component
        # recomputes it (bumping versions), and that finisher's completion recomputes the rest.
        first: Flow | None = None
        first_t = math.inf
        for flow in flows:
            flow.version += 1
            if flow.rate > 0:
                t = flow.remaining / flow.rate
                if t < first_t:
                    first_t = t
                    first = flow
        if first is not None:
            self.loop.call_at(now + first_t, self._complete, first, first.version)

    def _complete(self, flow: Flow, version: int) -> None:
        if version != flow.version or flow.remaining <= 0:
            return
        now = self.loop.now()
        # Finish this flow and every flow of its component that is done at the same time.
        component, _links = self._component([flow])
        finished: list[Flow] = []
        for other in component:
            left = other.remaining - other.rate * (now - other.last_t)
            if other is flow or left <= max(_DONE_BYTES, other.nbytes * _REL_EPS):
                finished.append(other)
        self._detach(finished, now)
        for done in finished:
            done.on_done()

    def stop_flows(self, flows: Iterable[Flow]) -> None:
        """End still-running flows now without calling their ``on_done`` (a long-lived
        flow whose traffic stopped); the rest of their component is recomputed."""
        live = [f for f in flows if f.remaining > 0]
        if live:
            self._detach(live, self.loop.now())

    def _detach(self, flows: list[Flow], now: float) -> None:
        """Take ``flows`` off their links at ``now`` and recompute what shared them."""
        survivors: set[Flow] = set()
        for done in flows:
            for link in done.links:
                self._account(link, now)
        for done in flows:
            done.remaining = 0.0
            done.version += 1
            for link in done.links:
                link.flows.discard(done)
                link.allocated -= done.rate
                survivors.update(link.flows)
            done.rate = 0.0
        self.active_flows -= len(flows)
        survivors.difference_update(flows)
        if survivors:
            self._recompute(survivors)

    def utilization(self, horizon_s: float) -> list[UtilizationSeries]:
        """Utilization per bin up to ``horizon_s`` of every link that carried bytes.

        Call after the run; links that never carried a byte are left out.
        """
        nbins = max(1, math.ceil(horizon_s / self.bin_s))
        out: list[UtilizationSeries] = []
        for link in self.links:
            self._account(link, max(link._last_t, horizon_s))
            if link.bytes_carried <= 0:
                continue
            values = np.zeros(nbins)
            used = link.bins[:nbins]
            values[: len(used)] = used
            values /= link.capacity * self.bin_s
            out.append(UtilizationSeries(link.name, link.kind, self.bin_s, tuple(values.tolist())))
        return out
