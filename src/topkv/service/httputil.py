"""Small aiohttp helpers shared by the orchestrator's and the workers' HTTP APIs."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from pydantic import BaseModel, ValidationError

from topkv.errors import TopKVError
from topkv.service.errors import ServiceError
from topkv.service.messages import ErrorBody, ErrorResponse

M = TypeVar("M", bound=BaseModel)

#: An error type (or types), the HTTP status and the failure kind it is answered with.
ErrorAnswer = tuple[type[TopKVError] | tuple[type[TopKVError], ...], int, str]
#: Answers that depend on the error itself: (status, kind), or None to use the table.
ErrorSpecial = Callable[[TopKVError], tuple[int, str] | None]


def error_middleware(answers: Sequence[ErrorAnswer], special: ErrorSpecial) -> Middleware:
    """A middleware that answers a TopKV error as JSON (:func:`error_response`) with the
    status and kind of ``special`` or of its first entry in ``answers``; nothing leaks a
    traceback. An error neither knows is raised on."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except TopKVError as exc:
            found = special(exc)
            if found is None:
                found = next((a[1:] for a in answers if isinstance(exc, a[0])), None)
            if found is None:
                raise
            status, kind = found
            return error_response(status, kind, str(exc), type(exc).__name__)

    return middleware


def error_response(status: int, kind: str, detail: str, type_: str = "") -> web.Response:
    """A JSON error answer: ``{"error": {"kind", "type", "detail"}}``."""
    body = ErrorResponse(error=ErrorBody(kind=kind, type=type_ or kind, detail=detail))
    return web.json_response(body.model_dump(), status=status)


def model_response(model: BaseModel, status: int = 200) -> web.Response:
    return web.Response(
        body=model.model_dump_json(), status=status, content_type="application/json"
    )


async def read_model(request: web.Request, model: type[M]) -> M:
    """Parse and validate a JSON body; bad input becomes a 400 with the validation errors."""
    try:
        raw = await request.read()
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
        )
        raise web.HTTPBadRequest(
            text=json.dumps(
                {"error": {"kind": "bad_request", "type": "ValidationError", "detail": problems}}
            ),
            content_type="application/json",
        ) from None


def int_param(request: web.Request, name: str) -> int:
    text = request.match_info[name]
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**63:
        raise web.HTTPBadRequest(
            text=json.dumps(
                {
                    "error": {
                        "kind": "bad_request",
                        "type": "ValueError",
                        "detail": f"{name} must be an integer in [0, 2**63), got {text!r}",
                    }
                }
            ),
            content_type="application/json",
        )
    return value


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
