"""An MoE engine's expert statistics as the report a worker's heartbeat carries.

:class:`~topkv.service.compute.engines.HfEngine` on a Mixtral-style model records what its experts
do (:class:`topkv.engine.moe.ExpertRecorder`); :func:`expert_report` turns that into the
:class:`~topkv.relay.workers.ExpertReport` the worker puts in its record at each
heartbeat. ``queue_depth`` is the engine calls waiting for the engine's thread (a serial
engine runs one prefill or decode at a time, so they queue for all its experts alike);
:func:`renew` is the worker's heartbeat.
"""

from __future__ import annotations

from topkv.relay.workers import ExpertReport, ExpertStat, WorkerInfo
from topkv.service.compute.engines import WorkerEngine
from topkv.service.worker.registrar import Registrar


def expert_report(engine: WorkerEngine, queued: int = 0) -> ExpertReport | None:
    """The engine's report now (one more ``sequence`` per call); None for a dense engine."""
    recorder = getattr(engine, "experts", None)
    if recorder is None:
        return None
    sequence, figures = recorder.stats()
    return ExpertReport(
        sequence=sequence,
        experts_per_token=recorder.top_k,
        moe_layers=recorder.layers,
        hidden_size=recorder.hidden_size,
        stats=tuple(
            ExpertStat(
                layer=f.layer,
                expert=f.expert,
                rate=f.rate,
                compute_s=f.compute_s,
                queue_depth=queued,
            )
            for f in figures
        ),
    )


async def renew(
    registrar: Registrar, info: WorkerInfo, engine: WorkerEngine | None, ttl_s: float
) -> WorkerInfo:
    """One heartbeat: the lease renewed; for an MoE engine the record replaced (same lease)
    with its expert statistics now. Returns the record as registered."""
    report = expert_report(engine) if engine is not None else None
    if report is None:
        await registrar.heartbeat()
        return info
    renewed = info.model_copy(update={"experts": report})
    await registrar.update(renewed, ttl_s)
    return renewed
