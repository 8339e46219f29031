"""The ``topkv`` console script.

Each command lives in its own module under ``topkv.cli`` and exposes
``register(app: typer.Typer) -> None``. Add a module name to ``COMMAND_MODULES`` to
register a new command. Errors derived from :class:`topkv.errors.TopKVError` are printed
as one line on stderr with exit status 2, never as a traceback.
"""

from __future__ import annotations

import importlib
import sys

import typer

from topkv.errors import TopKVError

COMMAND_MODULES: list[str] = [
    # one entry per module in topkv.cli, e.g. "plan"
    "plan",
    "discover",
    "select",
    "sim",
    "bench",
    "chaos",
    "services",
    "demo",
    "sim_validate",
    "token",
    "label_node",
    "router",
]

_typer_app = typer.Typer(
    name="topkv",
    help="Topology-aware KV-cache transfer for disaggregated LLM inference.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@_typer_app.callback()
def _root() -> None:
    """Topology-aware KV-cache transfer for disaggregated LLM inference."""


for _name in COMMAND_MODULES:
    importlib.import_module(f"topkv.cli.{_name}").register(_typer_app)


def app() -> None:
    """Entry point: run the Typer app, turning TopKVError into one clear line."""
    try:
        _typer_app(standalone_mode=True)
    except TopKVError as exc:
        print(f"topkv: error: {one_line(str(exc))}", file=sys.stderr)
        raise SystemExit(2) from None


def one_line(message: str) -> str:
    """``message`` on one line (a parser's multi-line message joined with "; ")."""
    return "; ".join(part.strip() for part in message.splitlines() if part.strip())
