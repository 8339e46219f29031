"""The authentication flags the service commands share, and what they resolve to.

``--token-file FILE`` (default ``$TOPKV_TOKEN_FILE``): a client's or worker's own token; the
orchestrator's admin token. ``--client-token-file FILE`` (default
``$TOPKV_CLIENT_TOKEN_FILE``): the client tokens the front door accepts on its inference
endpoints (only the front door reads it). ``--insecure-no-auth`` turns authentication off,
on purpose (the server logs a warning); without it a server refuses to start unless it has
its tokens. See docs/security.md.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import typer

from topkv.errors import ConfigError
from topkv.service.http.auth import (
    CLIENT_TOKEN_FILE_ENV,
    CONTROL_TOKEN_FILE_ENV,
    TOKEN_FILE_ENV,
    Credentials,
    ServerAuth,
    read_token,
)

TOKEN_FILE_HELP = f"file holding the bearer token (default: ${TOKEN_FILE_ENV})"
INSECURE_HELP = "run without authentication (anyone who reaches the port can use it)"


def token_file_option(help_text: str = TOKEN_FILE_HELP) -> Path | None:
    return typer.Option(None, "--token-file", help=help_text)  # type: ignore[no-any-return]


def insecure_option() -> bool:
    return typer.Option(False, "--insecure-no-auth", help=INSECURE_HELP)  # type: ignore[no-any-return]


def _from_env(path: Path | None, env: str) -> Path | None:
    if path is not None:
        return path
    value = os.environ.get(env, "")
    return Path(value) if value else None


def client_token(token_file: Path | None) -> str | None:
    """The token a client sends (None: none given; an open server still answers)."""
    path = _from_env(token_file, TOKEN_FILE_ENV)
    return read_token(path) if path is not None else None


def orchestrator_auth(
    token_file: Path | None,
    worker_token_file: Path | None,
    *,
    insecure: bool,
    protect_metrics: bool,
) -> ServerAuth | None:
    """The orchestrator's: its admin token (accepted, and sent to workers) and the worker
    tokens it accepts; None with ``--insecure-no-auth``."""
    if insecure:
        return None
    path = _from_env(token_file, TOKEN_FILE_ENV)
    if path is None:
        raise ConfigError(
            f"the orchestrator needs its admin token: --token-file FILE or ${TOKEN_FILE_ENV} "
            "(`topkv token new FILE` makes one; `topkv cluster up` writes RUN_DIR/token), "
            "or --insecure-no-auth to run without authentication"
        )
    admin = read_token(path, "admin token file", scope="admin")
    credentials = Credentials.from_files(path, worker_token_file)
    return ServerAuth(credentials, client_token=admin, protect_metrics=protect_metrics)


def worker_auth(
    token_file: Path | None,
    control_token_file: Path | None,
    *,
    insecure: bool,
    needs_token: bool,
) -> ServerAuth | None:
    """A worker's: the token its control API accepts (the orchestrator's admin token or its
    ``sha256:`` digest) and its own worker token (to register over HTTP)."""
    if insecure:
        return None
    control = _from_env(control_token_file, CONTROL_TOKEN_FILE_ENV)
    if control is None:
        raise ConfigError(
            "the worker needs the token its control API accepts: --control-token-file FILE "
            f"or ${CONTROL_TOKEN_FILE_ENV} (the orchestrator's admin token, or its "
            "`sha256:` digest), or --insecure-no-auth"
        )
    own = _from_env(token_file, TOKEN_FILE_ENV)
    if own is None and needs_token:
        raise ConfigError(
            f"the worker registers with the orchestrator: give its worker token with "
            f"--token-file FILE or ${TOKEN_FILE_ENV}, or --insecure-no-auth"
        )
    token = read_token(own, "worker token file", scope="worker") if own is not None else None
    return ServerAuth(Credentials.from_files(control), client_token=token)


def front_door_auth(
    token_file: Path | None,
    worker_token_file: Path | None,
    client_token_file: Path | None,
    *,
    insecure: bool,
    protect_metrics: bool,
) -> ServerAuth | None:
    """The front door's (``topkv router``): the orchestrator's (:func:`orchestrator_auth`)
    plus the client tokens it accepts on its inference endpoints (``--client-token-file``
    or ``$TOPKV_CLIENT_TOKEN_FILE``; none: only the admin token calls them)."""
    auth = orchestrator_auth(
        token_file, worker_token_file, insecure=insecure, protect_metrics=protect_metrics
    )
    clients = _from_env(client_token_file, CLIENT_TOKEN_FILE_ENV)
    if auth is None or clients is None:
        return auth
    accepted = Credentials.from_files(None, client=clients).client
    return replace(auth, credentials=replace(auth.credentials, client=accepted))
