"""Bearer-token authentication and scopes for every control endpoint.

Three scopes:

* ``admin``: submit and cancel requests, read everything, deregister any worker, and drive
  the workers' control APIs (the orchestrator's executor holds an admin token);
* ``worker``: register, heartbeat and deregister *its own* worker id only (the id a worker
  token first registered is bound to it while registered: see
  :class:`~topkv.service.orchestrator.registrations.Registrations`);
* ``client``: the OpenAI front door's inference endpoints only (:attr:`Access.INFERENCE`).
  Only the front door loads client tokens; the orchestrator and the workers never do.

A token may carry its scope in its prefix (``tkv_client_...``, :func:`new_token`): a server
refuses a tagged token found among another scope's tokens (a misfiled file) at start-up.

A server keeps only the SHA-256 digests of the tokens it accepts (:class:`Credentials`), so a
worker can verify the orchestrator's admin token without holding it (``sha256:<hex>`` in its
control-token file). Tokens are compared digest against digest with
:func:`hmac.compare_digest`, over every accepted digest (no early exit), and are never
logged: errors name the file, never its content.

``/healthz`` and ``/readyz`` are always open (probes); ``/metrics`` is open unless the server
protects it. Turning authentication off takes an explicit ``--insecure-no-auth``
(:data:`INSECURE`), and the server logs a warning.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import os
import secrets
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from topkv.errors import ConfigError

log = logging.getLogger(__name__)

Scope = Literal["admin", "worker", "client"]
SCOPES: tuple[Scope, ...] = ("admin", "worker", "client")

#: Where commands look for their token file when no ``--token-file`` is given.
TOKEN_FILE_ENV = "TOPKV_TOKEN_FILE"
#: Where a worker looks for the token its control API accepts (the admin token or its digest).
CONTROL_TOKEN_FILE_ENV = "TOPKV_CONTROL_TOKEN_FILE"
#: Where the front door looks for the client tokens it accepts (``--client-token-file``).
CLIENT_TOKEN_FILE_ENV = "TOPKV_CLIENT_TOKEN_FILE"
#: A digest line in a token file: the token itself is not needed to verify it.
DIGEST_PREFIX = "sha256:"
#: Longest token file read (a few tokens, one per line).
MAX_TOKEN_FILE_BYTES = 64 * 1024

_TOKEN_PREFIX = "tkv_"


#: Where each scope's tokens are given to a server (named when a token is misfiled).
_GIVEN_WITH: dict[Scope, str] = {
    "admin": "--token-file",
    "worker": "--worker-token-file",
    "client": "--client-token-file (topkv router)",
}


def new_token(scope: Scope | None = None) -> str:
    """A fresh random bearer token (256 bits); with ``scope``, tagged ``tkv_<scope>_...`` so
    that a server refuses it among another scope's tokens (untagged: any file takes it)."""
    tag = f"{scope}_" if scope is not None else ""
    return _TOKEN_PREFIX + tag + secrets.token_urlsafe(32)


def tagged_scope(token: str) -> Scope | None:
    """The scope a token's prefix names (``tkv_client_...``: client); None when untagged."""
    for scope in SCOPES:
        if token.startswith(f"{_TOKEN_PREFIX}{scope}_"):
            return scope
    return None


def check_scope(token: str, scope: Scope, origin: str) -> None:
    """ConfigError when ``token`` is tagged with a scope other than ``scope`` (``origin``
    names where it was found; the message never holds the token)."""
    tagged = tagged_scope(token)
    if tagged is not None and tagged != scope:
        raise ConfigError(
            f"{origin} holds a {tagged} token ({_TOKEN_PREFIX}{tagged}_...) where {scope} "
            f"tokens belong; a {tagged} token is given with {_GIVEN_WITH[tagged]}"
        )


def digest_of(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def digest_line(token: str) -> str:
    """``sha256:<hex>``: what a verifier needs, not the token."""
    return DIGEST_PREFIX + digest_of(token).hex()


def write_token_file(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` with mode 0600 from the start (never world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as out:
        out.write(text.rstrip("\n") + "\n")
    os.chmod(path, 0o600)  # an existing file keeps its old mode through O_TRUNC
    return path


def read_token_lines(path: Path, what: str = "token file") -> list[str]:
    """The non-empty lines of a token file (tokens or ``sha256:`` digests)."""
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{what} {path} is not a regular file")
        if info.st_size > MAX_TOKEN_FILE_BYTES:
            raise ConfigError(f"{what} {path} is {info.st_size} bytes; tokens are short")
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s %s is readable by other users; chmod 600 it", what, path)
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path} holds non-ASCII bytes; it is not a token file") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for number, line in enumerate(lines, 1):
        if any(c.isspace() for c in line) or len(line) > 512:
            raise ConfigError(f"{what} {path}: line {number} is not a token")
    if not lines:
        raise ConfigError(f"{what} {path} is empty")
    return lines


def read_token(path: Path, what: str = "token file", scope: Scope | None = None) -> str:
    """The one token in a token file (a client's credential); with ``scope``, refused when
    it is tagged with another scope (:func:`check_scope`)."""
    lines = read_token_lines(path, what)
    if len(lines) != 1 or lines[0].startswith(DIGEST_PREFIX):
        raise ConfigError(f"{what} {path} must hold exactly one token")
    if scope is not None:
        check_scope(lines[0], scope, f"{what} {path}")
    return lines[0]


def _digests(lines: Iterable[str], origin: str, scope: Scope) -> tuple[bytes, ...]:
    """The digests of ``scope``'s accepted tokens (tokens or ``sha256:`` lines)."""
    out: list[bytes] = []
    for number, line in enumerate(lines, 1):
        if line.startswith(DIGEST_PREFIX):
            try:
                digest = bytes.fromhex(line[len(DIGEST_PREFIX) :])
            except ValueError:
                digest = b""
            if len(digest) != 32:
                raise ConfigError(f"{origin}: a sha256: line needs 64 hex digits")
            out.append(digest)
        else:
            check_scope(line, scope, f"{origin}: line {number}")
            out.append(digest_of(line))
    return tuple(out)


def _file_digests(path: Path | None, scope: Scope) -> tuple[bytes, ...]:
    if path is None:
        return ()
    what = f"{scope} token file"
    return _digests(read_token_lines(path, what), f"{what} {path}", scope)


@dataclass(frozen=True)
class Credentials:
    """The tokens a server accepts, per scope, as SHA-256 digests (``client``: only the
    front door's; the orchestrator and the workers never hold any)."""

    admin: tuple[bytes, ...] = ()
    worker: tuple[bytes, ...] = ()
    client: tuple[bytes, ...] = ()

    @classmethod
    def of(
        cls, admin: Iterable[str] = (), worker: Iterable[str] = (), client: Iterable[str] = ()
    ) -> Credentials:
        """From tokens or ``sha256:`` digest lines."""
        return cls(
            _digests(admin, "admin tokens", "admin"),
            _digests(worker, "worker tokens", "worker"),
            _digests(client, "client tokens", "client"),
        )

    @classmethod
    def from_files(
        cls, admin: Path | None, worker: Path | None = None, client: Path | None = None
    ) -> Credentials:
        return cls(
            _file_digests(admin, "admin"),
            _file_digests(worker, "worker"),
            _file_digests(client, "client"),
        )

    def authenticate(self, token: str) -> Principal | None:
        """The principal ``token`` stands for, or None (constant time in the token)."""
        presented = digest_of(token)
        scope: Scope | None = None
        for candidate in self.admin:
            if hmac.compare_digest(presented, candidate):
                scope = "admin"
        for candidate in self.worker:
            if hmac.compare_digest(presented, candidate) and scope is None:
                scope = "worker"
        for candidate in self.client:
            if hmac.compare_digest(presented, candidate) and scope is None:
                scope = "client"
        return Principal(scope, presented) if scope is not None else None


@dataclass(frozen=True)
class Principal:
    """Who made a request: its scope and its token's digest (its identity for ownership)."""

    scope: Scope
    token_digest: bytes

    @property
    def admin(self) -> bool:
        return self.scope == "admin"


#: The request key holding the authenticated :class:`Principal`.
PRINCIPAL_KEY = web.RequestKey("topkv.principal", Principal)


class Access(enum.Enum):
    """What an endpoint requires."""

    PUBLIC = "public"  # probes and the schema
    METRICS = "metrics"  # open unless the server protects /metrics
    WORKER = "worker"  # a worker token (for its own id: the handler checks) or admin
    INFERENCE = "inference"  # the front door's OpenAI endpoints: a client token or admin
    ADMIN = "admin"


#: The scopes each authenticated :class:`Access` admits, and how a 403 names them.
_ADMITS: dict[Access, tuple[frozenset[Scope], str]] = {
    Access.ADMIN: (frozenset({"admin"}), "an admin token"),
    Access.METRICS: (frozenset({"admin"}), "an admin token"),
    Access.WORKER: (frozenset({"worker", "admin"}), "a worker or admin token"),
    Access.INFERENCE: (frozenset({"client", "admin"}), "a client or admin token"),
}
#: What a 403 adds for a client token: the only endpoints it may call.
_CLIENT_RULE = (
    " (a client token may call only the inference endpoints: POST /v1/completions, "
    "POST /v1/chat/completions, GET /v1/models)"
)


class Required:
    """Marks a setting every caller must choose explicitly (no silent insecure default)."""


REQUIRED = Required()


def chosen_auth(auth: ServerAuth | Required | None, needs: str) -> ServerAuth | None:
    """``auth`` once its caller chose it; ConfigError while it is still :data:`REQUIRED`
    (``needs``: what the component needs, e.g. ``"a worker needs auth=ServerAuth(...)"``)."""
    if isinstance(auth, Required):
        raise ConfigError(f"{needs}, or auth=None to run without authentication on purpose")
    return auth


#: Authentication switched off on purpose (``--insecure-no-auth``).
INSECURE: Credentials | None = None

RouteAccess = Mapping[tuple[str, str], Access]


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    access: Access


def add_routes(app: web.Application, routes: Iterable[Route]) -> dict[tuple[str, str], Access]:
    """Add ``routes`` to ``app``; the access table the auth middleware reads."""
    table: dict[tuple[str, str], Access] = {}
    for route in routes:
        app.router.add_route(
            route.method, route.path, route.handler, expect_handler=_expect_continue
        )
        table[(route.method, route.path)] = route.access
        if route.method == "GET":
            table[("HEAD", route.path)] = route.access
    return table


async def _expect_continue(request: web.Request) -> None:
    """Answer ``Expect: 100-continue``; refuse any other expectation with a JSON 417 (the
    default handler echoes the value and fails on one that is not UTF-8)."""
    expect = request.headers.get("Expect", "")
    if expect.lower() == "100-continue" and request.version >= (1, 1):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return
    body = '{"error": {"kind": "bad_request", "type": "ExpectationFailed", "detail": '
    body += '"only Expect: 100-continue is understood"}}'
    raise web.HTTPExpectationFailed(text=body, content_type="application/json")


def _unauthorized(detail: str) -> web.Response:
    from topkv.service.http.util import error_response

    answer = error_response(401, "unauthorized", detail, "Unauthorized")
    answer.headers["WWW-Authenticate"] = 'Bearer realm="topkv"'
    return answer


def forbidden(detail: str) -> web.Response:
    from topkv.service.http.util import error_response

    return error_response(403, "forbidden", detail, "Forbidden")


def bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or not token.isascii():
        return None  # tokens are ASCII: anything else cannot be one (401)
    return token


def auth_middleware(
    credentials: Credentials | None,
    table: Callable[[], RouteAccess],
    *,
    protect_metrics: bool = False,
) -> Middleware:
    """Check every request against the route's :class:`Access` (``credentials`` None: off)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if credentials is None:
            return await handler(request)
        resource = request.match_info.route.resource
        path = resource.canonical if resource is not None else ""
        access = table().get((request.method, path), Access.ADMIN)
        if access is Access.PUBLIC or (access is Access.METRICS and not protect_metrics):
            return await handler(request)
        token = bearer(request)
        if token is None:
            return _unauthorized("send 'Authorization: Bearer <token>' (see docs/security.md)")
        principal = credentials.authenticate(token)
        if principal is None:
            return _unauthorized("the token is not valid here")
        admitted, needs = _ADMITS[access]
        if principal.scope not in admitted:
            rule = _CLIENT_RULE if principal.scope == "client" else ""
            return forbidden(f"{request.method} {path} needs {needs}{rule}")
        request[PRINCIPAL_KEY] = principal
        return await handler(request)

    return middleware


def principal_of(request: web.Request) -> Principal | None:
    """The request's authenticated principal (None when authentication is off)."""
    return request.get(PRINCIPAL_KEY)


def auth_headers(token: str | None) -> dict[str, str]:
    """The header a client sends with ``token`` (none without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def warn_insecure(what: str) -> None:
    log.warning(
        "%s: authentication is OFF (--insecure-no-auth): anyone who reaches its port can "
        "use every endpoint",
        what,
    )


@dataclass(frozen=True)
class ServerAuth:
    """A server's authentication: the tokens it accepts, the token it presents to the
    servers it calls itself (the orchestrator to workers: admin; a worker to the
    orchestrator: its worker token), and whether ``/metrics`` needs an admin token."""

    credentials: Credentials
    client_token: str | None = None
    protect_metrics: bool = False


def secured_app(
    routes: Iterable[Route],
    auth: ServerAuth | None,
    *,
    middlewares: Iterable[Middleware] = (),
    client_max_size: int = 1024**2,
) -> web.Application:
    """An app serving ``routes`` behind the auth middleware (``auth`` None: open, on purpose)."""
    table: dict[tuple[str, str], Access] = {}
    credentials = auth.credentials if auth is not None else INSECURE
    protect = auth.protect_metrics if auth is not None else False
    app = web.Application(
        middlewares=[
            auth_middleware(credentials, lambda: table, protect_metrics=protect),
            *middlewares,
        ],
        client_max_size=client_max_size,
    )
    table.update(add_routes(app, routes))
    return app
