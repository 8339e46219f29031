"""Shared by the hostile-input tests (``test_api_hostile.py``, ``test_worker_api_fuzz.py``):
a server's event loop on a thread of its own, a blocking HTTP client that sends any method,
header and byte, the JSON error check, and hypothesis strategies for nearly valid bodies."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from topkv.service.http.util import MAX_JSON_DEPTH

T = TypeVar("T")


def fuzz_settings(examples: int) -> settings:
    """The hostile fuzzes' hypothesis settings: ``examples`` requests, the same ones every
    run (derandomized, no example database), no deadline on a loaded host."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


# -- a server on a loop of its own, and a client that sends anything --------------------------


class BackgroundLoop:
    """An event loop running in a daemon thread; :meth:`run` waits for a coroutine on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        async def cancel_the_rest() -> None:  # e.g. connections still lingering on a body
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(cancel_the_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def send(
    port: int,
    method: str,
    path: str,
    headers: list[tuple[str, bytes]] = (),  # type: ignore[assignment]
    body: bytes = b"",
    *,
    chunked: bool = False,
    content_length: int | None = None,
    timeout: float = 15.0,
) -> Answer:
    """One request on a fresh connection, exactly as given: ``content_length`` None sends the
    body's true length (none for an empty body), ``chunked`` frames it as chunks instead."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in headers:
            conn.putheader(name, value)
        if chunked:
            conn.putheader("Transfer-Encoding", "chunked")
        elif content_length is not None:
            conn.putheader("Content-Length", str(content_length))
        elif body:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders()
        try:
            if chunked:
                for start in range(0, len(body), 64 * 1024):
                    piece = body[start : start + 64 * 1024]
                    conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
                conn.send(b"0\r\n\r\n")
            elif body:
                conn.send(body)
        except OSError:
            pass  # the server answered (and closed) before taking it all: read the answer
        response = conn.getresponse()
        return Answer(response.status, dict(response.headers), response.read())
    finally:
        conn.close()


def bearer(token: str) -> list[tuple[str, bytes]]:
    return [("Authorization", f"Bearer {token}".encode()), ("Content-Type", b"application/json")]


def assert_json_error(answer: Answer) -> dict[str, str]:
    """A 4xx whose body is ``{"error": {"kind", "type", "detail"}}``."""
    assert 400 <= answer.status < 500, answer
    assert answer.headers.get("Content-Type", "").startswith("application/json"), answer
    error = answer.json()["error"]
    assert set(error) == {"kind", "type", "detail"} and all(
        isinstance(v, str) for v in error.values()
    ), error
    assert "Traceback" not in error["detail"]
    return error  # type: ignore[no-any-return]


JUNK: tuple[Any, ...] = (
    None, True, -1, 0, 2**63, 10**30, -(10**30), 1e308, -0.0, 0.5, "", "x" * 300, "\u0000",
    "\U0001f600", [], [1, "a"], {}, {"a": {"b": []}},
)  # fmt: skip
json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path in a JSON object (dicts only)."""
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, inner in value.items():
            out.extend(_paths(inner, (*prefix, key)))
    return out


def _set(value: dict[str, Any], path: tuple[Any, ...], new: Any) -> None:
    for key in path[:-1]:
        value = value[key]
    value[path[-1]] = new


@st.composite
def nearly_valid(draw: st.DrawFn, body: dict[str, Any]) -> bytes:
    """``body`` broken one way (or not at all), serialised."""
    how = draw(
        st.sampled_from(
            ("as is",) * 3 + ("wrong type", "extra field", "huge number", "deep", "drop", "text")
        )
    )
    paths = _paths(body)
    if how == "wrong type" and paths:
        _set(body, draw(st.sampled_from(paths)), draw(st.sampled_from(JUNK) | json_value))
    elif how == "extra field":
        target = draw(st.sampled_from([(), *[p for p in paths if isinstance(_get(body, p), dict)]]))
        holder = _get(body, target) if target else body
        holder[draw(st.sampled_from(("evil", "admin", "Worker_ID", "")))] = draw(json_value)
    elif how == "huge number" and paths:
        huge = draw(st.sampled_from((10**19, 2**63, -(2**63) - 1, 10**400, 1e308, -1e308, -1)))
        _set(body, draw(st.sampled_from(paths)), huge)
    elif how == "deep" and paths:
        depth = draw(st.sampled_from((MAX_JSON_DEPTH - 2, MAX_JSON_DEPTH + 1, 200, 5000)))
        _set(body, draw(st.sampled_from(paths)), _DEEP)
    elif how == "drop" and paths:
        path = draw(st.sampled_from(paths))
        holder = _get(body, path[:-1]) if len(path) > 1 else body
        holder.pop(path[-1], None)
    text = json.dumps(body)
    if how == "deep":
        text = text.replace(json.dumps(_DEEP), _nest(depth), 1)
    if how == "text":
        token = draw(st.sampled_from(("NaN", "Infinity", "-Infinity", "1e999", "9" * 400, "")))
        text = text.replace("1", token, 1) if "1" in text else text + token
    return text.encode()


def _get(value: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        value = value[key]
    return value


_DEEP = "<deeply nested>"


def _nest(depth: int) -> str:
    """JSON text nested ``depth`` levels (lists and objects in turn), written directly."""
    opening = "".join("[" if level % 2 else '{"a": ' for level in range(depth))
    closing = "".join("]" if level % 2 else "}" for level in reversed(range(depth)))
    return opening + "1" + closing


def ascii_only(value: bytes) -> bytes:
    return header_safe(bytes(b for b in value if 32 <= b < 127))


def header_safe(value: bytes) -> bytes:
    """A header value http.client sends (no CR, LF or NUL; no leading/trailing space)."""
    return bytes(b for b in value if b not in b"\r\n\x00").strip() or b"x"
