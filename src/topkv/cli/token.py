"""``topkv token new FILE [--scope admin|worker|client]``: make a bearer token file (mode
0600) for the control plane; ``topkv token digest FILE``: its ``sha256:`` digest."""

from __future__ import annotations

import enum
from pathlib import Path

import typer

from topkv.errors import ConfigError
from topkv.service.http.auth import digest_line, new_token, read_token, write_token_file


class TokenScope(enum.StrEnum):
    """``--scope``: what the token is for (docs/security.md, "Tokens and scopes")."""

    admin = "admin"
    worker = "worker"
    client = "client"


def new_command(
    path: Path = typer.Argument(..., help="where to write the token (mode 0600)"),
    force: bool = typer.Option(False, "--force", help="replace an existing file"),
    scope: TokenScope | None = typer.Option(
        None,
        "--scope",
        help="tag the token with its scope (tkv_<scope>_...), so a server refuses it in "
        "another scope's file; client: the front door's inference endpoints only "
        "(topkv router --client-token-file). Default: untagged, as before",
    ),
) -> None:
    """Write a fresh random token; print its sha256: digest (what a verifier needs)."""
    if path.exists() and not force:
        raise ConfigError(f"{path} exists; pass --force to replace it")
    token = new_token(scope.value if scope is not None else None)
    write_token_file(path, token)
    typer.echo(digest_line(token))


def digest_command(
    path: Path = typer.Argument(..., help="a token file"),
) -> None:
    """Print the sha256: digest of the token in a file (for a worker's --control-token-file)."""
    typer.echo(digest_line(read_token(path)))


def register(app: typer.Typer) -> None:
    token = typer.Typer(help="Bearer tokens for the control plane.", no_args_is_help=True)
    token.command("new")(new_command)
    token.command("digest")(digest_command)
    app.add_typer(token, name="token")
