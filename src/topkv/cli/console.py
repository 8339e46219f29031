"""The rich console every command prints its tables to on stdout.

On a terminal it is rich's usual console (the terminal's width). When stdout is not a
terminal (``topkv sim ... > report.txt``, a pipe, a test runner), rich would assume 80
columns and shrink wide tables by wrapping and cutting cells (``pol…``). There the console
is :data:`PIPED_WIDTH` columns wide instead, so every table prints at its natural width,
cells whole. Tables and plain text are never padded to the console's width, so the output
is no wider than its content.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console

#: Columns of the console when stdout is not a terminal: wider than any table we print.
PIPED_WIDTH = 1_000_000


def stdout_console(**kwargs: Any) -> Console:
    """A console on stdout (``kwargs`` as for :class:`rich.console.Console`); when that is
    not a terminal, :data:`PIPED_WIDTH` columns wide whatever ``width`` or ``COLUMNS`` say."""
    console = Console(**kwargs)
    if console.is_terminal:
        return console
    return Console(**{**kwargs, "width": PIPED_WIDTH})
