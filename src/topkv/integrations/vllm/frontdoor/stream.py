"""A decode instance's streamed answer, relayed to the client: its load report, and failover.

:class:`StreamRelay` forwards the decode's server-sent events whole, adds the decode's load
report (asked for with a ``report_of`` request) to the chunk that carries the
``finish_reason``, and, when the stream breaks off, continues the request on another decode
instance from the tokens already sent (at most :data:`MAX_FAILOVERS` times; single-choice
requests only, :func:`can_fail_over`). How: docs/vllm.md ("Streams").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from topkv.relay.workers import WorkerInfo

log = logging.getLogger(__name__)

#: Continuations one request may need (each on another instance).
MAX_FAILOVERS = 2
#: Request fields a continuation carries over (the sampling; the rest is rebuilt).
_CARRIED = (
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "stream_options", "user",
)  # fmt: skip
_COMPLETION_ONLY = ("logprobs", "suffix")
#: vLLM's default ``max_tokens`` for /v1/completions.
_COMPLETIONS_DEFAULT_MAX = 16
_DONE = b"data: [DONE]"


class StreamBroken(Exception):
    """The decode's stream failed or ended without ``[DONE]``."""


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The answer's whole events (without their blank-line terminator); raises
    :class:`StreamBroken` when it breaks off before ``data: [DONE]``."""
    buffer = b""
    try:
        async for chunk in response.content.iter_any():
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                yield event
                if event.strip() == _DONE:
                    return
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise StreamBroken(f"{type(exc).__name__}: {exc}") from exc
    raise StreamBroken("the stream ended without [DONE]")


def _data(event: bytes) -> dict[str, Any] | None:
    """An event's JSON object (None: a comment, [DONE] or not JSON)."""
    text = event.strip()
    if not text.startswith(b"data:") or text == _DONE:
        return None
    try:
        value = json.loads(text[len(b"data:") :])
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def wants_token_ids(body: dict[str, Any]) -> bool:
    return bool(body.get("return_token_ids"))


def can_fail_over(body: dict[str, Any]) -> bool:
    return body.get("n") in (None, 1) and not body.get("use_beam_search")


@dataclass
class StreamState:
    """What the client has been sent so far."""

    chat: bool
    client_wants_ids: bool
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    chunk_id: str | None = None
    created: int | None = None
    model: str | None = None
    first_token: asyncio.Event = field(default_factory=asyncio.Event)

    def note(self, data: dict[str, Any]) -> None:
        """Take the ids out of a chunk of the original stream."""
        self.chunk_id = self.chunk_id or data.get("id")
        self.created = self.created or data.get("created")
        self.model = self.model or data.get("model")
        if self.chat and isinstance(data.get("prompt_token_ids"), list):
            self.prompt_ids = self.prompt_ids or list(data["prompt_token_ids"])
        for choice in data.get("choices") or []:
            if not self.chat and isinstance(choice.get("prompt_token_ids"), list):
                self.prompt_ids = self.prompt_ids or list(choice["prompt_token_ids"])
            ids = choice.get("token_ids") or []
            self.generated.extend(int(i) for i in ids)
            if ids:
                self.first_token.set()

    def strip(self, data: dict[str, Any]) -> None:
        """Remove the ids the client did not ask for."""
        if self.client_wants_ids:
            return
        data.pop("prompt_token_ids", None)
        for choice in data.get("choices") or []:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)


def continuation_body(body: dict[str, Any], state: StreamState, prompt: Any) -> dict[str, Any]:
    """The /v1/completions stream that continues the request after ``state.generated``."""
    sent = len(state.generated)
    out: dict[str, Any] = {k: body[k] for k in _CARRIED if k in body}
    if not state.chat:
        out.update({k: body[k] for k in _COMPLETION_ONLY if k in body})
    out["prompt"] = prompt
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is None and not state.chat:
        limit = _COMPLETIONS_DEFAULT_MAX
    if isinstance(limit, int):
        out["max_tokens"] = max(limit - sent, 1)
    if isinstance(body.get("min_tokens"), int):
        out["min_tokens"] = max(body["min_tokens"] - sent, 0)
    out.update(stream=True, return_token_ids=True)
    return out


def as_client_chunk(data: dict[str, Any], state: StreamState, sent_before: int) -> None:
    """Turn a continuation's completion chunk into the original stream's (in place)."""
    data["id"] = state.chunk_id or data.get("id")
    if state.created is not None:
        data["created"] = state.created
    usage = data.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        usage["prompt_tokens"] -= sent_before  # the client's prompt, not ours
        usage["completion_tokens"] = usage.get("completion_tokens", 0) + sent_before
    if not state.chat:
        return
    data["object"] = "chat.completion.chunk"
    choices = []
    for choice in data.get("choices") or []:
        converted = {
            "index": choice.get("index", 0),
            "delta": {"content": choice.get("text", "")},
            "logprobs": None,
            "finish_reason": choice.get("finish_reason"),
        }
        if "token_ids" in choice:
            converted["token_ids"] = choice["token_ids"]
        choices.append(converted)
    data["choices"] = choices


def _finishing(data: dict[str, Any]) -> bool:
    return any(c.get("finish_reason") is not None for c in data.get("choices") or [])


#: Opens a stream at an instance: (worker, URL path, body) -> the answer (raises on failure).
Open = Callable[[WorkerInfo, str, dict[str, Any]], Awaitable[aiohttp.ClientResponse]]
#: The next decode instance for a continuation, not one of ``excluded`` (None: none left).
Next = Callable[[set[str]], WorkerInfo | None]


@dataclass
class Failover:
    """One continuation, for the report and the metrics."""

    failed: str
    to: str
    after_tokens: int
    ms: float  # the break to the continuation's first event


class StreamRelay:
    def __init__(
        self,
        out: web.StreamResponse,
        body: dict[str, Any],
        chat: bool,
        report: Callable[[], Coroutine[Any, Any, dict[str, Any] | None]],
        open_stream: Open,
        next_decode: Next,
        dropped: Callable[[str], Awaitable[None]],
    ) -> None:
        self.out = out
        self.body = body
        self.state = StreamState(chat, wants_token_ids(body))
        self._report_of = report
        self._open = open_stream
        self._next = next_decode
        self._dropped = dropped
        self._report: asyncio.Task[dict[str, Any] | None] | None = None
        self.failovers: list[Failover] = []
        self.outcome = "200"
        #: What the last chunk carried as ``kv_transfer_params`` (None: not sent).
        self.final_params: dict[str, Any] | None = None

    async def _send(self, data: dict[str, Any]) -> None:
        if _finishing(data):
            params = await self._final_params()
            if params is not None:
                data["kv_transfer_params"] = params
        await self.out.write(b"data: " + json.dumps(data).encode() + b"\n\n")

    async def _final_params(self) -> dict[str, Any] | None:
        part: dict[str, Any] = {}
        if self._report is not None:
            try:
                report = await asyncio.wait_for(asyncio.shield(self._report), 10.0)
            except Exception as exc:  # the report is extra: the answer goes out without it
                part["report_error"] = f"{type(exc).__name__}: {exc}"
            else:
                part.update(report or {"report_error": "the decode instance had no report"})
        if self.failovers:
            part["failovers"] = [f.__dict__ for f in self.failovers]
        self.final_params = {"topkv": part} if part else None
        return self.final_params

    async def _pump(self, answer: aiohttp.ClientResponse, mode: str) -> None:
        """Forward ``answer``'s events until ``[DONE]`` (raises StreamBroken). ``mode``:
        ``original`` (the decode that loaded the KV), ``continuation`` (a completion of the
        prompt plus what was sent) or ``restart`` (the request again, nothing sent yet)."""
        sent_before = len(self.state.generated)
        async for event in sse_events(answer):
            data = _data(event)
            if data is None:
                if event.strip() == _DONE:
                    await self.out.write(_DONE + b"\n\n")
                elif event.strip():
                    await self.out.write(event + b"\n\n")
                continue
            if "error" in data and not data.get("choices"):
                await self.out.write(event + b"\n\n")  # vLLM's own error: the client's
                self.outcome = "stream_error"
                return
            if mode == "continuation":
                data.pop("prompt_token_ids", None)
                for choice in data.get("choices") or []:
                    choice.pop("prompt_token_ids", None)
                as_client_chunk(data, self.state, sent_before)
            elif mode == "restart":
                data["id"] = self.state.chunk_id or data.get("id")
            self.state.note(data)
            if self._report is None and self.state.first_token.is_set() and mode == "original":
                self._report = asyncio.create_task(self._report_of())
            self.state.strip(data)
            await self._send(data)

    async def run(self, decode: WorkerInfo, answer: aiohttp.ClientResponse) -> None:
        excluded = {decode.worker_id}
        current, response, mode = decode, answer, "original"
        while True:
            try:
                async with response:
                    await self._pump(response, mode)
                return
            except StreamBroken as exc:
                broke = time.perf_counter()
                log.warning("router: the stream from %s broke off: %s", current.worker_id, exc)
                await self._dropped(current.worker_id)
            if not can_fail_over(self.body) or len(self.failovers) >= MAX_FAILOVERS:
                await self._give_up(f"the stream from {current.worker_id} broke off")
                return
            opened = await self._continue(excluded)
            if opened is None:
                await self._give_up(
                    f"the stream from {current.worker_id} broke off and no other decode "
                    "instance is registered to continue it"
                )
                return
            failed = current.worker_id
            current, response, mode = opened
            ms = round((time.perf_counter() - broke) * 1000, 3)
            self.failovers.append(
                Failover(failed, current.worker_id, len(self.state.generated), ms)
            )
            excluded.add(current.worker_id)

    async def _continue(
        self, excluded: set[str]
    ) -> tuple[WorkerInfo, aiohttp.ClientResponse, str] | None:
        """Open the continuation on the next instance that answers (None: none left)."""
        state = self.state
        prompt: Any = None
        if state.prompt_ids is not None:
            prompt = state.prompt_ids + state.generated
        elif not state.chat and not state.generated:
            prompt = self.body.get("prompt")
        while True:
            target = self._next(excluded)
            if target is None:
                return None
            if prompt is None:  # a chat with nothing streamed yet: the request again
                path, mode = "/v1/chat/completions", "restart"
                body = {k: v for k, v in self.body.items() if k != "kv_transfer_params"}
                body.update(stream=True, return_token_ids=True)
            else:
                path, mode = "/v1/completions", "continuation"
                body = continuation_body(self.body, state, prompt)
            try:
                answer = await self._open(target, path, body)
            except Exception as exc:  # unreachable: the next one
                log.warning("router: continuing on %s failed: %s", target.worker_id, exc)
                excluded.add(target.worker_id)
                await self._dropped(target.worker_id)
                continue
            if answer.status != 200:
                text = (await answer.read())[:300]
                answer.release()
                log.warning("router: %s refused the continuation: %s", target.worker_id, text)
                excluded.add(target.worker_id)
                continue
            return target, answer, mode

    async def _give_up(self, why: str) -> None:
        self.outcome = "stream_broken"
        error = {"message": why, "type": "upstream", "code": 502, "kind": "upstream"}
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.out.write(b"data: " + json.dumps({"error": error}).encode() + b"\n\n")

    async def close(self) -> None:
        if self._report is not None and not self._report.done():
            self._report.cancel()
            with contextlib.suppress(BaseException):
                await self._report
