"""Hostile input to the orchestrator's API: bodies over the limit get 413 unread (declared,
chunked or compressed), deep nesting, NaN, unknown fields and out-of-range numbers get 400, a
flood of registrations from one worker token gets 429 and a token holding too many worker
ids 409, and 1,000 random requests (methods, paths, headers, bodies, tokens) never get a 5xx
nor change the registry unless a token allowed to change it sent them.

The orchestrator runs in-process on an event loop of its own thread, so each hypothesis
example is a plain blocking HTTP exchange (:mod:`http.client`, which sends any method, header
and byte we choose) against one server reused for every example (see ``hostile_http.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gzip
import json
import socket
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hostile_http import (
    Answer,
    BackgroundLoop,
    ascii_only,
    assert_json_error,
    bearer,
    header_safe,
    json_value,
    nearly_valid,
    send,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from topkv.relay.registry.memory import MemoryRegistry
from topkv.service.cluster.tokens import ClusterTokens
from topkv.service.http.auth import Credentials, Principal, new_token
from topkv.service.http.util import MAX_BODY_BYTES, MAX_JSON_DEPTH, json_problem
from topkv.service.orchestrator.api import OrchestratorServiceConfig, serve_orchestrator
from topkv.service.orchestrator.registrations import RegistrationLimits, Registrations


@dataclass
class Live:
    port: int
    tokens: ClusterTokens
    workers: tuple[str, str]  # two worker tokens

    def workers_listing(self) -> dict[str, Any]:
        answer = send(self.port, "GET", "/v1/workers", bearer(self.tokens.admin))
        assert answer.status == 200, answer
        return {w["worker"]["worker_id"]: w["worker"] for w in answer.json()["workers"]}


#: Small limits in the fuzz so that it reaches 429 and 409 too.
FUZZ_LIMITS = RegistrationLimits(rate_per_s=2.0, burst=6, max_ids=3)


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    tokens = ClusterTokens()
    names = ("worker-a", "worker-b")
    config = OrchestratorServiceConfig(
        auth=tokens.orchestrator_auth(names), registration_limits=FUZZ_LIMITS
    )
    background = BackgroundLoop()

    async def start() -> tuple[str, asyncio.Event, asyncio.Task[None]]:
        stop = asyncio.Event()
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(serve_orchestrator(config, "127.0.0.1", 0, stop, ready))
        return await asyncio.wait_for(ready, 30), stop, task

    async def finish(stop: asyncio.Event, task: asyncio.Task[None]) -> None:
        stop.set()
        await task

    url, stop, task = background.run(start())
    try:
        port = urllib.parse.urlsplit(url).port
        assert port is not None
        yield Live(port, tokens, (tokens.worker_token(names[0]), tokens.worker_token(names[1])))
    finally:
        background.run(finish(stop, task))
        background.close()


def _worker(worker_id: str, **extra: Any) -> dict[str, Any]:
    return {"worker": {"worker_id": worker_id, "role": "decode", "node": "n0", **extra}}


_LAYOUT = {"num_layers": 2, "seq_len": 8, "kv_heads": 1, "head_dim": 8}


# -- the size limit --------------------------------------------------------------------------


def test_bodies_over_the_limit_get_413_declared_chunked_or_compressed(live: Live) -> None:
    headers = bearer(live.tokens.admin)
    big = b'{"model": "' + b"m" * MAX_BODY_BYTES + b'"}'
    for path in ("/v1/requests", "/v1/workers"):
        # an honest Content-Length: refused from the header alone
        assert_json_error(send(live.port, "POST", path, headers, big))
        # chunked (no Content-Length): refused once the limit is crossed
        error = assert_json_error(send(live.port, "POST", path, headers, big, chunked=True))
        assert error["kind"] == "too_large"
    # a Content-Length that claims more than the limit gets 413 at once, even though the
    # body never comes (the server does not wait for it)
    started = time.monotonic()
    answer = send(live.port, "POST", "/v1/requests", headers, b"{}", content_length=50 << 20)
    assert answer.status == 413 and time.monotonic() - started < 5
    # a gzip bomb: 10 MiB of zeros in 10 KiB; refused after at most ~the limit is inflated
    bomb = gzip.compress(b"0" * (10 << 20))
    assert len(bomb) < 64 * 1024
    gz = [*headers, ("Content-Encoding", b"gzip")]
    assert send(live.port, "POST", "/v1/requests", gz, bomb).status == 413
    # a Content-Length that says less: only that much is read as the body, a short invalid
    # one (400); what follows is no body but a malformed next request, and the server drops
    # the connection (its reset may even beat the 400 to the client): never a 2xx or a 5xx
    tail = b'{"model": "m", "layout": {}}' + b"x" * 4096
    try:
        answer = send(live.port, "POST", "/v1/workers", headers, tail, content_length=10)
    except ConnectionResetError:
        pass
    else:
        assert answer.status == 400
    # endpoints that take no body refuse a declared large one too, before anything runs
    assert send(live.port, "GET", "/v1/workers", headers, big).status == 413
    # a body just under the limit is read and judged on its content (400 here)
    near = b'{"model": "' + b"m" * (MAX_BODY_BYTES - 100) + b'"}'
    assert assert_json_error(send(live.port, "POST", "/v1/requests", headers, near))["kind"] == (
        "bad_request"
    )
    # unauthenticated: 401 before any of it is read
    assert send(live.port, "POST", "/v1/requests", [], big, chunked=True).status == 401


def test_a_chunked_flood_is_cut_off_without_reading_it_all(live: Live) -> None:
    """A chunked body far over the limit: the server answers 413 and stops reading long
    before the client has sent it all (so it never held more than about the limit)."""
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=10)
    try:
        sock.sendall(
            b"POST /v1/requests HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Authorization: Bearer " + live.tokens.admin.encode() + b"\r\n\r\n"
        )
        chunk = b"%x\r\n%s\r\n" % (64 * 1024, b"[" * 64 * 1024)
        sent = 0
        answered = b""
        sock.settimeout(0.0)
        deadline = time.monotonic() + 20
        while sent < (256 << 20) and time.monotonic() < deadline:
            with contextlib.suppress(BlockingIOError):
                answered += sock.recv(4096)
            if answered:
                break
            try:
                sent += sock.send(chunk)
            except BlockingIOError:
                time.sleep(0.001)
        assert answered.startswith(b"HTTP/1.1 413"), answered[:200]
        assert sent < 16 * MAX_BODY_BYTES, sent  # refused long before 256 MiB went out
    finally:
        sock.close()


def test_the_limit_is_configurable() -> None:
    tokens = ClusterTokens()
    config = OrchestratorServiceConfig(auth=tokens.orchestrator_auth(()), max_body_bytes=4096)
    background = BackgroundLoop()

    async def main() -> None:
        stop = asyncio.Event()
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(serve_orchestrator(config, "127.0.0.1", 0, stop, ready))
        url = await asyncio.wait_for(ready, 30)
        port = urllib.parse.urlsplit(url).port
        assert port is not None
        try:
            body = json.dumps(_worker("w-big", node="n" * 5000)).encode()
            answers = await asyncio.to_thread(
                lambda: [
                    send(port, "POST", "/v1/workers", bearer(tokens.admin), body),
                    send(port, "POST", "/v1/workers", bearer(tokens.admin), body, chunked=True),
                ]
            )
            assert [a.status for a in answers] == [413, 413]
            assert "4096" in answers[1].json()["error"]["detail"]
        finally:
            stop.set()
            await task

    try:
        background.run(main())
    finally:
        background.close()
    with pytest.raises(Exception, match="max_body_bytes"):
        OrchestratorServiceConfig(auth=None, max_body_bytes=10)


# -- JSON shape, unknown fields, ranges ------------------------------------------------------


def test_json_problem_bounds_depth_and_refuses_non_finite_numbers() -> None:
    def nested(depth: int) -> bytes:
        return b"[" * depth + b"]" * depth

    assert json_problem(nested(MAX_JSON_DEPTH)) is None
    assert "deeper" in (json_problem(nested(MAX_JSON_DEPTH + 1)) or "")
    assert "deeper" in (json_problem(b'{"a":' * 500 + b"1" + b"}" * 500) or "")
    # brackets inside strings (escaped quotes included) are not structure
    assert json_problem(b'{"a": "' + b"[" * 1000 + b'\\"' + b"{" * 1000 + b'"}') is None
    assert json_problem(b'{"a": NaN}') and json_problem(b"[-Infinity]")
    assert json_problem(b'{"NaN": "Infinity"}') is None
    # malformed input is left to the parser (which says where) ...
    assert json_problem(b"[[[[") is None and json_problem(b"\xff\xfe") is None
    assert json_problem(b"[" * MAX_JSON_DEPTH) is None
    # ... except openers that never close, deeper than the bound: json.loads would recurse
    # into them (RecursionError at ~1,000 levels) before it found the body malformed
    assert "deeper" in (json_problem(b"[" * 5000) or "")
    assert "deeper" in (json_problem(b'{"a": ' * (MAX_JSON_DEPTH + 1)) or "")
    # linear: a 1 MiB body of many levels is judged fast
    started = time.perf_counter()
    assert json_problem(nested(MAX_BODY_BYTES // 2))
    assert json_problem(b"[]" * (MAX_BODY_BYTES // 2)) is None
    assert time.perf_counter() - started < 2.0


def test_deep_nonfinite_unknown_and_out_of_range_bodies_get_400(live: Live) -> None:
    headers = bearer(live.tokens.admin)
    submit = {"model": "m", "layout": _LAYOUT}
    cases: dict[str, tuple[str, bytes]] = {
        "deep": ("/v1/requests", b'{"model": "m", "layout": ' + b"[" * 100 + b"]" * 100 + b"}"),
        "deep dict": ("/v1/workers", b'{"worker": ' + b'{"a": ' * 2000 + b"1" + b"}" * 2001),
        "nan": ("/v1/workers", json.dumps(_worker("w-nan")).encode()[:-1] + b', "ttl_s": NaN}'),
        "inf": ("/v1/requests", b'{"model": "m", "request_id": Infinity, "prompt_tokens": 1}'),
        "huge float": ("/v1/workers", json.dumps({**_worker("w-h"), "ttl_s": 1e308}).encode()),
        "overflow": ("/v1/workers", json.dumps({**_worker("w-h"), "ttl_s": 1e999}).encode()),
        "huge int": ("/v1/requests", json.dumps({**submit, "request_id": 10**40}).encode()),
        "long int": ("/v1/requests", b'{"model": "m", "request_id": ' + b"9" * 5000 + b"}"),
        "unknown top": ("/v1/requests", json.dumps({**submit, "admin": True}).encode()),
        "unknown nested": (
            "/v1/requests",
            json.dumps({**submit, "layout": {**_LAYOUT, "x": 1}}).encode(),
        ),
        "unknown in worker": ("/v1/workers", json.dumps(_worker("w-x", evil=1)).encode()),
        "unknown capability": (
            "/v1/workers",
            json.dumps(_worker("w-x", capabilities={"root": True})).encode(),
        ),
        "capacity": ("/v1/workers", json.dumps(_worker("w-x", capacity=10**12)).encode()),
        "gpus": ("/v1/workers", json.dumps(_worker("w-x", gpus=[-1])).encode()),
        "many gpus": ("/v1/workers", json.dumps(_worker("w-x", gpus=[0] * 5000)).encode()),
        "long node": ("/v1/workers", json.dumps(_worker("w-x", node="n" * 1000)).encode()),
        "token id": (
            "/v1/requests",
            json.dumps({"model": "m", "prompt": [2**40], "new_tokens": 1}).encode(),
        ),
        "kv too big": (
            "/v1/requests",
            json.dumps({"model": "Llama-3-70B", "prompt_tokens": 10_000_000}).encode(),
        ),
        "wrong type": ("/v1/requests", json.dumps({**submit, "prefill": [1]}).encode()),
        "not an object": ("/v1/workers", b"[1, 2, 3]"),
        "not json": ("/v1/workers", b"\xff\xfe\x00garbage"),
        "truncated": ("/v1/requests", json.dumps(submit).encode()[:-3]),
        "many errors": (
            "/v1/requests",
            json.dumps({"model": "m", "prompt": ["x"] * 100_000}).encode(),
        ),
    }
    for name, (path, body) in cases.items():
        answer = send(live.port, "POST", path, headers, body)
        error = assert_json_error(answer)
        assert answer.status == 400, (name, answer)
        assert error["kind"] == "bad_request", (name, error)
        assert len(error["detail"]) < 4000, (name, len(error["detail"]))
    assert live.workers_listing() == {}
    # the same bodies well-formed are accepted
    ok = send(live.port, "POST", "/v1/workers", headers, json.dumps(_worker("w-ok")).encode())
    assert ok.status == 201, ok
    assert send(live.port, "DELETE", "/v1/workers/w-ok", headers).status == 204


def test_aiohttp_own_errors_are_json_too(live: Live) -> None:
    headers = bearer(live.tokens.admin)
    error = assert_json_error(send(live.port, "GET", "/v1/nothing-here", headers))
    assert error["kind"] == "not_found"
    answer = send(live.port, "PATCH", "/v1/workers", headers)
    assert assert_json_error(answer)["kind"] == "method_not_allowed"
    assert "GET" in answer.headers.get("Allow", "")
    gz = [*headers, ("Content-Encoding", b"gzip")]
    assert assert_json_error(send(live.port, "POST", "/v1/workers", gz, b"not gzip"))["kind"] == (
        "bad_request"
    )
    for bad in ("abc", "-1", "9" * 30, "\u0661", "1e3"):
        quoted = urllib.parse.quote(bad)
        error = assert_json_error(send(live.port, "GET", f"/v1/requests/{quoted}", headers))
        assert error["kind"] == "bad_request"
    for bad in ("x", "-1", "\u00b2", "9" * 40):
        path = f"/v1/transfers?limit={urllib.parse.quote(bad)}"
        assert assert_json_error(send(live.port, "GET", path, headers))["kind"] == "bad_request"


def test_a_non_ascii_authorization_header_is_401(live: Live) -> None:
    answer = send(live.port, "GET", "/v1/workers", [("Authorization", b"Bearer \xff\xfe")])
    assert answer.status == 401


def test_a_non_utf8_expect_header_is_4xx(live: Live) -> None:
    answer = send(live.port, "POST", "/v1/workers", [("Expect", b"\x80")])
    assert 400 <= answer.status < 500


# -- the registration flood ------------------------------------------------------------------


class _FakeRequest(dict[Any, Any]):
    """The little of a request :class:`Registrations` reads, for a fake clock."""

    def __init__(self, body: dict[str, Any], principal: Principal | None, remote: str) -> None:
        super().__init__()
        from topkv.service.http.auth import PRINCIPAL_KEY

        self._body = json.dumps(body).encode()
        self.remote = remote
        self.client_max_size = MAX_BODY_BYTES
        self.content_length = len(self._body)
        self.match_info = {"worker_id": body["worker"]["worker_id"]}
        if principal is not None:
            self[PRINCIPAL_KEY] = principal

    async def read(self) -> bytes:
        return self._body


def test_registrations_are_rate_limited_per_token_and_ids_capped() -> None:
    now = [0.0]
    registrations = Registrations(
        MemoryRegistry(), RegistrationLimits(rate_per_s=2.0, burst=3, max_ids=2), lambda: now[0]
    )
    admin, mine, other = (new_token() for _ in range(3))
    credentials = Credentials.of(admin=[admin], worker=[mine, other])

    def principal(token: str) -> Principal:
        found = credentials.authenticate(token)
        assert found is not None
        return found

    def register(worker_id: str, token: str | None, remote: str = "10.0.0.1") -> Any:
        request = _FakeRequest(_worker(worker_id), principal(token) if token else None, remote)
        return asyncio.run(registrations.register(request))  # type: ignore[arg-type]

    # a burst of 3 re-registrations of one id, then 429 with Retry-After
    assert [register("w-1", mine).status for _ in range(3)] == [201, 200, 200]
    throttled = register("w-1", mine)
    assert throttled.status == 429 and throttled.headers["Retry-After"] == "1"
    assert json.loads(throttled.body)["error"]["kind"] == "rate_limited"
    # another token and an admin are not throttled by it
    assert register("w-9", other).status == 201
    assert register("w-8", admin).status == 201
    # the bucket refills at rate_per_s
    now[0] += 0.5
    assert register("w-2", mine).status == 201
    now[0] += 10
    # at most 2 ids per token: a third is refused with 409, a held one still re-registers
    capped = register("w-3", mine)
    assert capped.status == 409
    assert "2 registered worker ids" in json.loads(capped.body)["error"]["detail"]
    assert register("w-2", mine).status == 200
    # an admin taking an id over takes it out of the token's count (and out of its hands)
    now[0] += 10
    assert register("w-1", admin).status == 200
    assert register("w-1", mine).status == 403
    assert register("w-3", mine).status == 201
    assert register("w-4", mine).status == 409
    now[0] += 10
    # heartbeats are not registrations: never throttled
    for _ in range(50):
        assert registrations.by_worker["w-2"].heartbeat() is None
    # an id given up frees its place
    registrations.forget("w-2")
    assert register("w-4", mine).status == 201
    # with authentication off, the limits are per remote address
    open_registrations = Registrations(
        MemoryRegistry(), RegistrationLimits(rate_per_s=1.0, burst=1, max_ids=5), lambda: now[0]
    )
    registrations = open_registrations
    assert register("a", None, "10.0.0.1").status == 201
    assert register("a", None, "10.0.0.1").status == 429
    assert register("a", None, "10.0.0.2").status == 200


def test_ids_whose_leases_ran_out_do_not_count_against_the_cap() -> None:
    clock = [0.0]

    class Clock:
        def now(self) -> float:
            return clock[0]

    registry = MemoryRegistry(Clock())
    registrations = Registrations(registry, RegistrationLimits(max_ids=1), lambda: clock[0])
    token = new_token()
    found = Credentials.of(worker=[token]).authenticate(token)

    def register(worker_id: str) -> int:
        body = {**_worker(worker_id), "ttl_s": 5}
        request = _FakeRequest(body, found, "")
        return int(asyncio.run(registrations.register(request)).status)  # type: ignore[arg-type]

    assert register("old") == 201
    assert register("new") == 409
    clock[0] += 10  # "old" expired without deregistering (its worker died)
    assert register("new") == 201
    assert set(registrations.by_worker) == {"new"}


def test_a_worker_token_cannot_take_over_an_id_an_admin_registered(live: Live) -> None:
    admin, (mine, _) = live.tokens.admin, live.workers
    body = json.dumps(_worker("w-admin")).encode()
    assert send(live.port, "POST", "/v1/workers", bearer(admin), body).status == 201
    assert send(live.port, "POST", "/v1/workers", bearer(mine), body).status == 403
    assert send(live.port, "DELETE", "/v1/workers/w-admin", bearer(mine)).status == 403
    assert send(live.port, "DELETE", "/v1/workers/w-admin", bearer(admin)).status == 204


# -- 1,000 random requests -------------------------------------------------------------------

_WORKER_IDS = ("w-0", "w-1", "w-2", "w-3", "w-4", "decode-0")
_METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE", "FROB")
_ROUTES = (
    *[("POST", "/v1/requests")] * 3,
    ("GET", "/v1/requests/{rid}"),
    ("DELETE", "/v1/requests/{rid}"),
    ("GET", "/v1/transfers"),
    ("GET", "/v1/workers"),
    *[("POST", "/v1/workers")] * 5,  # the registry endpoints, most of all
    *[("PUT", "/v1/workers/{wid}/heartbeat")] * 2,
    *[("DELETE", "/v1/workers/{wid}")] * 3,
    ("GET", "/v1/topology"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
)
_CONTENT_TYPES = (b"application/json", b"application/json; charset=utf-8", b"text/plain",
                  b"multipart/form-data; boundary=zz", b";;;", None)  # fmt: skip
_CATALOG = ("Llama-3-8B", "Llama-3-70B", "DeepSeek-V3", "Qwen3.5-397B", "gpt-oss-120b", "m")


@st.composite
def submit_body(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(("layout", "catalog", "prompt", "seed")))
    body: dict[str, Any] = {"model": draw(st.sampled_from(_CATALOG))}
    if kind == "layout":
        body["layout"] = {
            "num_layers": draw(st.integers(1, 8)),
            "seq_len": draw(st.integers(1, 64)),
            "kv_heads": draw(st.integers(1, 4)),
            "head_dim": draw(st.integers(1, 64)),
            "dtype": draw(st.sampled_from(("fp8", "fp16", "bf16", "fp32"))),
        }
    elif kind == "catalog":
        body["prompt_tokens"] = draw(st.sampled_from((1, 128, 4096, 10_000_000)))
    elif kind == "prompt":
        body["prompt"] = draw(st.lists(st.integers(0, 50_000), min_size=1, max_size=8))
        body["new_tokens"] = draw(st.integers(0, 8))
    else:
        body["prompt_seed"] = draw(st.integers(0, 2**32))
        body["prompt_tokens"] = draw(st.integers(1, 64))
    for key, values in (
        ("request_id", st.integers(0, 50)),
        ("source", st.sampled_from(_WORKER_IDS)),
        ("prefill", st.booleans()),
        ("medium", st.sampled_from(("tcp", "shm", "emulated-rdma", "bogus"))),
        ("transport", st.sampled_from(("nvlink", "rdma", "tcp", "carrier-pigeon"))),
    ):
        if draw(st.booleans()):
            body[key] = draw(values)
    return body


@st.composite
def register_body(draw: st.DrawFn) -> dict[str, Any]:
    worker: dict[str, Any] = {
        "worker_id": draw(st.sampled_from(_WORKER_IDS)),
        "role": "decode",  # decode only: a registered prefill worker would be called upon
        "node": draw(st.sampled_from(("n0", "n1"))),
    }
    optional = {
        "gpus": st.lists(st.integers(0, 7), max_size=4),
        "host_id": st.text(max_size=10),
        "capacity": st.integers(0, 64),
        "address": st.just("127.0.0.1:1"),
        "control_url": st.just("http://127.0.0.1:1"),
        "capabilities": st.fixed_dictionaries(
            {}, optional={"rdma": st.booleans(), "media": st.lists(st.sampled_from(("tcp", "shm")))}
        ),
    }
    for key, values in optional.items():
        if draw(st.booleans()):
            worker[key] = draw(values)
    # always a long lease: one that ran out mid-run would read as a change the request made
    # (the default, 10 s, is shorter than a thousand requests take on a loaded machine)
    return {"worker": worker, "ttl_s": draw(st.floats(600, 3600))}


@dataclass
class Drawn:
    method: str
    path: str
    route: tuple[str, str] | None
    headers: list[tuple[str, bytes]]
    body: bytes
    token: str | None  # the token the server will see (None: none or not valid)
    chunked: bool = False
    target: str | None = None  # the worker id the request names, if any


@st.composite
def hostile_request(draw: st.DrawFn, tokens: dict[str, str]) -> Drawn:
    real = draw(st.integers(0, 9)) < 8
    route: tuple[str, str] | None = None
    target = None
    if real:
        route = draw(st.sampled_from(_ROUTES))
        method = route[0] if draw(st.integers(0, 9)) < 8 else draw(st.sampled_from(_METHODS))
        named = draw(st.integers(0, 9)) < 8
        target = draw(st.sampled_from(_WORKER_IDS) if named else st.text(max_size=12))
        rid = draw(st.sampled_from(("1", "0", "-1", "9" * 30, "abc", "\u0661", "")))
        path = route[1].format(
            wid=urllib.parse.quote(target, safe=""), rid=urllib.parse.quote(rid, safe="")
        )
        if route[1] == "/v1/transfers" and draw(st.booleans()):
            query = {
                "state": draw(st.sampled_from(("queued", "delivered", "nope", ""))),
                "limit": draw(st.sampled_from(("0", "5", "100", "-1", "x", "\u00b2", "9" * 40))),
                "worker": draw(st.sampled_from(_WORKER_IDS)),
            }
            path += "?" + urllib.parse.urlencode(query)
    else:
        method = draw(st.sampled_from(_METHODS))
        segments = draw(st.lists(st.text(max_size=10), max_size=4))
        path = "/" + "/".join(urllib.parse.quote(s, safe="") for s in segments)
        if draw(st.booleans()):
            path = "/v1" + path
    # the body
    shape = draw(st.sampled_from(("model",) * 5 + ("empty", "bytes", "json", "big")))
    body = b""
    if shape == "model":
        if route is not None and route[1] == "/v1/workers" and route[0] == "POST":
            valid = draw(register_body())
            target = valid["worker"]["worker_id"]
        else:
            valid = draw(submit_body())
        body = draw(nearly_valid(valid))
    elif shape == "bytes":
        body = draw(st.binary(max_size=200))
    elif shape == "json":
        body = json.dumps(draw(json_value)).encode()
    elif shape == "big":
        body = b'{"x": "' + b"x" * (MAX_BODY_BYTES + 10) + b'"}'
    # the headers
    headers: list[tuple[str, bytes]] = []
    who = draw(st.sampled_from(("none", "bad", *("worker0", "worker1", "admin") * 2)))
    token_text = tokens.get(who, "tkv_" + "0" * 43)
    odd = draw(st.integers(0, 9)) < 2  # mostly well-formed, so most requests get past auth
    schemes = ("bearer ", "BEARER  ", "Basic ", "", "Token ", "Bearer\t") if odd else ("Bearer ",)
    scheme = draw(st.sampled_from(schemes))
    extra = draw(st.sampled_from(("", " ", "x", "\t"))) if odd else ""
    token: str | None = None
    if who != "none":
        value = f"{scheme}{token_text}{extra}"
        headers.append(("Authorization", value.encode()))
        presented = value.partition(" ")
        if presented[0].lower() == "bearer" and presented[2].strip() == token_text:
            token = token_text if who != "bad" else None
    content_type = draw(st.sampled_from(_CONTENT_TYPES))
    if content_type is not None:
        headers.append(("Content-Type", content_type))
    if body and draw(st.integers(0, 9)) == 0:
        encoding = draw(st.sampled_from((b"gzip", b"deflate", b"br", b"identity", b"x-bogus")))
        headers.append(("Content-Encoding", encoding))
        if encoding == b"gzip" and draw(st.booleans()):
            body = gzip.compress(body)
    for _ in range(draw(st.integers(0, 2))):
        name = draw(st.sampled_from(("X-Junk", "Accept", "Origin", "X-Forwarded-For", "Range")))
        headers.append((name, draw(st.binary(max_size=30).map(header_safe))))
    if draw(st.integers(0, 19)) == 0:  # ASCII only: see test_a_non_utf8_expect_header_is_4xx
        expect = st.sampled_from((b"100-continue", b"x")) | st.binary(max_size=12).map(ascii_only)
        headers.append(("Expect", draw(expect)))
    chunked = bool(body) and draw(st.integers(0, 4)) == 0
    return Drawn(method, path, route, headers, body, token, chunked, target)


@dataclass
class Ledger:
    """The test's own record of who may change which registration."""

    before: dict[str, Any] = field(default_factory=dict)
    owner: dict[str, str] = field(default_factory=dict)  # worker id -> token that registered
    statuses: dict[int, int] = field(default_factory=dict)


def _check(live: Live, ledger: Ledger, drawn: Drawn, answer: Answer) -> None:
    route = drawn.route if drawn.route is not None and drawn.method == drawn.route[0] else None
    readiness = route == ("GET", "/readyz") and answer.status == 503
    assert 200 <= answer.status < 300 or 400 <= answer.status < 500 or readiness, answer
    if answer.status >= 400 and drawn.method != "HEAD" and answer.body:
        is_json = answer.headers.get("Content-Type", "").startswith("application/json")
        # only aiohttp itself answers in plain text, before any middleware runs: its HTTP
        # parser (a malformed message) and its Expect handling (417)
        if not is_json:
            assert answer.status in (400, 417), answer
        elif not readiness:
            assert_json_error(answer)
    after = live.workers_listing()
    changed = {w for w in set(ledger.before) | set(after) if ledger.before.get(w) != after.get(w)}
    admin = drawn.token == live.tokens.admin
    if not 200 <= answer.status < 300 or drawn.token is None:
        assert not changed, (drawn, answer, changed)
    elif not admin:
        # a worker token changes at most the one id it named, and only one it holds (or new)
        assert changed <= {drawn.target}, (drawn, changed)
        for worker_id in changed:
            assert worker_id not in ledger.before or ledger.owner.get(worker_id) == drawn.token
    if route == ("POST", "/v1/workers") and answer.status in (200, 201):
        worker_id = answer.json()["worker"]["worker_id"]
        ledger.owner[worker_id] = drawn.token or ""
    if route == ("DELETE", "/v1/workers/{wid}") and answer.status == 204:
        ledger.owner.pop(drawn.target or "", None)
    ledger.before = after
    ledger.statuses[answer.status] = ledger.statuses.get(answer.status, 0) + 1


def test_a_thousand_hostile_requests_never_get_a_5xx_nor_change_the_registry_unasked(
    live: Live,
) -> None:
    # the strategy draws stand-ins (so its examples are the same from run to run); the real
    # tokens replace them as each request goes out
    stand_ins = {name: f"tkv_stand-in-for-{name}" for name in ("admin", "worker0", "worker1")}
    real = {
        stand_ins["admin"]: live.tokens.admin,
        stand_ins["worker0"]: live.workers[0],
        stand_ins["worker1"]: live.workers[1],
    }

    def resolved(drawn: Drawn) -> Drawn:
        headers = list(drawn.headers)
        for index, (name, value) in enumerate(headers):
            for stand_in, token in real.items():
                value = value.replace(stand_in.encode(), token.encode())
            headers[index] = (name, value)
        token = real.get(drawn.token or "", drawn.token)
        return dataclasses.replace(drawn, headers=headers, token=token)

    # earlier tests' registrations have short leases that may run out mid-run: remove them
    for worker_id in live.workers_listing():
        gone = send(live.port, "DELETE", f"/v1/workers/{worker_id}", bearer(live.tokens.admin))
        assert gone.status in (204, 404), gone
    ledger = Ledger(before=live.workers_listing())
    assert ledger.before == {}

    # hypothesis derives the derandomized examples from this function's source, decorators
    # included: the mix asserted below (409 or 429 reached) was measured for this text
    @settings(
        max_examples=1000,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(hostile_request(stand_ins))
    def one(drawn: Drawn) -> None:
        drawn = resolved(drawn)
        answer = send(
            live.port, drawn.method, drawn.path, drawn.headers, drawn.body, chunked=drawn.chunked
        )
        _check(live, ledger, drawn, answer)

    started = time.monotonic()
    one()
    elapsed = time.monotonic() - started
    print(f"1000 hostile requests in {elapsed:.1f} s: {sorted(ledger.statuses.items())}")
    # the mix reached every kind of answer: accepted, refused for auth, input, size, limits
    seen = set(ledger.statuses)
    assert {200, 201, 400, 401, 403, 404, 413}.issubset(seen), ledger.statuses
    assert seen & {409, 429}, ledger.statuses
