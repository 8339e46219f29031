"""Small aiohttp helpers shared by the orchestrator's and the workers' HTTP APIs.

Hostile input is refused here, before any handler acts on it (docs/security.md):

* a body over the app's ``client_max_size`` (:data:`MAX_BODY_BYTES` unless configured) gets
  413: at once when its ``Content-Length`` says so, else as soon as that much has arrived
  (chunked or compressed bodies), so no more than the limit is ever held in memory;
* a JSON body nested deeper than :data:`MAX_JSON_DEPTH`, holding ``NaN`` or ``Infinity``,
  malformed, undecodable, or failing its model (unknown fields, wrong types, numbers out of
  range) gets 400 before pydantic builds anything;
* every error, aiohttp's own (404, 405, 413) included, is answered as JSON
  ``{"error": {"kind", "type", "detail"}}``; an unexpected exception is logged here with its
  traceback and answered 500 ``internal`` with no traceback.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn, TypeVar

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler, Middleware
from aiohttp.web_protocol import RequestPayloadError
from pydantic import BaseModel, ValidationError

from topkv.errors import TopKVError
from topkv.service.errors import ServiceError
from topkv.service.messages import ErrorBody, ErrorResponse

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

#: Largest request body (bytes) a control API reads by default; larger ones get 413.
MAX_BODY_BYTES = 1 << 20
#: Deepest JSON nesting a request body may have (the deepest request model needs 4 levels).
MAX_JSON_DEPTH = 32
#: Validation problems named in one 400 answer (a list of a million bad items makes a
#: million errors; the rest are counted, not listed).
MAX_PROBLEMS_SHOWN = 10

#: An error type (or types), the HTTP status and the failure kind it is answered with.
ErrorAnswer = tuple[type[TopKVError] | tuple[type[TopKVError], ...], int, str]
#: Answers that depend on the error itself: (status, kind), or None to use the table.
ErrorSpecial = Callable[[TopKVError], tuple[int, str] | None]

#: The kind of aiohttp's own error answers, by status.
_HTTP_KINDS = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "too_large",
    415: "unsupported_media_type",
}
#: Headers of aiohttp's error answers worth keeping on the JSON answer.
_KEPT_HEADERS = ("Allow", "Retry-After", "WWW-Authenticate")


def error_middleware(answers: Sequence[ErrorAnswer], special: ErrorSpecial) -> Middleware:
    """A middleware that answers a TopKV error as JSON (:func:`error_response`) with the
    status and kind of ``special`` or of its first entry in ``answers``; nothing leaks a
    traceback. A body whose ``Content-Length`` is over the limit gets 413 before the handler
    runs; aiohttp's own error answers become JSON; any other exception is logged and
    answered 500 ``internal``."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            _check_declared_size(request)
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400 or exc.content_type == "application/json":
                raise
            return json_http_error(request, exc)
        except TopKVError as exc:
            found = special(exc)
            if found is None:
                found = next((a[1:] for a in answers if isinstance(exc, a[0])), None)
            if found is None:
                return _internal(request, exc, str(exc))
            status, kind = found
            return error_response(status, kind, str(exc), type(exc).__name__)
        except Exception as exc:  # never a traceback to the client; the log has it
            return _internal(request, exc, "an unexpected error; the server's log has it")

    return middleware


def _internal(request: web.Request, exc: Exception, detail: str) -> web.Response:
    log.error("%s %s failed", request.method, request.path[:200], exc_info=exc)
    return error_response(500, "internal", detail, type(exc).__name__)


#: Makes a JSON error answer from (status, kind, detail, type): :func:`error_response`, or
#: a server's own shape of it (the OpenAI front door adds OpenAI's fields).
ErrorResponder = Callable[[int, str, str, str], web.Response]


def json_http_error(
    request: web.Request, exc: web.HTTPException, respond: ErrorResponder | None = None
) -> web.Response:
    """aiohttp's own error answer (a router's 404 or 405, say) as JSON, made by ``respond``
    (default :func:`error_response`), with the headers worth keeping."""
    text = exc.text or ""
    detail = text if text and not text.startswith(f"{exc.status}:") else exc.reason
    if exc.status in (404, 405):
        detail = f"{request.method} {request.path[:200]}: {detail}"
    kind = _HTTP_KINDS.get(exc.status, "http_error")
    answer = (respond or error_response)(exc.status, kind, detail, type(exc).__name__)
    for name in _KEPT_HEADERS:
        if name in exc.headers:
            answer.headers[name] = exc.headers[name]
    return answer


def error_response(status: int, kind: str, detail: str, type_: str = "") -> web.Response:
    """A JSON error answer: ``{"error": {"kind", "type", "detail"}}``."""
    body = ErrorResponse(error=ErrorBody(kind=kind, type=type_ or kind, detail=detail))
    return web.json_response(body.model_dump(), status=status)


def _json_text(kind: str, type_: str, detail: str) -> str:
    """The body of an HTTP exception answering a JSON error."""
    return json.dumps({"error": {"kind": kind, "type": type_, "detail": detail}})


def _raise(cls: type[web.HTTPException], kind: str, type_: str, detail: str) -> NoReturn:
    raise cls(text=_json_text(kind, type_, detail), content_type="application/json")


def model_response(model: BaseModel, status: int = 200) -> web.Response:
    return web.Response(
        body=model.model_dump_json(), status=status, content_type="application/json"
    )


def _too_large(limit: int, size: str) -> NoReturn:
    detail = f"the request body is {size} bytes; this server reads at most {limit}"
    raise web.HTTPRequestEntityTooLarge(
        limit,
        text=_json_text("too_large", "RequestEntityTooLarge", detail),
        content_type="application/json",
    )


def _check_declared_size(request: web.Request) -> None:
    """413 for a body whose ``Content-Length`` is over the limit (nothing of it is read)."""
    limit = request.client_max_size
    declared = request.content_length
    if limit and declared is not None and declared > limit:
        _too_large(limit, str(declared))


# A JSON string (escapes included) and the characters of the structure outside strings.
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_INNERMOST_PAIR = re.compile(rb"\[\]|\{\}")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_NON_FINITE = re.compile(rb"NaN|Infinity")


def json_problem(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """What makes ``raw`` unacceptable before it is parsed: nesting deeper than
    ``max_depth`` or a non-finite number (``NaN``, ``Infinity``); None otherwise.

    Linear passes in C (no recursion): strings are blanked, the brackets kept, and each
    round removes the innermost ``[]``/``{}`` pairs, one level per round. Malformed JSON
    (unbalanced brackets, an unterminated string) is left for the parser to name, except
    openers that never close deeper than ``max_depth``."""
    skeleton = _JSON_STRING.sub(b'""', raw)
    if _NON_FINITE.search(skeleton):
        return "NaN and Infinity are not JSON numbers; send finite numbers"
    brackets = skeleton.translate(None, _NOT_BRACKETS)
    deep = f"the JSON body is nested deeper than {max_depth} levels"
    for _ in range(max_depth):
        if not brackets:
            return None
        shorter = _INNERMOST_PAIR.sub(b"", brackets)
        if len(shorter) == len(brackets):
            break  # unbalanced: the parser says where, unless it opens too deep to parse
        brackets = shorter
    else:
        if brackets and _INNERMOST_PAIR.search(brackets):
            return deep
    # What is left has no innermost pair: a run of openers longer than max_depth is nesting
    # that never closes (``[[[[...``), which a recursive parser would still descend into.
    if re.search(rb"[\[{]{%d}" % (max_depth + 1), brackets):
        return deep
    return None


def _validation_problems(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False, include_input=False)
    shown = [
        f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
        for e in errors[:MAX_PROBLEMS_SHOWN]
    ]
    if len(errors) > MAX_PROBLEMS_SHOWN:
        shown.append(f"and {len(errors) - MAX_PROBLEMS_SHOWN} more")
    return "; ".join(shown)


async def read_model(request: web.Request, model: type[M]) -> M:
    """Read, check and validate a JSON body (an empty one reads as ``{}``): 413 over the
    size limit, 400 for a body that is malformed, too deep, non-finite or fails ``model``
    (the validation errors named)."""
    limit = request.client_max_size
    _check_declared_size(request)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        _too_large(limit, f"over {limit}")
    except (RequestPayloadError, HttpProcessingError) as exc:
        _raise(web.HTTPBadRequest, "bad_request", "PayloadError", f"unreadable body: {exc}")
    problem = json_problem(raw)
    if problem is not None:
        _raise(web.HTTPBadRequest, "bad_request", "JSONError", problem)
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        _raise(web.HTTPBadRequest, "bad_request", "ValidationError", _validation_problems(exc))


def int_param(request: web.Request, name: str) -> int:
    text = request.match_info[name]
    value = int(text) if _DIGITS.fullmatch(text) else -1
    if not 0 <= value < 2**63:
        _raise(
            web.HTTPBadRequest,
            "bad_request",
            "ValueError",
            f"{name} must be an integer in [0, 2**63), got {text[:100]!r}",
        )
    return value


def count_param(request: web.Request, name: str, default: int, most: int) -> int:
    """The query parameter ``name`` as a count in [0, ``most``] (``default`` if absent)."""
    text = request.query.get(name)
    if text is None:
        return default
    if not _DIGITS.fullmatch(text) or int(text) > most:
        _raise(
            web.HTTPBadRequest,
            "bad_request",
            "ValueError",
            f"{name} {text[:100]!r} is not a count in [0, {most}]",
        )
    return int(text)


_DIGITS = re.compile(r"[0-9]{1,19}")


def site_url(runner: web.AppRunner, advertise_host: str) -> str:
    """``http://HOST:PORT`` of the first listening socket, with ``advertise_host`` as HOST."""
    for site in runner.sites:
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        for sock in sockets:
            port = sock.getsockname()[1]
            return f"http://{format_host(advertise_host)}:{port}"
    raise ServiceError("the HTTP server has no listening socket")


def format_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def write_ready_file(path: Path, payload: dict[str, object]) -> None:
    """Write ``payload`` as JSON atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".ready-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(payload, handle)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
