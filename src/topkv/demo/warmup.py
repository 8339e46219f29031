"""The demo's warm-up: how fast its prefill workers produce KV on this host.

Before the timed phase every prefill worker runs ``rounds`` forward passes of a prompt of
the run's median length, all workers at once (as they run in the timed phase); the first
round is discarded (torch's first pass pays its one-time set-up), the rest give the KV
production rate, bytes of KV per second of forward pass (median over the passes). The KV is
dropped at once. The rate sets the time dilation (:mod:`topkv.demo.emulation`).
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from topkv.demo.errors import DemoError
from topkv.demo.records import PrefillDone
from topkv.relay.workers import WorkerInfo
from topkv.service.messages import PrefillRequest
from topkv.service.orchestrator.executor import RemoteExecutor

#: Request ids of the warm-up passes start here (above the requests and baseline copies).
WARMUP_IDS_FROM = 1 << 41
#: Prompt seeds of the warm-up, apart from the requests' (``seed * 1_000_003 + index``).
_SEED_OFFSET = 999_983


@dataclass(frozen=True)
class WarmUp:
    """What the warm-up measured: KV bytes per second of prefill on this host."""

    kv_bytes_per_prefill_s: float
    prompt_len: int
    passes: int


async def measure_kv_rate(
    executor: RemoteExecutor,
    sources: Sequence[WorkerInfo],
    *,
    model_id: str,
    prompt_len: int,
    seed: int,
    rounds: int = 2,
) -> WarmUp:
    """Run ``rounds`` concurrent prefills on every worker of ``sources``; the rate of all
    rounds but the first (module docstring)."""
    if rounds < 2 or not sources:
        raise DemoError("the warm-up needs at least two rounds on at least one prefill worker")
    rates: list[float] = []
    for round_no in range(rounds):
        passes = await asyncio.gather(
            *(
                _one_pass(executor, worker, WARMUP_IDS_FROM + round_no * len(sources) + k,
                          model_id, prompt_len, seed * 1_000_003 + _SEED_OFFSET + k)
                for k, worker in enumerate(sources)
            )
        )  # fmt: skip
        if round_no:
            rates.extend(passes)
    return WarmUp(statistics.median(rates), prompt_len, len(rates))


async def _one_pass(
    executor: RemoteExecutor,
    worker: WorkerInfo,
    request_id: int,
    model_id: str,
    prompt_len: int,
    prompt_seed: int,
) -> float:
    body = PrefillRequest(
        model_id=model_id, prompt_seed=prompt_seed, prompt_tokens=prompt_len, wait=True
    )
    summary = await executor.prefill(worker, request_id, body)
    try:
        done = PrefillDone.of(worker.worker_id, summary)
    except ValueError as exc:
        raise DemoError(f"warm-up: {exc}") from None
    finally:  # DELETE /v1/kv/{id}: the worker drops the KV whichever role holds it
        await executor.discard_destination(worker, request_id)
    seconds = done.forward_end_s - done.forward_start_s
    if not seconds > 0:
        raise DemoError(f"warm-up: {worker.worker_id} reported a forward pass of {seconds} s")
    return summary.size_bytes / seconds
