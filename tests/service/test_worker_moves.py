"""The one executor moving KV between real in-process workers: paced attempts, stamps,
failure kinds, cleanup, and the measurement copies (serial and replay schedules, drained).

Both workers are :class:`~topkv.service.worker.service.WorkerService` (the class ``topkv worker``
runs) in this event loop, registered straight into a memory registry; bytes really cross
shared memory or TCP on loopback and every layer's CRC-64 is checked on arrival.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from topkv.relay.executor import AttemptFailed, AttemptPlan
from topkv.relay.registry.memory import MemoryRegistry
from topkv.relay.transfers import FailureKind
from topkv.relay.workers import WorkerInfo
from topkv.service.compute.engines import PrefillPlan, Publish
from topkv.service.http.auth import Credentials, ServerAuth, auth_headers, new_token
from topkv.service.messages import LayoutModel, PacedLink, PrefillRequest
from topkv.service.orchestrator.executor import RemoteExecutor
from topkv.service.worker.registrar import DirectRegistrar
from topkv.service.worker.service import WorkerConfig, WorkerFaults, WorkerService
from topkv.transport.base import KVLayout

SECRET = b"moves-test-secret-0123456789abcdef"
LAYOUT = KVLayout(num_layers=6, seq_len=32, kv_heads=2, head_dim=16, dtype="fp16")
MODEL = "m"
RID = 7
LAYER_DELAY_S = 0.03
ADMIN = new_token()  # what the workers' control APIs accept


class _SlowLayers:
    """The synthetic engine with each layer held back, so prefill takes a while."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        self.inner = inner
        self.delay_s = delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def prefill(self, plan: PrefillPlan, publish: Publish) -> int | None:
        def slow(index: int, tensors: tuple[memoryview, ...], crcs: tuple[int, ...]) -> None:
            time.sleep(self.delay_s)
            publish(index, tensors, crcs)

        return self.inner.prefill(plan, slow)  # type: ignore[no-any-return]


def _config(role: str, worker_id: str, faults: WorkerFaults) -> WorkerConfig:
    return WorkerConfig(
        role="prefill" if role == "prefill" else "decode",
        node="node-0",
        secret=SECRET,
        worker_id=worker_id,
        media=("tcp", "shm"),
        faults=faults,
        auth=ServerAuth(Credentials.of(admin=[ADMIN])),
    )


@asynccontextmanager
async def _pair(faults: WorkerFaults | None = None) -> AsyncIterator[tuple[WorkerService, ...]]:
    registry = MemoryRegistry()
    prefill = WorkerService(
        _config("prefill", "prefill0", faults or WorkerFaults()), DirectRegistrar(registry)
    )
    decode = WorkerService(_config("decode", "decode0", WorkerFaults()), DirectRegistrar(registry))
    await prefill.start()
    await decode.start()
    prefill.engine = _SlowLayers(prefill.engine, LAYER_DELAY_S)
    try:
        yield prefill, decode
    finally:
        await prefill.stop()
        await decode.stop()


def _plan(
    source: WorkerService, destination: WorkerService, path_class: str = "nvlink"
) -> AttemptPlan:
    assert source.info is not None and destination.info is not None
    return AttemptPlan(RID, MODEL, LAYOUT, source.info, destination.info, path_class, 1, 10.0)


def _info(worker: WorkerService) -> WorkerInfo:
    assert worker.info is not None
    return worker.info


async def _prefill(executor: RemoteExecutor, worker: WorkerService) -> None:
    body = PrefillRequest(model_id=MODEL, layout=LayoutModel.of(LAYOUT), wait=False)
    await executor.prefill(_info(worker), RID, body)


async def _control(worker: WorkerService, path: str) -> Any:
    async with (
        aiohttp.ClientSession(headers=auth_headers(ADMIN)) as http,
        http.get(f"{_info(worker).control_url}{path}") as answer,
    ):
        return answer.status, await answer.json()


def _paced(gbps: float, dilation: float = 1.0) -> Callable[[AttemptPlan, str], PacedLink]:
    link = PacedLink(mode="nvlink", bandwidth_gbps=gbps, setup_s=1e-6, dilation=dilation)
    return lambda plan, medium: link


def test_a_paced_streamed_attempt_carries_the_digest_and_every_layer_stamp() -> None:
    async def main() -> None:
        async with _pair() as (prefill, decode):
            executor = RemoteExecutor(token=ADMIN, pacing=_paced(450.0, dilation=100.0))
            try:
                await _prefill(executor, prefill)
                delivery = await executor.transfer(_plan(prefill, decode))
                source = await executor.source_summary(_info(prefill), RID)
                report = executor.delivered_report(RID)
            finally:
                await executor.close()
        assert report is not None and executor.delivered_report(RID) is None  # once
        assert delivery.digest == source.digest == report.held.digest != 0
        assert delivery.emulated and report.sent.emulated and report.sent.dilation == 100.0
        sent, held, ready = report.sent, report.held.timings, source.timings.layer_ready_s
        layers = LAYOUT.num_layers
        assert len(sent.offered_s) == len(sent.handed_s) == len(ready) == layers
        arrivals = held.arrivals_s
        assert len(arrivals) == layers and all(a is not None for a in arrivals)
        for layer in range(layers):
            landed = arrivals[layer]
            assert landed is not None
            # streamed: offered as prefill published it, paced, then landed verified
            assert sent.offered_s[layer] >= ready[layer] - 1e-3
            assert sent.handed_s[layer] >= sent.offered_s[layer]
            assert landed >= sent.handed_s[layer]
        # the stream began before prefill ended (layer 0 left while later layers computed)
        assert source.timings.forward_end_s is not None
        assert sent.offered_s[0] < source.timings.forward_end_s
        assert held.verified_s is not None and held.verified_s >= max(a or 0 for a in arrivals)

    asyncio.run(main())


def test_a_corrupted_send_maps_to_checksum_and_leaves_nothing_at_either_end() -> None:
    async def main() -> None:
        async with _pair(WorkerFaults(corrupt_rate=1.0, seed=1)) as (prefill, decode):
            executor = RemoteExecutor(token=ADMIN)
            try:
                await _prefill(executor, prefill)
                with pytest.raises(AttemptFailed) as failed:
                    await executor.transfer(_plan(prefill, decode))
                status, _ = await _control(decode, f"/v1/kv/{RID}")
                _, source_info = await _control(prefill, "/v1/info")
                _, destination_info = await _control(decode, "/v1/info")
            finally:
                await executor.close()
        assert failed.value.kind == FailureKind.CHECKSUM
        assert status == 404 and executor.delivered_report(RID) is None
        assert source_info["sending"] == 0 and source_info["held"] == 1  # still the source's
        assert destination_info["receiving"] == 0 and destination_info["held"] == 0

    asyncio.run(main())


def test_a_cancelled_attempt_stops_the_sender_and_drops_the_copy() -> None:
    async def main() -> None:
        async with _pair() as (prefill, decode):
            executor = RemoteExecutor(
                token=ADMIN, pacing=_paced(0.0001, dilation=1000.0)
            )  # ~40 s a layer
            try:
                await _prefill(executor, prefill)
                task = asyncio.create_task(executor.transfer(_plan(prefill, decode)))
                await asyncio.sleep(0.5)
                _, sending = await _control(prefill, "/v1/info")
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await asyncio.sleep(0.2)
                _, source_info = await _control(prefill, "/v1/info")
                _, destination_info = await _control(decode, "/v1/info")
            finally:
                await executor.close()
        assert sending["sending"] == 1  # it was under way
        assert source_info["sending"] == 0
        assert destination_info["receiving"] == 0 and destination_info["held"] == 0

    asyncio.run(main())


def test_a_path_no_medium_serves_is_a_transport_failure_before_anything_is_sent() -> None:
    async def main() -> None:
        async with _pair() as (prefill, decode):
            executor = RemoteExecutor(media={"nvlink": "shm"}, token=ADMIN)
            try:
                with pytest.raises(AttemptFailed) as failed:
                    await executor.transfer(_plan(prefill, decode, "rdma"))
                _, destination_info = await _control(decode, "/v1/info")
            finally:
                await executor.close()
        assert failed.value.kind == FailureKind.TRANSPORT
        assert destination_info["receiving"] == 0

    asyncio.run(main())


def test_the_source_summary_waits_for_a_running_prefill_and_unknown_kv_is_source_lost() -> None:
    async def main() -> None:
        async with _pair() as (prefill, _):
            executor = RemoteExecutor(token=ADMIN)
            try:
                await _prefill(executor, prefill)
                summary = await executor.source_summary(_info(prefill), RID)
                with pytest.raises(AttemptFailed) as failed:
                    await executor.source_summary(_info(prefill), RID + 1)
            finally:
                await executor.close()
        assert summary.complete and summary.digest != 0
        timings = summary.timings
        assert timings.forward_start_s is not None and timings.forward_end_s is not None
        ready = timings.layer_ready_s
        assert len(ready) == LAYOUT.num_layers and ready == sorted(ready)
        assert timings.forward_start_s <= ready[0] and ready[-1] <= timings.forward_end_s
        # the engine held each layer back: prefill took at least that long
        assert timings.forward_end_s - timings.forward_start_s >= LAYOUT.num_layers * LAYER_DELAY_S
        assert failed.value.kind == FailureKind.SOURCE_LOST

    asyncio.run(main())


def test_serial_and_replay_copies_follow_their_schedules_and_are_drained() -> None:
    async def main() -> None:
        async with _pair() as (prefill, decode):
            executor = RemoteExecutor(token=ADMIN)
            src, dst = _info(prefill), _info(decode)

            async def copy(transfer_id: int, schedule: Any, medium: str) -> Any:
                return await executor.send_copy(
                    src, dst, RID, transfer_id, LAYOUT, model_id=MODEL, medium=medium,
                    timeout_s=10.0, schedule=schedule,
                )  # fmt: skip

            try:
                await _prefill(executor, prefill)
                serial = await copy(1 << 40, "serial", "shm")  # asked while prefill runs
                replay = await copy((1 << 40) + 1, "replay", "tcp")
                source = await executor.source_summary(src, RID)
                _, held = await _control(decode, "/v1/kv")
                _, destination_info = await _control(decode, "/v1/info")
            finally:
                await executor.close()
        timings = source.timings
        assert timings.forward_start_s is not None and timings.forward_end_s is not None
        # serial: nothing left before the KV was whole
        assert serial.sent.transfer_id == 1 << 40
        assert min(serial.sent.offered_s) >= timings.forward_end_s - 1e-3
        # replay: layer l left no earlier than start + (ready_l - forward_start)
        start = replay.sent.started_s
        for layer, ready in enumerate(timings.layer_ready_s):
            assert replay.sent.offered_s[layer] >= start + (ready - timings.forward_start_s)
        spread = replay.sent.offered_s[-1] - replay.sent.offered_s[0]
        assert spread >= (timings.layer_ready_s[-1] - timings.layer_ready_s[0]) - 1e-3
        # drained: verified, stamped and released; the destination keeps nothing
        for copied in (serial, replay):
            assert copied.held.kept is False and copied.held.digest == 0
            assert all(a is not None for a in copied.held.timings.arrivals_s)
            assert copied.held.timings.verified_s is not None
        assert held == [] and destination_info["counters"]["drained"] == 2

    asyncio.run(main())
