"""Every command's ``--help`` renders: help text is rich markup, so a literal ``[/X]`` in a
grammar string (``etcd://HOST:PORT[/PREFIX]``) crashes the page unless escaped."""

from __future__ import annotations

import pytest
import typer
from typer.core import TyperGroup
from typer.testing import CliRunner

from topkv.cli.main import _typer_app


def _command_paths(group: TyperGroup, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths: list[tuple[str, ...]] = []
    for name, command in sorted(group.commands.items()):
        path = (*prefix, name)
        paths.append(path)
        if isinstance(command, TyperGroup):
            paths.extend(_command_paths(command, path))
    return paths


_ROOT = typer.main.get_command(_typer_app)
assert isinstance(_ROOT, TyperGroup)
_PATHS = _command_paths(_ROOT)


def test_there_are_commands_to_check() -> None:
    assert ("orchestrator",) in _PATHS and ("worker",) in _PATHS and len(_PATHS) > 10


@pytest.mark.parametrize("path", _PATHS, ids=[" ".join(p) for p in _PATHS])
def test_help_renders(path: tuple[str, ...]) -> None:
    result = CliRunner().invoke(_typer_app, [*path, "--help"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "Usage" in result.output
