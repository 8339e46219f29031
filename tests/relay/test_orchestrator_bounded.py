"""The orchestrator's bounded executor calls: at once when the call does not wait, under a
deadline when it does, with results, errors and cancellation passed through."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import pytest

from topkv.relay.attempts.bounded import bounded


async def _immediate(value: int) -> int:
    return value


async def _fails_at_once() -> int:
    raise ValueError("bad input")


async def _waits(event: asyncio.Event, value: int, steps: int = 3) -> int:
    for _ in range(steps):
        await asyncio.sleep(0)
    await event.wait()
    return value


async def _fails_after_waiting() -> int:
    await asyncio.sleep(0)
    raise KeyError("late")


def _run(awaitable: Awaitable[int]) -> int:
    async def main() -> int:
        return await awaitable

    return asyncio.run(main())


def test_immediate_result_and_error() -> None:
    assert _run(bounded(_immediate(5), 1.0)) == 5
    with pytest.raises(ValueError, match="bad input"):
        _run(bounded(_fails_at_once(), 1.0))


def test_suspending_call_completes_and_errors_pass_through() -> None:
    async def main() -> int:
        event = asyncio.Event()
        asyncio.get_running_loop().call_soon(event.set)
        return await bounded(_waits(event, 9), 5.0)

    assert asyncio.run(main()) == 9
    with pytest.raises(KeyError, match="late"):
        _run(bounded(_fails_after_waiting(), 1.0))


def test_suspended_call_past_its_deadline_times_out_and_is_cancelled() -> None:
    cancelled: list[bool] = []

    async def hangs() -> int:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return 0

    with pytest.raises(TimeoutError):
        _run(bounded(hangs(), 0.01))
    assert cancelled == [True]


def test_cancelling_the_caller_cancels_the_call() -> None:
    cleaned: list[str] = []

    async def hangs() -> int:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.append("done")
        return 0

    async def main() -> None:
        task = asyncio.create_task(bounded(hangs(), 30.0))
        for _ in range(5):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert cleaned == ["done"]


def test_non_coroutine_awaitables_are_bounded_too() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[int] = loop.create_future()
        loop.call_soon(ready.set_result, 3)
        assert await bounded(ready, 1.0) == 3
        never: asyncio.Future[int] = loop.create_future()
        with pytest.raises(TimeoutError):
            await bounded(never, 0.01)

    asyncio.run(main())
