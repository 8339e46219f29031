"""How the demo's workers compute: ``--compute real`` (default) or ``--compute paced``.

With ``real`` compute the workers share this host's cores, so the host cannot add prefill
capacity when the ADP converts a decode worker. ``paced`` runs every worker with a compute
pace ``C`` (:mod:`topkv.service.compute.pace`), derived as the host's oversubscription:
model workers x torch threads over the usable cores, at least 1 (:func:`host_cores`,
:class:`ComputeEmulation`). :class:`PacedTurns` counts the timed phase's turns and overruns;
:func:`compute_json` and :func:`compute_text` report them. Why: docs/demo.md ("Paced compute").
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from topkv.demo.errors import DemoError
from topkv.demo.executor import DemoExecutor
from topkv.relay.workers import WorkerInfo
from topkv.service.compute.pace import PaceStats

#: Torch intra-op threads of every demo worker (paced compute needs exactly one).
DEMO_TORCH_THREADS = 1
PACED_LABEL = "emulated: each worker paced as its own device"
REAL_LABEL = "real: every worker computes on this host's shared cores"
COUNTED = "engine turns of the timed phase (the warm-up and the reference runs left out)"

ComputeMode = Literal["real", "paced"]


def host_cores() -> int:
    """The cores this process (and the workers it starts) may run on."""
    return len(os.sched_getaffinity(0))


@dataclass(frozen=True)
class ComputeEmulation:
    """``--compute``: real, or paced at ``pace`` = workers x threads / cores (at least 1)."""

    mode: ComputeMode = "real"
    workers: int = 0
    threads: int = DEMO_TORCH_THREADS
    cores: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("real", "paced"):
            raise DemoError(f"--compute {self.mode!r}: use real or paced")
        if self.mode == "paced" and min(self.workers, self.threads, self.cores) < 1:
            raise DemoError(
                f"paced compute needs workers, threads and cores >= 1, got {self.workers}, "
                f"{self.threads}, {self.cores}"
            )

    @classmethod
    def choose(
        cls,
        mode: str,
        workers: int,
        threads: int = DEMO_TORCH_THREADS,
        cores: int | None = None,
    ) -> ComputeEmulation:
        """``--compute MODE`` for ``workers`` model workers of ``threads`` torch threads each
        on ``cores`` cores (default: this host's, :func:`host_cores`)."""
        if mode == "real":
            return cls()
        if mode != "paced":
            raise DemoError(f"--compute {mode!r}: use real or paced")
        return cls("paced", workers, threads, host_cores() if cores is None else cores)

    @property
    def pace(self) -> float | None:
        """Each turn lasts this many times its CPU time; None with real compute."""
        if self.mode != "paced":
            return None
        return max(1.0, self.workers * self.threads / self.cores)

    def derivation(self) -> str:
        return f"{self.workers} workers x {self.threads} threads / {self.cores} cores"


class PacedTurns:
    """The workers' paced turns over the timed phase (``GET /v1/info`` before and after)."""

    def __init__(
        self, executor: DemoExecutor, workers: Sequence[WorkerInfo], compute: ComputeEmulation
    ) -> None:
        self.executor = executor
        self.workers = list(workers)
        self.paced = compute.pace is not None
        self._before: dict[str, PaceStats] = {}

    async def _snapshot(self) -> dict[str, PaceStats]:
        out: dict[str, PaceStats] = {}
        for worker in self.workers:
            info = await self.executor.worker_info(worker)
            engine = info.get("engine") if isinstance(info, dict) else None
            stats = engine.get("compute_pace") if isinstance(engine, dict) else None
            try:
                out[worker.worker_id] = PaceStats.of(stats)
            except ValueError as exc:
                raise DemoError(f"{worker.worker_id} reported no paced turns: {exc}") from None
        return out

    async def start(self) -> None:
        if self.paced:
            self._before = await self._snapshot()

    async def since(self) -> dict[str, PaceStats]:
        """Each worker's paced turns since :meth:`start` (none with real compute)."""
        if not self.paced:
            return {}
        after = await self._snapshot()
        return {w: s.minus(self._before.get(w, PaceStats())) for w, s in after.items()}


def compute_json(compute: ComputeEmulation, turns: Mapping[str, PaceStats]) -> dict[str, Any]:
    """``summary.emulation.compute``: the mode; paced: the pace, its derivation, the turns."""
    pace = compute.pace
    if pace is None:
        return {"mode": "real", "label": REAL_LABEL}
    total = PaceStats()
    for stats in turns.values():
        total = total.plus(stats)
    return {
        "mode": "paced",
        "pace": round(pace, 4),
        "derivation": compute.derivation(),
        "workers": compute.workers,
        "threads_per_worker": compute.threads,
        "cores": compute.cores,
        "turns": total.turns,
        "overruns": total.overruns,
        "overrun_s": round(total.overrun_s, 3),
        "held_s": round(total.held_s, 3),
        "busy_s": round(total.busy_s, 3),
        # the share of the emulated devices' busy time the host could not hold to the pace
        "overrun_share": round(total.overrun_s / total.busy_s, 4) if total.busy_s > 0 else None,
        "per_worker": {w: s.as_json() for w, s in sorted(turns.items())},
        "counted": COUNTED,
        "label": PACED_LABEL,
    }


def compute_text(compute: dict[str, Any]) -> list[str]:
    """The text summary's line for paced compute (none for real compute)."""
    if compute.get("mode") != "paced":
        return []
    return [
        f"compute {compute['label']}: pace {compute['pace']:g}x ({compute['derivation']}); "
        f"{compute['turns']} turns, {compute['overruns']} overrun(s) "
        f"({compute['overrun_s']:.2f} s past the pace in {compute['busy_s']:.1f} s of turns)"
    ]
