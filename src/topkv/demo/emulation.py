"""The demo's time dilation, derived from the deployment it stands for.

The demo's tiny model makes its KV far more slowly on a CPU than a real model on a GPU, so its
emulated links are slowed (*dilated*) until the ratio of link time to compute time on the
cross-node path is the stand-in deployment's: ``d = (r_s / tp / B_s) / (r_d / B_d)``
(:func:`derived_factor`, :func:`resolve_dilation`, from :class:`StandIn` and
:class:`DemoLinks`; the result is a :class:`Dilation`). The derivation and what it cannot
carry: docs/demo.md ("The time dilation").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from topkv.demo.errors import DemoError


@dataclass(frozen=True)
class StandIn:
    """The deployment the demo represents, as the simulator describes it.

    ``kv_bytes_per_prefill_s``: one prefill instance (``tp`` GPUs) over the run's prompt
    lengths. ``cross_node_bytes_per_s``: what one TP shard's cross-node path carries (its
    NIC's share when shards of an instance share a NIC). ``same_node_bytes_per_s``: one
    shard's same-node path (``same_node_mode``), None where no prefill instance shares a
    node with a decode instance.
    """

    model: str
    cluster: str
    tp: int
    kv_bytes_per_prefill_s: float
    cross_node_bytes_per_s: float
    same_node_mode: str | None = None
    same_node_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise DemoError(f"stand-in {self.model}: tensor parallelism must be >= 1")
        for name in ("kv_bytes_per_prefill_s", "cross_node_bytes_per_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise DemoError(f"stand-in {self.model}@{self.cluster}: {name} must be > 0")

    @property
    def shard_rate(self) -> float:
        """KV bytes one GPU of the prefill instance produces per second of prefill."""
        return self.kv_bytes_per_prefill_s / self.tp

    def as_json(self) -> dict[str, Any]:
        """``summary.emulation.stand_in`` (issue #19's keys)."""
        return {
            "model": self.model,
            "cluster": self.cluster,
            "kv_bytes_per_prefill_s": round(self.kv_bytes_per_prefill_s),
        }


@dataclass(frozen=True)
class DemoLinks:
    """The demo topology's paths for one prefill worker (bytes per second, undilated)."""

    same_node_mode: str
    same_node_bytes_per_s: float
    cross_node_mode: str
    cross_node_bytes_per_s: float


@dataclass(frozen=True)
class Dilation:
    """The factor the run's links are slowed by, and where it came from."""

    factor: float
    derived: bool
    demo_kv_bytes_per_prefill_s: float
    stand_in: StandIn | None
    links: DemoLinks
    #: What the derivation gives (also when ``--dilation`` overrode it); None: no stand-in.
    derived_factor: float | None = None
    clamped: bool = False

    def link_to_compute(self) -> dict[str, dict[str, float | str | None]]:
        """Link time over compute time per path, for the stand-in and for this run."""
        links, rate = self.links, self.demo_kv_bytes_per_prefill_s
        out: dict[str, dict[str, float | str | None]] = {}
        for path, mode, bandwidth in (
            ("same_node", links.same_node_mode, links.same_node_bytes_per_s),
            ("cross_node", links.cross_node_mode, links.cross_node_bytes_per_s),
        ):
            entry: dict[str, float | str | None] = {
                "demo_mode": mode,
                "demo": _round(rate * self.factor / bandwidth),
                "stand_in_mode": None,
                "stand_in": None,
            }
            stand_in = self.stand_in
            if stand_in is not None:
                own = _stand_in_path(stand_in, path)
                if own is not None:
                    entry["stand_in_mode"] = own[0]
                    entry["stand_in"] = _round(stand_in.shard_rate / own[1])
            out[path] = entry
        return out

    def note(self) -> str:
        """What the factor means (``summary.emulation.dilation_note``)."""
        d = f"{self.factor:g}x"
        stand_in = self.stand_in
        if stand_in is None:
            return f"dilation {d} given; no stand-in deployment: it represents none"
        who = f"{stand_in.model} on {stand_in.cluster} (TP {stand_in.tp})"
        if not self.derived:
            return (
                f"--dilation {d} overrides the {self.derived_factor:.3g}x derived for {who}: "
                "the link-to-compute ratio is no longer any deployment's, so the comparison "
                "no longer represents any deployment"
            )
        text = (
            f"dilation {d} derived for {who}: its cross-node link time over prefill time "
            f"equals this run's ({self.demo_kv_bytes_per_prefill_s / 1e6:.1f} MB of KV per "
            f"second of prefill here, {stand_in.shard_rate / 1e9:.2f} GB/s per GPU there)"
        )
        if self.clamped:
            text += (
                f"; the stand-in needs {self.derived_factor:.3g}x, below 1x, which the "
                "emulation cannot run (links would be faster than the hardware): 1x, "
                "link time exaggerated"
            )
        if stand_in.same_node_bytes_per_s is None:
            text += (
                f"; the stand-in never places a prefill and a decode instance on one node "
                f"(TP {stand_in.tp}): the demo's same-node {self.links.same_node_mode} path "
                "has no counterpart there, only its cross-node path is represented"
            )
        else:
            same = self.link_to_compute()["same_node"]
            demo_ratio, own_ratio = same["demo"], same["stand_in"]
            assert isinstance(demo_ratio, float) and isinstance(own_ratio, float)
            if not math.isclose(demo_ratio, own_ratio, rel_tol=0.25):
                text += (
                    f"; its same-node path ({stand_in.same_node_mode}, "
                    f"{stand_in.same_node_bytes_per_s / 1e9:g} GB/s per GPU) is not the "
                    f"demo's emulated {self.links.same_node_mode} "
                    f"({self.links.same_node_bytes_per_s / 1e9:g} GB/s) at this dilation: its "
                    f"link-to-compute ratio is {demo_ratio / own_ratio:.2g}x the stand-in's "
                    "here, the topology-aware side does not represent it"
                )
        return text


def _stand_in_path(stand_in: StandIn, path: str) -> tuple[str, float] | None:
    if path == "cross_node":
        return "rdma", stand_in.cross_node_bytes_per_s
    if stand_in.same_node_bytes_per_s is None or stand_in.same_node_mode is None:
        return None
    return stand_in.same_node_mode, stand_in.same_node_bytes_per_s


def _round(value: float) -> float:
    return float(f"{value:.4g}")


def derived_factor(stand_in: StandIn, demo_rate: float, links: DemoLinks) -> float:
    """``d`` such that ``demo_rate * d / B_demo`` equals the stand-in's ``(r / tp) / B``
    on the cross-node path (module docstring)."""
    if not (math.isfinite(demo_rate) and demo_rate > 0):
        raise DemoError(f"the demo's KV production rate must be > 0 B/s, got {demo_rate}")
    stand_in_ratio = stand_in.shard_rate / stand_in.cross_node_bytes_per_s
    return stand_in_ratio * links.cross_node_bytes_per_s / demo_rate


def resolve_dilation(
    given: float | None, stand_in: StandIn | None, demo_rate: float, links: DemoLinks
) -> Dilation:
    """The run's dilation: ``given`` (``--dilation``) when set, else derived from
    ``stand_in`` (clamped to 1x, the fastest the emulation runs links)."""
    derived = derived_factor(stand_in, demo_rate, links) if stand_in is not None else None
    if given is not None:
        return Dilation(given, False, demo_rate, stand_in, links, derived)
    if derived is None:
        raise DemoError("no --dilation and no stand-in deployment to derive it from")
    factor = max(1.0, float(f"{derived:.3g}"))
    return Dilation(factor, True, demo_rate, stand_in, links, derived, clamped=derived < 1)
