"""DemoExecutor: how an attempt's messages go out and how worker events end it.

The worker side is a recording port here; the real processes run in test_demo_cli.py.
"""

from __future__ import annotations

import asyncio

import pytest

from topkv.demo.executor import DemoExecutor, WorkerPort
from topkv.demo.protocol import (
    CancelSend,
    Discard,
    Expect,
    Failed,
    Held,
    PrefillDone,
    Release,
    Send,
    SendDone,
)
from topkv.demo.topology import LinkChoice
from topkv.relay.executor import AttemptFailed, AttemptPlan
from topkv.relay.transfers import FailureKind
from topkv.relay.workers import WorkerInfo
from topkv.transport.base import KVLayout

LAYOUT = KVLayout(num_layers=3, seq_len=16, kv_heads=2, head_dim=8)
SOURCE = WorkerInfo(worker_id="prefill0", role="prefill", node="node-0", gpus=(0,))
DESTINATION = WorkerInfo(worker_id="decode0", role="decode", node="node-0", gpus=(1,))
ADDRESSES = {"decode0": {"shm": "/tmp/sock", "tcp": "127.0.0.1:1"}}


def _link(source: str, destination: str, transport: str, nbytes: int, chunks: int) -> LinkChoice:
    if transport == "nvlink":
        return LinkChoice("nvlink", 450.0, 1e-6, "shm")
    raise ValueError(f"no {transport} path")


def _executor() -> tuple[DemoExecutor, list[tuple[str, object]]]:
    sent: list[tuple[str, object]] = []
    port = WorkerPort(lambda worker, message: sent.append((worker, message)), lambda w: True)
    executor = DemoExecutor(port, ADDRESSES, _link, dilation=100.0, new_tokens=4, timeout_s=5)
    return executor, sent


def _plan(transport: str = "nvlink", attempt: int = 1) -> AttemptPlan:
    return AttemptPlan(7, "m", LAYOUT, SOURCE, DESTINATION, transport, attempt, 5.0)


def _send_done(wire: int, error: str | None = None, failure: str | None = None) -> SendDone:
    return SendDone(
        "prefill0", 7, "stream", 1.0, 2.0, (1.0,) * 3, (1.0,) * 3, LAYOUT.total_bytes, "shm",
        True, 100.0, error=error, wire_rid=wire, failure=failure,
    )  # fmt: skip


def test_delivery_carries_the_destination_digest_and_the_stream_stamps() -> None:
    async def main() -> None:
        executor, sent = _executor()
        task = asyncio.create_task(executor.transfer(_plan()))
        await asyncio.sleep(0)
        (dst, expect), (src, send) = sent
        assert dst == "decode0" and isinstance(expect, Expect) and expect.kind == "decode"
        assert src == "prefill0" and isinstance(send, Send) and send.schedule == "stream"
        assert send.wire_rid == expect.wire_rid and send.first_token_to == "decode0"
        assert send.destination == "/tmp/sock" and send.link is not None
        assert send.link.dilation == 100.0
        executor.on_event(Held("decode0", 7, send.wire_rid, 99, (2.0,) * 3, 2.5))
        executor.on_event(_send_done(send.wire_rid))
        delivery = await task
        assert (delivery.digest, delivery.destination, delivery.emulated) == (99, "decode0", True)
        assert delivery.seconds == pytest.approx(1.5)
        assert executor.delivered[7].wire_rid == send.wire_rid
        assert len(sent) == 2  # nothing cancelled or discarded

    asyncio.run(main())


def test_a_failed_send_maps_to_its_failure_kind_and_cleans_both_ends() -> None:
    async def main() -> None:
        executor, sent = _executor()
        task = asyncio.create_task(executor.transfer(_plan()))
        await asyncio.sleep(0)
        wire = sent[1][1].wire_rid  # type: ignore[attr-defined]
        executor.on_event(_send_done(wire, "ChecksumMismatch: layer 1", "checksum"))
        with pytest.raises(AttemptFailed) as failed:
            await task
        assert failed.value.kind == FailureKind.CHECKSUM
        assert sent[2:] == [("prefill0", CancelSend(7, wire)), ("decode0", Discard(7, wire))]

    asyncio.run(main())


def test_a_cancelled_attempt_stops_the_sender_and_drops_the_copy() -> None:
    async def main() -> None:
        executor, sent = _executor()
        task = asyncio.create_task(executor.transfer(_plan()))
        await asyncio.sleep(0)
        wire = sent[1][1].wire_rid  # type: ignore[attr-defined]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sent[2:] == [("prefill0", CancelSend(7, wire)), ("decode0", Discard(7, wire))]

    asyncio.run(main())


def test_unknown_path_is_a_transport_failure_before_anything_is_sent() -> None:
    async def main() -> None:
        executor, sent = _executor()
        with pytest.raises(AttemptFailed) as failed:
            await executor.transfer(_plan("rdma"))
        assert failed.value.kind == FailureKind.TRANSPORT and sent == []

    asyncio.run(main())


def test_source_digest_comes_from_prefill_done_or_fails_as_source_lost() -> None:
    async def main() -> None:
        executor, sent = _executor()
        waiting = asyncio.create_task(executor.source_digest(SOURCE, 7, LAYOUT))
        await asyncio.sleep(0)
        assert not waiting.done()  # prefill still running
        executor.on_event(PrefillDone("prefill0", 7, 5, 0.0, 0.1, 0.9, (0.3,) * 3, (0.2,) * 3, 42))
        assert await waiting == 42
        lost = asyncio.create_task(executor.source_digest(SOURCE, 8, LAYOUT))
        await asyncio.sleep(0)
        executor.on_event(Failed("prefill0", 8, "prefill: out of memory"))
        with pytest.raises(AttemptFailed) as failed:
            await lost
        assert failed.value.kind == FailureKind.SOURCE_LOST
        await executor.release_source(SOURCE, 7)
        assert sent == [("prefill0", Release(7, "relay"))]

    asyncio.run(main())
