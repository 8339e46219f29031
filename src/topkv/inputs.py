"""Reading the files a user hands to the CLI: bounded, strict, errors that name the file.

Every file-taking command (``plan --config``, ``discover``, ``select --topology``,
``sim --trace/--cluster/--config``, ``demo --trace``, ``sim-validate``) reads through here,
so a hostile file (empty, binary, not UTF-8, truncated, 1e400, a YAML alias bomb, one
8 MiB line) ends as one :class:`InputFileError` -- ``FILE: what is wrong`` or
``FILE:LINE: what is wrong`` -- never a traceback, a hang or unbounded memory:

* only regular files are read (a FIFO would block, a device never ends), at most
  ``limit`` bytes (:data:`MAX_DOCUMENT_BYTES` by default);
* text must be UTF-8 (a leading BOM is dropped) and hold no NUL byte; the error names the
  byte offset and the line;
* line-oriented readers (:func:`text_lines`) stream and refuse a line over
  :data:`MAX_LINE_BYTES`;
* JSON (:func:`parse_json`) refuses ``NaN``, ``Infinity`` and numbers that overflow to
  infinity (``1e400``), integers of more than :data:`MAX_INT_DIGITS` digits and nesting
  beyond the recursion limit, and names the line and column;
* YAML (:func:`parse_yaml`) is the safe loader without aliases (so nothing expands beyond
  the text: no "billion laughs"), with every float finite and every scalar that cannot be
  built (a date like ``2023-13-45``) reported at its line and column.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import yaml
import yaml.composer
import yaml.constructor
import yaml.nodes

from topkv.errors import ConfigError

MiB = 1 << 20
#: Largest JSON / YAML / tool-output file read whole (configs, topologies, demo records).
MAX_DOCUMENT_BYTES = 64 * MiB
#: Longest line a line-oriented reader accepts (traces, tool outputs).
MAX_LINE_BYTES = 1 * MiB
#: Deepest YAML nesting accepted (cluster files and kubectl output nest a few levels).
MAX_YAML_DEPTH = 64
#: Longest integer literal accepted in JSON or YAML (Python refuses 4300+ digits anyway).
MAX_INT_DIGITS = 100
_BOM = b"\xef\xbb\xbf"


class InputFileError(ConfigError):
    """A user-supplied file cannot be used; the message starts with its path (and line)."""

    def __init__(self, path: str | os.PathLike[str], reason: str, line: int | None = None) -> None:
        self.path = str(path)
        self.reason = reason
        self.line = line
        where = self.path if line is None else f"{self.path}:{line}"
        super().__init__(f"{where}: {reason}")


def excerpt(value: object, width: int = 40) -> str:
    """``repr(value)``, cut to about ``width`` characters (for error messages)."""
    if isinstance(value, str) and len(value) > width:
        return repr(value[:width]) + "..."
    text = repr(value)
    return text if len(text) <= width else text[:width] + "..."


# -- raw bytes and text ------------------------------------------------------------------------


def _size(n: int) -> str:
    return f"{n / MiB:g} MiB" if n >= MiB else f"{n:,} bytes"


def _regular(path: Path, what: str) -> None:
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        _os_error(path, what, exc)
    if stat.S_ISDIR(mode):
        raise InputFileError(path, f"is a directory, expected {what}")
    if not stat.S_ISREG(mode):
        raise InputFileError(path, f"not a regular file, expected {what}")


def _os_error(path: Path, what: str, exc: OSError) -> NoReturn:
    reason = "no such file" if isinstance(exc, FileNotFoundError) else exc.strerror or str(exc)
    thing = what.removeprefix("a ").removeprefix("an ").removeprefix("the ")
    raise InputFileError(path, f"cannot read {thing}: {reason}") from None


def read_bytes(path: Path, *, what: str = "the file", limit: int = MAX_DOCUMENT_BYTES) -> bytes:
    """The bytes of the regular file ``path``, refused beyond ``limit`` bytes."""
    _regular(path, what)
    chunks: list[bytes] = []
    total = 0
    try:
        with path.open("rb") as handle:
            while chunk := handle.read(min(MiB, limit + 1 - total)):
                chunks.append(chunk)
                total += len(chunk)
                if total > limit:
                    raise InputFileError(path, f"larger than {_size(limit)}, too large for {what}")
    except OSError as exc:
        _os_error(path, what, exc)
    return b"".join(chunks)


def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def decode_text(path: Path, data: bytes, *, first_line: int = 1, base: int = 0) -> str:
    """``data`` as UTF-8 text without NUL bytes; errors give the byte offset and line.

    ``base`` and ``first_line`` place ``data`` inside the file (for line-by-line reading).
    """
    nul = data.find(b"\x00")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if nul < 0 or exc.start < nul:
            line = first_line + _line_of(data, exc.start) - 1
            raise InputFileError(
                path,
                f"not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {base + exc.start} "
                "cannot be decoded (a binary file, or another encoding?)",
                line,
            ) from None
        text = ""
    if nul >= 0:
        line = first_line + _line_of(data, nul) - 1
        raise InputFileError(
            path, f"NUL byte at offset {base + nul}: a binary file, not text", line
        )
    return text


def read_text(path: Path, *, what: str = "a text file", limit: int = MAX_DOCUMENT_BYTES) -> str:
    """The whole of ``path`` as strict UTF-8 text; an empty (or blank) file is refused."""
    data = read_bytes(path, what=what, limit=limit)
    if data.startswith(_BOM):
        data = data[len(_BOM) :]
    text = decode_text(path, data)
    if not text.strip():
        raise InputFileError(path, f"the file is {'blank' if text else 'empty'}; expected {what}")
    return text


def text_lines(
    path: Path, *, what: str = "a text file", max_line: int = MAX_LINE_BYTES
) -> Iterator[str]:
    """Stream ``path`` line by line (line ends kept), each line strict UTF-8 without NUL.

    Refuses an empty file and a line longer than ``max_line`` bytes (naming the line).
    Open errors are raised on the first ``next()``.
    """
    _regular(path, what)
    try:
        handle = path.open("rb")
    except OSError as exc:
        _os_error(path, what, exc)
    with handle:
        offset, number = 0, 0
        while True:
            try:
                raw = handle.readline(max_line + 1)
            except OSError as exc:
                _os_error(path, what, exc)
            if not raw:
                if number == 0:
                    raise InputFileError(path, f"the file is empty; expected {what}")
                return
            number += 1
            if len(raw) > max_line:
                raise InputFileError(
                    path, f"line longer than {_size(max_line)}; expected {what}", number
                )
            if number == 1 and raw.startswith(_BOM):
                raw, offset = raw[len(_BOM) :], len(_BOM)
            yield decode_text(path, raw, first_line=number, base=offset)
            offset += len(raw)


# -- JSON --------------------------------------------------------------------------------------


class _Refused(Exception):
    def __init__(self, literal: str, reason: str) -> None:
        super().__init__(reason)
        self.literal = literal
        self.reason = reason


def _json_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _Refused(literal, f"number {literal[:24]} is not finite")
    return value


def _json_int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(literal, f"integer of {len(literal.lstrip('-')):,} digits is too large")
    return int(literal)


def _json_constant(literal: str) -> NoReturn:
    raise _Refused(literal, f"{literal} is not a JSON number (only finite numbers are allowed)")


def _position(text: str, literal: str) -> str:
    """`` at line L column C`` of the first bare (unquoted) ``literal`` in ``text``."""
    start = 0
    while (at := text.find(literal, start)) >= 0:
        end = at + len(literal)
        before = text[at - 1] if at else " "
        after = text[end] if end < len(text) else " "
        if not (before.isalnum() or before in '_."+-') and not (after.isalnum() or after in "_."):
            line, column = text.count("\n", 0, at) + 1, at - text.rfind("\n", 0, at)
            return f" at line {line} column {column}"
        start = at + 1
    return ""


def parse_json(text: str, path: str | os.PathLike[str], *, invalid: str = "invalid JSON") -> Any:
    """Strict JSON: finite numbers only, bounded integers and nesting; errors name the spot
    (after ``invalid``)."""
    try:
        return json.loads(
            text, parse_float=_json_float, parse_int=_json_int, parse_constant=_json_constant
        )
    except json.JSONDecodeError as exc:
        raise InputFileError(
            path, f"{invalid} at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except _Refused as exc:
        raise InputFileError(
            path, f"{invalid}{_position(text, exc.literal)}: {exc.reason}"
        ) from None
    except RecursionError:
        raise InputFileError(path, f"{invalid}: nested too deeply") from None


def load_json(
    path: Path,
    *,
    what: str = "a JSON file",
    limit: int = MAX_DOCUMENT_BYTES,
    invalid: str = "invalid JSON",
) -> Any:
    """:func:`read_text` then :func:`parse_json`."""
    return parse_json(read_text(path, what=what, limit=limit), path, invalid=invalid)


# -- YAML --------------------------------------------------------------------------------------


class _BoundedComposer:
    """Composer mixin: an alias (``*name``) or nesting beyond :data:`MAX_YAML_DEPTH` is a
    YAML error, so what is built never outgrows the text (no "billion laughs")."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        loader: Any = self
        if loader.check_event(yaml.AliasEvent):
            event = loader.peek_event()
            raise yaml.composer.ComposerError(
                None,
                None,
                f"YAML aliases (*{event.anchor}) are not supported; write the value out",
                event.start_mark,
            )
        if self._depth >= MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(
                None,
                None,
                f"nested deeper than {MAX_YAML_DEPTH} levels",
                loader.peek_event().start_mark,
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)  # type: ignore[misc]
        finally:
            self._depth -= 1


class NoAliasSafeLoader(_BoundedComposer, yaml.SafeLoader):
    """:class:`yaml.SafeLoader` that refuses aliases, deep nesting and non-finite floats, and
    turns a scalar that cannot be built (``2023-13-45``, a 5000-digit integer) into a YAML
    error."""

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.ScalarNode) and len(str(node.value)) > MAX_INT_DIGITS:
            tag = str(node.tag)
            if tag.endswith((":int", ":float")):
                raise yaml.constructor.ConstructorError(
                    None, None, "number literal is too long", node.start_mark
                )
        try:
            value = super().construct_object(node, deep=deep)
        except (ValueError, OverflowError, TypeError) as exc:
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read {excerpt(str(node.value))}: {exc}", node.start_mark
            ) from None
        if isinstance(value, float) and not math.isfinite(value):
            raise yaml.constructor.ConstructorError(
                None, None, f"number {excerpt(str(node.value))} is not finite", node.start_mark
            )
        return value


class NoAliasBaseLoader(_BoundedComposer, yaml.BaseLoader):
    """:class:`yaml.BaseLoader` (every scalar a string) that refuses aliases and deep nesting."""


def _yaml_reason(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "invalid YAML"
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        return f"invalid YAML{where}: {problem}"
    return "invalid YAML: " + " ".join(str(exc).split())


def parse_yaml(text: str, path: Path) -> Any:
    """One YAML document through :class:`NoAliasSafeLoader`; errors name the line/column."""
    try:
        return yaml.load(text, Loader=NoAliasSafeLoader)
    except yaml.YAMLError as exc:
        raise InputFileError(path, _yaml_reason(exc)) from None
    except RecursionError:
        raise InputFileError(path, "invalid YAML: nested too deeply") from None


def load_yaml(path: Path, *, what: str = "a YAML file", limit: int = MAX_DOCUMENT_BYTES) -> Any:
    """:func:`read_text` then :func:`parse_yaml`."""
    return parse_yaml(read_text(path, what=what, limit=limit), path)
