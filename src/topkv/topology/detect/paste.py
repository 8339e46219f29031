"""Undo the wrapping people add when they paste tool output into issues, scripts and docs.

Tool output is often quoted as a Markdown block quote (every line starts with ``>``), kept
as a shell comment in a job script (every line starts with ``#``), or exported from a
wiki with HTML paragraph tags around it. :func:`strip_paste_wrapping` removes those marks
so the parsers see the tool's own text. A marker is only stripped when most non-blank
lines carry it, so a lone ``# comment`` or a quoted prompt does not change anything else.
"""

from __future__ import annotations

import re

_HTML_TAG_RE = re.compile(r"</?(?:p|br|pre|code)\s*/?>", re.I)
_MARKERS = (">", "#")
_MAJORITY = 0.6


def strip_paste_wrapping(lines: list[str]) -> list[str]:
    """Lines with block-quote/comment markers and HTML paragraph tags removed."""
    lines = [_HTML_TAG_RE.sub("", line) for line in lines]
    content = [line for line in lines if line.strip()]
    if not content:
        return lines
    for marker in _MARKERS:
        marked = sum(1 for line in content if line.lstrip().startswith(marker))
        if marked / len(content) >= _MAJORITY:
            pattern = re.compile(r"^\s*" + re.escape(marker) + r"+ ?")
            return [pattern.sub("", line, count=1) for line in lines]
    return lines
