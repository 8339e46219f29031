"""What prefix affinity buys: TTFT of repeated-prefix requests through the front door, with
the picker's affinity on and off, over the same vLLM instances in one run.

``benchmarks/vllm_pd.py --affinity`` runs it. The stack is :mod:`.stack`'s: a ``topkv
orchestrator``, two prefill and one decode vLLM instance (TopKVConnector, prefix caching
on, as vLLM's default), and two front doors reading the same orchestrator, one with
affinity and one without. Each front door gets its own prompt groups (so neither warms
the other's): ``groups`` shared prefixes of ``prefix_tokens`` tokens, each request one of
them plus a fresh ``suffix_tokens``-token tail. Every round sends one request of each group
at once, the groups in a rotating order, to each front door in turn. Without affinity the
least loaded prefill instance takes whichever request arrives first, so a group's prefix
lands on another instance from round to round; with it, each group returns to the
instance that holds its prefix. TTFT is the client's time for a one-token answer (the
prefill, the KV transfer and the decode's first token); ``prefill_ms_mean`` is the front
door's prefill call alone (``topkv_router_prefill_seconds``), where a warm prefix cache
shows most directly. The first round (every cache cold) is left out of the figures.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from topkv.integrations.vllm.stack.demo_run import _RouterThread, _write_model
from topkv.integrations.vllm.stack.instances import (
    StackFiles,
    start_orchestrator,
    start_pd_instances,
    wait_up,
)
from topkv.integrations.vllm.stack.model import VOCAB_SIZE
from topkv.service.cluster.local import Supervisor


@dataclass(frozen=True)
class AffinityBenchOptions:
    rounds: int = 8
    groups: int = 2
    prefix_tokens: int = 768
    suffix_tokens: int = 32
    seed: int = 0


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(VOCAB_SIZE - 2) for _ in range(count)]


async def _one(
    session: aiohttp.ClientSession, url: str, token: str, prompt: list[int]
) -> tuple[float, str, str]:
    """(TTFT ms, the X-TopKV-Prefix-Blocks header, the prefill instance)."""
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    started = time.perf_counter()
    async with session.post(
        url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {token}"}
    ) as answer:
        await answer.read()
        if answer.status != 200:
            raise RuntimeError(f"HTTP {answer.status} from {url}")
        blocks = answer.headers.get("X-TopKV-Prefix-Blocks", "0,0")
        prefill = answer.headers.get("X-TopKV-Prefill", "")
    return (time.perf_counter() - started) * 1000, blocks, prefill


def _prefill_totals(door: _RouterThread) -> tuple[float, float]:
    """(sum of seconds, count) of the door's prefill calls so far."""
    totals = {"sum": 0.0, "count": 0.0}
    for metric in door.server.router.metrics.prefill.collect():
        for sample in metric.samples:
            for key in totals:
                if sample.name.endswith("_" + key):
                    totals[key] = sample.value
    return totals["sum"], totals["count"]


def _figures(ttfts: list[float], rounds: list[list[str]]) -> dict[str, Any]:
    ordered = sorted(ttfts)
    # a request whose group was on the same prefill instance in the round before: its
    # prefix was in that instance's cache
    same = sum(
        a == b for before, now in itertools.pairwise(rounds)
        for a, b in zip(before, now, strict=True)
    )  # fmt: skip
    return {
        "ttft_p50_ms": round(statistics.median(ordered), 2),
        "ttft_p90_ms": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 2),
        "ttft_mean_ms": round(statistics.fmean(ordered), 2),
        "requests": len(ordered),
        "prefix_on_the_same_prefill": same,
        "prefill_by_round": rounds,
    }


async def _rounds(
    doors: dict[str, _RouterThread],
    token: str,
    prompts: dict[str, list[list[int]]],
    opts: AffinityBenchOptions,
    rng: random.Random,
) -> dict[str, Any]:
    ttft: dict[str, list[float]] = {name: [] for name in doors}
    after_cold: dict[str, tuple[float, float]] = {}
    placements: dict[str, list[list[str]]] = {name: [] for name in doors}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for round_no in range(opts.rounds):
            for name, door in doors.items():
                url = door.url
                order = [(g + round_no) % opts.groups for g in range(opts.groups)]
                batch = [prompts[name][g] + _tokens(rng, opts.suffix_tokens) for g in order]
                tasks = []
                for prompt in batch:
                    tasks.append(asyncio.create_task(_one(session, url, token, prompt)))
                    await asyncio.sleep(0.005)  # arrival order = the rotating group order
                done = await asyncio.gather(*tasks)
                by_group = dict(zip(order, done, strict=True))
                placements[name].append([by_group[g][2] for g in range(opts.groups)])
                if round_no == 0:
                    after_cold[name] = _prefill_totals(door)
                    continue  # cold caches everywhere
                ttft[name] += [ms for ms, _, _ in done]
    out: dict[str, Any] = {name: _figures(ttft[name], placements[name]) for name in doors}
    for name, door in doors.items():
        total, count = _prefill_totals(door)
        spent, calls = total - after_cold[name][0], count - after_cold[name][1]
        out[name]["prefill_ms_mean"] = round(spent / calls * 1000, 2) if calls else None
    for key in ("ttft_p50_ms", "ttft_mean_ms", "prefill_ms_mean"):
        on, off = out["affinity"][key], out["no_affinity"][key]
        out[key.removesuffix("_ms").replace("_ms_", "_") + "_ratio"] = (
            round(on / off, 3) if on is not None and off else None
        )
    return out


def run_affinity_bench(python: str, root: Path, opts: AffinityBenchOptions) -> dict[str, Any]:
    """Start the stack under ``root`` (vLLM from ``python``), run the rounds, return the
    figures (``affinity`` and ``no_affinity``: TTFT p50/p90/mean, affinity hits, which
    prefill instance served each group per round; ``ttft_p50_ratio`` on / off)."""
    rng = random.Random(opts.seed)
    prompts = {
        door: [_tokens(rng, opts.prefix_tokens) for _ in range(opts.groups)]
        for door in ("affinity", "no_affinity")
    }
    model = _write_model(python, root / "model", opts.seed)
    files = StackFiles.create(root)
    doors: list[_RouterThread] = []
    started = time.perf_counter()
    try:
        with Supervisor(root / "logs", grace_s=20) as supervisor:
            _, registry = start_orchestrator(supervisor, files)
            doors.append(_RouterThread(files, registry))
            doors.append(_RouterThread(files, registry, affinity=False))
            instances = start_pd_instances(
                supervisor, model, files, registry, prefill=2, decode=1, python=python,
                max_model_len=1024, load_timeout_s=20,
            )  # fmt: skip
            wait_up(instances, doors[0].server.registry, timeout_s=600)
            by_name = {"affinity": doors[0], "no_affinity": doors[1]}
            figures = asyncio.run(_rounds(by_name, files.client_token, prompts, opts, rng))
    finally:
        for door in doors:
            door.close()
    figures["options"] = opts.__dict__
    figures["stack_s"] = round(time.perf_counter() - started, 1)
    return figures
