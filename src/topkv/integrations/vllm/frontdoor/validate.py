"""What the front door accepts as an OpenAI inference request, checked before any work.

A ``POST /v1/completions`` or ``/v1/chat/completions`` body is read by the orchestrator's
rules (:mod:`topkv.service.http.util`): at most :data:`MAX_INFERENCE_BODY_BYTES` (413),
a JSON content type or none (415), JSON nested at most
:data:`~topkv.service.http.util.MAX_JSON_DEPTH` deep, with finite numbers only, and an
object (400). Then the fields the front door and vLLM act on are checked against
:class:`CompletionBody` or :class:`ChatBody` (types; counts and ranges), and ``max_tokens``
against the served model's context (:class:`ServedContext`). Every other field (vLLM's many
extensions) passes through unchecked, and what is forwarded is the client's body as parsed,
never a model's dump with defaults added.

A refusal is :class:`Refused`, answered as the front door's JSON error
(:func:`error_response`) that names the field and the rule; :func:`json_errors` gives
aiohttp's own answers (404, 405, 413) that shape too. Rules and limits: docs/vllm.md
("What the front door checks").
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestPayloadError
from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError
from pydantic_core import PydanticCustomError

from topkv.service.http.util import (
    MAX_BODY_BYTES,
    MAX_JSON_DEPTH,
    MAX_PROBLEMS_SHOWN,
    json_http_error,
    json_problem,
)

log = logging.getLogger(__name__)

#: Largest inference body read (the orchestrator's limit: about 150,000 token ids, or a
#: million characters of prompt); larger ones get 413.
MAX_INFERENCE_BODY_BYTES = MAX_BODY_BYTES
#: Most choices (``n``) one request may ask for. Each choice is a sequence in the decode
#: instance's batch while the picker counts the request once against the instance's
#: capacity, and a broken stream of more than one choice cannot fail over; 16 covers
#: best-of-n sampling and keeps one request to a small share of a batch (vLLM alone takes
#: up to 16,384, OpenAI up to 128).
MAX_CHOICES = 16
#: ``max_tokens`` cap while the served model's context is not known (no instance answered
#: ``GET /v1/models`` with a ``max_model_len``): 2**20, above the context of the models
#: vLLM commonly serves; the instance clamps to the real context.
MAX_TOKENS_WITHOUT_CONTEXT = 1 << 20
#: Stop strings one request may give, and the characters of each. vLLM refuses more than
#: its ``VLLM_MAX_STOP_STRINGS`` (4 unless raised, OpenAI's number) itself.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
#: Largest token id in a prompt (vLLM holds token ids as int32).
MAX_TOKEN_ID = 2**31 - 1
#: The fields that ask for a number of generated tokens.
MAX_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")
#: How long a learned context is trusted, and how soon a failed look is tried again.
CONTEXT_REFRESH_S = 60.0
CONTEXT_RETRY_S = 5.0
#: Largest ``GET /v1/models`` answer read from an instance.
MAX_MODELS_ANSWER_BYTES = 1 << 20

_INT64_MAX = 2**63 - 1


# -- the error answer --------------------------------------------------------------------


def error_response(
    status: int, kind: str, detail: str, type_: str = "", param: str | None = None
) -> web.Response:
    """TopKV's error shape (``kind``, ``type``, ``detail``) plus OpenAI's ``message`` and
    ``code`` (and ``param``, the field at fault, when one is), so the openai client shows
    the reason."""
    error: dict[str, Any] = {
        "kind": kind, "type": type_ or kind, "detail": detail, "message": detail, "code": status,
    }  # fmt: skip
    if param is not None:
        error["param"] = param
    return web.json_response({"error": error}, status=status)


class Refused(Exception):
    """A request the front door will not serve: answered with :meth:`response`."""

    def __init__(
        self, status: int, kind: str, detail: str, type_: str = "", param: str | None = None
    ) -> None:
        super().__init__(detail)
        self.status, self.kind, self.detail = status, kind, detail
        self.type_, self.param = type_ or kind, param

    def response(self) -> web.Response:
        return error_response(self.status, self.kind, self.detail, self.type_, self.param)


def _bad(detail: str, type_: str, param: str | None = None) -> Refused:
    return Refused(400, "bad_request", detail, type_, param)


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own error answers (a 404, a 405, a 413) in the front door's JSON shape; an
    unexpected exception logged here and answered 500 ``internal``, with no traceback."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        return json_http_error(request, exc, error_response)
    except Exception as exc:
        if getattr(request.writer, "output_size", 0):
            raise  # the answer has begun: aiohttp can only close the connection
        log.error("%s %s failed", request.method, request.path[:200], exc_info=exc)
        detail = "an unexpected error; the front door's log has it"
        return error_response(500, "internal", detail, type(exc).__name__)


# -- the request models ------------------------------------------------------------------


def _is_token_id(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_TOKEN_ID


def _prompt(value: Any) -> Any:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value) or all(_is_token_id(t) for t in value):
            return value
        if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in value):
            return value
    raise PydanticCustomError(
        "prompt",
        "must be a non-empty string, a list of strings, a list of token ids (integers in "
        "[0, 2**31)) or a list of such lists",
    )


def _content(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(p, str) or (isinstance(p, dict) and isinstance(p.get("type"), str))
        for p in value
    ):
        return value
    raise PydanticCustomError(
        "content",
        "must be a string, null, or a list of content parts (strings, or objects with a "
        'string "type")',
    )


def _stop(value: Any) -> Any:
    strings = [value] if isinstance(value, str) else value
    if value is None or (
        isinstance(strings, list)
        and len(strings) <= MAX_STOP_STRINGS
        and all(isinstance(s, str) and len(s) <= MAX_STOP_CHARS for s in strings)
    ):
        return value
    raise PydanticCustomError(
        "stop",
        "must be a string or a list of at most {most} strings, each of at most {chars} characters",
        {"most": MAX_STOP_STRINGS, "chars": MAX_STOP_CHARS},
    )


Prompt = Annotated[Any, PlainValidator(_prompt)]
Content = Annotated[Any, PlainValidator(_content)]
Stop = Annotated[Any, PlainValidator(_stop)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


class _OpenAIBody(BaseModel):
    """The fields both endpoints share. Strict types: the front door reads ``stream``, ``n``
    and the token counts itself and must read them as vLLM will (``"false"`` is no bool).
    Unknown fields are kept (and forwarded as sent)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=-(2**63), le=_INT64_MAX)
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    stop: Stop = None
    user: str | None = None
    # vLLM's sampling extensions that a continuation after a failover carries over
    min_tokens: int | None = Field(None, ge=0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    use_beam_search: bool | None = None
    return_token_ids: bool | None = None


class CompletionBody(_OpenAIBody):
    """``POST /v1/completions``: a ``prompt`` (or vLLM's ``prompt_embeds``)."""

    prompt: Prompt = None
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=-1)
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: str = Field(min_length=1)
    content: Content = None


class ChatBody(_OpenAIBody):
    """``POST /v1/chat/completions``: one message at least."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=-1)


# -- reading -----------------------------------------------------------------------------


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range; send finite numbers")
    return value


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not a JSON number; send finite numbers")


def _problems(exc: ValidationError) -> tuple[str, str | None]:
    """The validation errors, each as ``field.path: rule``, and the first one's field."""
    errors = exc.errors(include_url=False, include_input=False)
    locs = [".".join(str(p) for p in e["loc"]) or "body" for e in errors]
    shown = [f"{loc}: {e['msg']}" for loc, e in zip(locs, errors, strict=True)]
    if len(shown) > MAX_PROBLEMS_SHOWN:
        shown = [*shown[:MAX_PROBLEMS_SHOWN], f"and {len(errors) - MAX_PROBLEMS_SHOWN} more"]
    return "; ".join(shown), (locs[0] if locs else None)


def parse_body(raw: bytes, chat: bool) -> dict[str, Any]:
    """``raw`` as a checked request of its endpoint (chat or completions), as parsed; raises
    :class:`Refused` (400) naming what is wrong."""
    if not raw.strip():
        raise _bad("the body is empty; send the request as a JSON object", "JSONError")
    problem = json_problem(raw)
    if problem is not None:
        raise _bad(problem, "JSONError")
    try:
        body = json.loads(raw, parse_float=_finite_float, parse_constant=_no_constant)
    except RecursionError:  # malformed and deep: json_problem leaves that to the parser
        detail = f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels"
        raise _bad(detail, "JSONError") from None
    except ValueError as exc:
        raise _bad(f"the body is not JSON: {exc}", "JSONError") from None
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object", "ValidationError")
    try:
        (ChatBody if chat else CompletionBody).model_validate(body)
    except ValidationError as exc:
        detail, param = _problems(exc)
        raise _bad(detail, "ValidationError", param) from None
    if not chat and body.get("prompt") is None and body.get("prompt_embeds") is None:
        raise _bad("prompt: Field required (or vLLM's prompt_embeds)", "ValidationError", "prompt")
    return body


def _json_content_type(value: str) -> bool:
    media = value.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


async def read_body(request: web.Request, chat: bool) -> dict[str, Any]:
    """The request's body, read and checked (:func:`parse_body`): 415 unless its content
    type is JSON (or not given), 413 over the size limit, 400 unreadable."""
    content_type = request.headers.get("Content-Type")
    if content_type is not None and not _json_content_type(content_type):
        raise Refused(
            415, "unsupported_media_type",
            f"Content-Type {content_type[:100]!r}: send the request as application/json",
            "UnsupportedMediaType",
        )  # fmt: skip
    limit = request.client_max_size
    declared = request.content_length
    if limit and declared is not None and declared > limit:
        raise _too_large(limit, str(declared))
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(limit, f"over {limit}") from None
    except (RequestPayloadError, HttpProcessingError) as exc:
        raise _bad(f"unreadable body: {exc}", "PayloadError") from None
    return parse_body(raw, chat)


def _too_large(limit: int, size: str) -> Refused:
    detail = f"the request body is {size} bytes; this server reads at most {limit}"
    return Refused(413, "too_large", detail, "RequestEntityTooLarge")


# -- the model's context -----------------------------------------------------------------


def asks_for_tokens(body: dict[str, Any]) -> bool:
    """Whether the body names a number of tokens to generate (checked against the context)."""
    return any(body.get(name) is not None for name in MAX_TOKEN_FIELDS)


def check_context(body: dict[str, Any], context: int | None) -> None:
    """400 for ``max_tokens`` (or ``max_completion_tokens``) beyond the model's context
    (``context``, its ``max_model_len``; None: unknown, :data:`MAX_TOKENS_WITHOUT_CONTEXT`)."""
    limit = context or MAX_TOKENS_WITHOUT_CONTEXT
    for name in MAX_TOKEN_FIELDS:
        value = body.get(name)
        if isinstance(value, int) and value > limit:
            where = (
                f"the model's context ({context} tokens, its max_model_len)"
                if context
                else f"{limit}, the front door's cap while no instance has told it the "
                "model's context"
            )
            raise _bad(f"{name}: {value} is more than {where}", "ValidationError", name)


class ServedContext:
    """The served model's context (vLLM's ``max_model_len``), learned from an instance's
    ``GET /v1/models`` answer (the smallest of its cards'; every instance behind one front
    door serves the same model). Trusted for :data:`CONTEXT_REFRESH_S`; a look that finds
    nothing is tried again after :data:`CONTEXT_RETRY_S` (the old value kept meanwhile)."""

    def __init__(
        self,
        refresh_s: float = CONTEXT_REFRESH_S,
        retry_s: float = CONTEXT_RETRY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tokens: int | None = None
        self._refresh_s, self._retry_s, self._clock = refresh_s, retry_s, clock
        self._next_look = -math.inf
        self._lock = asyncio.Lock()

    def learn(self, answer: bytes) -> bool:
        """Take the context from a ``/v1/models`` answer; False when it names none."""
        try:
            cards = json.loads(answer).get("data")
        except (ValueError, RecursionError, AttributeError):
            return False
        lengths = [
            card["max_model_len"]
            for card in (cards if isinstance(cards, list) else ())
            if isinstance(card, dict)
            and type(card.get("max_model_len")) is int
            and card["max_model_len"] > 0
        ]
        if not lengths:
            return False
        self.tokens = min(lengths)
        self._next_look = self._clock() + self._refresh_s
        return True

    async def current(self, fetch: Callable[[], Awaitable[bytes | None]]) -> int | None:
        """The context, looked up with ``fetch`` (an instance's ``/v1/models`` answer, None
        for none) when it is due; None while no instance has told it."""
        if self._clock() < self._next_look:
            return self.tokens
        async with self._lock:
            if self._clock() >= self._next_look:
                answer = await fetch()
                if answer is None or not self.learn(answer):
                    self._next_look = self._clock() + self._retry_s
        return self.tokens
