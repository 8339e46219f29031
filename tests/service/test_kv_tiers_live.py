"""KV tiers live: a decode worker with device capacity K serves more than K sequences.

Real in-process workers (the class ``topkv worker`` runs) host the seeded demo model: the
prefill worker streams each request's KV to the decode worker over shm, which holds six at
once with room for two on its device tier; the rest are demoted to host DRAM, an emulated
CXL tier and a disk directory, and promoted back (or prefetched) for decode. Every token
equals the single-process reference; a tier file deleted under a demoted KV fails that
request's decode with a clear answer instead of wrong tokens; /metrics exposes the tier
model measured by these moves.
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from topkv.relay.executor import AttemptFailed, AttemptPlan
from topkv.relay.registry.memory import MemoryRegistry
from topkv.service.compute.engines import EngineSpec
from topkv.service.http.auth import Credentials, ServerAuth, new_token
from topkv.service.messages import PrefillRequest
from topkv.service.orchestrator.executor import RemoteExecutor
from topkv.service.tiers.config import TierConfig
from topkv.service.tiers.tiered import open_tiered_kv
from topkv.service.worker import tiers as worker_tiers
from topkv.service.worker.registrar import DirectRegistrar
from topkv.service.worker.service import WorkerConfig, WorkerService

pytest.importorskip("torch")
pytest.importorskip("transformers")

from topkv.engine import (
    DemoModelConfig,
    build_demo_model,
    prompt_token_ids,
    reference_generate,
)

pytestmark = pytest.mark.model

SMALL = DemoModelConfig(layers=6, hidden_size=64, heads=4, kv_heads=2, head_dim=16,
                        intermediate_size=128, vocab_size=512, init_std=0.25)  # fmt: skip
SEED = 5
NEW_TOKENS = 8
ADMIN = new_token()
K = 2
PROMPTS = [(40 + 3 * i, 100 + i) for i in range(6)]  # (length, seed): ~60-90 KB of KV each


def _config(role: str, tiers: TierConfig | None) -> WorkerConfig:
    return WorkerConfig(
        role="prefill" if role == "prefill" else "decode",
        node="n0",
        secret=b"tiers-live-secret-0123456789",
        worker_id=f"{role}0",
        host_id="h0",
        capacity=8,
        engine=EngineSpec(kind="hf", demo_seed=SEED, demo_config=SMALL),
        media=("shm", "tcp"),
        auth=ServerAuth(Credentials.of(admin=[ADMIN])),
        tiers=tiers,
    )


async def _serve(tmp: Path, lose: int | None) -> tuple[list[Any], dict[str, Any], str]:
    tiers = TierConfig(
        device_capacity=K,
        host_bytes=128 << 10,
        cxl_bytes=128 << 10,
        cxl="emulated",
        cxl_dilation=100.0,
        disk_bytes=4 << 20,
        disk_dir=tmp,
    )
    registry = MemoryRegistry()
    prefill = WorkerService(_config("prefill", None), DirectRegistrar(registry))
    decode = WorkerService(_config("decode", tiers), DirectRegistrar(registry))
    await prefill.start()
    await decode.start()
    executor = RemoteExecutor(token=ADMIN)
    assert prefill.info is not None and decode.info is not None and prefill.engine is not None
    try:
        firsts = {}
        for rid, (length, seed) in enumerate(PROMPTS, start=1):
            body = PrefillRequest(prompt_tokens=length, prompt_seed=seed)
            held = await executor.prefill(prefill.info, rid, body)
            firsts[rid] = held.first_token
            plan = AttemptPlan(
                rid, held.model_id, held.layout.to_layout(), prefill.info, decode.info,
                "nvlink", 1, 30.0,
            )  # fmt: skip
            await executor.transfer(plan)
            await executor.release_source(prefill.info, rid)
        assert len(decode.store) == len(PROMPTS) > K  # all held at once
        tiers_now = decode.tiers.tiers
        assert tiers_now is not None
        on_device = tiers_now.on_device()
        where = {rid: tiers_now.tier_of(rid) for rid in firsts}
        assert len(on_device) == K, where
        if lose is not None:
            victim = next(r for r, t in where.items() if t == "disk")
            (tmp / f"kv-{victim}.topkv").unlink()

        async def one(rid: int) -> Any:
            try:
                return await executor.decode(decode.info, rid, firsts[rid], NEW_TOKENS)  # type: ignore[arg-type]
            except AttemptFailed as exc:
                return exc

        results = await asyncio.gather(*(one(rid) for rid in firsts))
        for rid in firsts:
            await executor.discard_destination(decode.info, rid)
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{decode.info.control_url}/metrics") as answer,
        ):
            metrics = await answer.text()
        return results, where, metrics
    finally:
        await executor.close()
        await prefill.stop()
        await decode.stop()


def _expected() -> dict[int, list[int]]:
    loaded = build_demo_model(SMALL, SEED)
    return {
        rid: reference_generate(loaded, prompt_token_ids(n, s, SMALL.vocab_size), NEW_TOKENS)
        for rid, (n, s) in enumerate(PROMPTS, start=1)
    }


def test_more_than_k_sequences_decode_token_identical(tmp_path: Path) -> None:
    results, where, metrics = asyncio.run(_serve(tmp_path, lose=None))
    expected = _expected()
    visited: set[str] = set()
    for result in results:
        assert result.tokens == expected[result.request_id]
        assert result.tiers[0] == "device" and result.tiers[-1] == "device"
        assert result.promotion_ms >= 0 and result.exposed_promotion_ms >= 0
        visited.update(result.tiers)
        if len(result.tiers) > 1:
            assert result.promotion_ms > 0  # it came back from a lower tier
    assert {"host", "cxl", "disk"} <= visited, where
    assert sum(len(r.tiers) > 1 for r in results) >= len(PROMPTS) - K
    assert 'topkv_kv_tier_bandwidth_gbps{direction="read",source="measured",tier="disk"}' in metrics
    assert 'topkv_kv_tier_events_total{event="promotions"}' in metrics
    assert 'topkv_kv_tier_capacity_bytes{emulated="true",tier="cxl"}' in metrics
    import torch

    kind = "gpu" if torch.cuda.is_available() else "host-stand-in"
    stand_in = str(kind != "gpu").lower()
    assert f'kind="{kind}",stand_in="{stand_in}"}} 1.0' in metrics, metrics


def test_the_gpu_tier_code_on_a_cpu_tensor_decodes_token_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's device tier is the torch arena (forced onto a CPU tensor): every cache
    on the device is held in it, copied back (CRC-64 checked) for each decode."""
    monkeypatch.setattr(
        worker_tiers, "open_tiered_kv", functools.partial(open_tiered_kv, torch_device="cpu")
    )
    results, _, metrics = asyncio.run(_serve(tmp_path, lose=None))
    expected = _expected()
    for result in results:
        assert result.tokens == expected[result.request_id]
        assert result.tiers[-1] == "device" and result.exposed_promotion_ms > 0  # the copy back
    assert 'topkv_kv_tier_device_info{device="cpu",kind="torch-cpu",stand_in="true"} 1.0' in metrics
    assert 'topkv_kv_tier_bandwidth_gbps{direction="read",source="measured",tier="device"}' in (
        metrics
    )
    assert 'topkv_kv_tier_used_bytes{tier="device"} 0.0' in metrics  # all released


def test_a_deleted_tier_file_fails_that_decode_not_the_tokens(tmp_path: Path) -> None:
    results, _where, _ = asyncio.run(_serve(tmp_path, lose=1))
    expected = _expected()
    lost = [r for r in results if isinstance(r, AttemptFailed)]
    assert len(lost) == 1 and "deleted" in str(lost[0]) and "recompute" in str(lost[0])
    for result in results:
        if not isinstance(result, AttemptFailed):
            assert result.tokens == expected[result.request_id]


async def _full_disk(tmp: Path) -> tuple[Any, Any, str, dict[str, Any]]:
    """K=1, no memory tier with room, a disk that answers ENOSPC for request 2."""
    tiers = TierConfig(
        device_capacity=1, host_bytes=4096, cxl="off", disk_bytes=4 << 20, disk_dir=tmp
    )
    (tmp / "kv-2.topkv").symlink_to("/dev/full")
    registry = MemoryRegistry()
    prefill = WorkerService(_config("prefill", None), DirectRegistrar(registry))
    decode = WorkerService(_config("decode", tiers), DirectRegistrar(registry))
    await prefill.start()
    await decode.start()
    disk = decode.tiers.tiers.stores["disk"] if decode.tiers.tiers else None
    disk.direct_io = False  # type: ignore[union-attr]  # /dev/full takes no O_DIRECT
    executor = RemoteExecutor(token=ADMIN)
    assert prefill.info is not None and decode.info is not None
    try:
        outcomes: dict[int, Any] = {}
        firsts = {}
        for rid, (length, seed) in list(enumerate(PROMPTS, start=1))[:2]:
            held = await executor.prefill(
                prefill.info, rid, PrefillRequest(prompt_tokens=length, prompt_seed=seed)
            )
            firsts[rid] = held.first_token
            plan = AttemptPlan(
                rid, held.model_id, held.layout.to_layout(), prefill.info, decode.info,
                "nvlink", 1, 30.0,
            )  # fmt: skip
            try:
                outcomes[rid] = await executor.transfer(plan)
            except AttemptFailed as exc:
                outcomes[rid] = exc
        first = await executor.decode(decode.info, 1, firsts[1], NEW_TOKENS)
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{decode.info.control_url}/metrics") as answer,
        ):
            metrics = await answer.text()
        return outcomes[2], first, metrics, {"held": len(decode.store)}
    finally:
        await executor.close()
        await prefill.stop()
        await decode.stop()


def test_a_full_disk_refuses_the_copy_and_loses_nothing(tmp_path: Path) -> None:
    refused, first, metrics, info = asyncio.run(_full_disk(tmp_path))
    assert isinstance(refused, AttemptFailed) and "No space left" in str(refused)
    assert first.tokens == _expected()[1]  # the held one is untouched
    assert info["held"] == 1
    assert 'topkv_kv_tier_failures_total{kind="full",tier="disk"} 1.0' in metrics
    assert 'topkv_kv_tier_events_total{event="refused"} 1.0' in metrics
