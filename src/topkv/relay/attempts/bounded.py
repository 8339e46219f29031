"""Bounded awaits for the orchestrator's executor calls (:func:`bounded`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine, Generator
from types import CoroutineType
from typing import Any, Generic, TypeVar, cast

T = TypeVar("T")


async def bounded(call: Awaitable[T], timeout_s: float) -> T:
    """``await call`` within ``timeout_s`` (``TimeoutError`` after), arming no timer when
    the call finishes without waiting.

    A coroutine is run up to its first suspension on the spot; only if it suspends does
    the rest run under ``asyncio.timeout``. The bound therefore covers the time the call
    spends waiting, which is all an event loop can interrupt anyway. Executor calls such as
    releasing a source often complete at once, and a timer costs more than they do.
    """
    if type(call) is not CoroutineType:
        async with asyncio.timeout(timeout_s):
            return await call
    coro = cast("Coroutine[Any, Any, T]", call)
    try:
        first = coro.send(None)
    except StopIteration as done:
        return cast("T", done.value)
    async with asyncio.timeout(timeout_s):
        return await _Resumed(coro, first)


class _Resumed(Generic[T]):
    """Awaits the rest of a coroutine already run to its first suspension point.

    Passes what the coroutine yields (the future it waits on) up to the task, and what the
    task sends or throws in (resumption, cancellation) down to the coroutine, as an
    ``await`` of it would have.
    """

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, Any, T], first: Any) -> None:
        self._coro = coro
        self._first = first

    def __await__(self) -> Generator[Any, None, T]:
        coro, pending = self._coro, self._first
        while True:
            try:
                yield pending
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as error:  # cancellation (or anything) thrown in
                try:
                    pending = coro.throw(error)
                except StopIteration as done:
                    return cast("T", done.value)
            else:
                try:
                    pending = coro.send(None)
                except StopIteration as done:
                    return cast("T", done.value)
