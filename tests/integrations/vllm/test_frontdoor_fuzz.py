"""Malformed input to the front door's inference endpoints: 300 random requests (bodies
nearly valid or not, headers, methods) against ``/v1/completions`` and
``/v1/chat/completions`` over fake vLLM instances never get a 5xx, every refusal is a JSON
error, and a request is served exactly when its body passes the front door's own check
(:func:`~topkv.integrations.vllm.frontdoor.validate.parse_body`), as the worker API fuzz
(``tests/service/test_worker_api_fuzz.py``) does for the workers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from frontdoor_fakes import (
    ADMIN,
    WORKER,
    Answer,
    FrontDoor,
    fuzz_settings,
    json_value,
    nearly_valid,
    send,
)
from hypothesis import given
from hypothesis import strategies as st

from topkv.integrations.vllm.frontdoor.validate import Refused, check_context, parse_body

CONTEXT = 4096
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FrontDoor]:
    front = FrontDoor(str(tmp_path_factory.mktemp("shm")), context=CONTEXT)
    yield front
    front.close()


_TOKENS = st.lists(st.integers(0, 50_000), min_size=1, max_size=8)
_SAMPLING = {
    "model": st.sampled_from(("m", "other")),
    "max_tokens": st.integers(1, CONTEXT + 2),
    "n": st.integers(1, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stream": st.booleans(),
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=4),
    "min_tokens": st.integers(0, 2),
    "top_k": st.integers(-1, 50),
    "ignore_eos": st.booleans(),
    "vllm_xargs": st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5)),
}
_COMPLETION = st.fixed_dictionaries(
    {
        "prompt": st.text(min_size=1, max_size=40)
        | st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3)
        | _TOKENS
        | st.lists(_TOKENS, min_size=1, max_size=3)
    },
    optional={**_SAMPLING, "echo": st.booleans(), "logprobs": st.integers(0, 5)},
)
_PART = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)})
_MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(("system", "user", "assistant", "tool")),
        "content": st.text(max_size=30) | st.lists(_PART | st.text(max_size=5), max_size=3),
    }
)
_CHAT = st.fixed_dictionaries(
    {"messages": st.lists(_MESSAGE, min_size=1, max_size=3)},
    optional={
        **_SAMPLING,
        "max_completion_tokens": st.integers(1, CONTEXT + 2),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 5),
    },
)
_CONTENT_TYPES = (
    b"application/json", b"application/json; charset=utf-8", b"text/plain", b"", b"x/y+json",
    b"application/problem+json",
)  # fmt: skip


@dataclass
class Drawn:
    method: str
    path: str
    body: bytes
    headers: list[tuple[str, bytes]]
    #: None: the request must be served; else the status it must be refused with.
    expected: int | None


@st.composite
def inference_request(draw: st.DrawFn) -> Drawn:
    path = draw(st.sampled_from((COMPLETIONS, CHAT)))
    chat = path == CHAT
    method = "POST" if draw(st.integers(0, 19)) else draw(st.sampled_from(("GET", "PUT")))
    if draw(st.integers(0, 9)) < 8:
        body = draw(nearly_valid(draw(_CHAT if chat else _COMPLETION)))
    else:
        body = draw(st.binary(max_size=64) | json_value.map(lambda v: json.dumps(v).encode()))
    token = draw(st.sampled_from((ADMIN,) * 8 + ("", "tkv_nope", WORKER)))
    headers = [("Authorization", f"Bearer {token}".encode())] if token else []
    content_type = draw(st.sampled_from((*_CONTENT_TYPES[:2],) * 4 + _CONTENT_TYPES + (None,)))
    if content_type is not None:
        headers.append(("Content-Type", content_type))
    medium = draw(st.sampled_from((None,) * 6 + ("tcp", "shm,tcp", "bogus", " , ")))
    if medium is not None:
        headers.append(("X-TopKV-Medium", medium.encode()))
    return Drawn(method, path, body, headers, _expected(method, path, body, token, content_type,
                                                         medium))  # fmt: skip


def _expected(
    method: str, path: str, body: bytes, token: str, content_type: bytes | None, medium: str | None
) -> int | None:
    """What the front door must answer (None: serve it), by its documented rules in order:
    the token, the method, the content type, the body, the medium."""
    if token in ("", "tkv_nope"):
        return 401
    if token == WORKER:
        return 403
    if method != "POST":
        return 405
    media = (content_type or b"").split(b";")[0].strip().lower()
    if content_type is not None and not (
        media == b"application/json"
        or (media.startswith(b"application/") and media.endswith(b"+json"))
    ):
        return 415
    try:
        check_context(parse_body(body, chat=path == CHAT), CONTEXT)
    except Refused as refused:
        return refused.status
    if medium == "bogus":
        return 400
    return None


def _check(drawn: Drawn, answer: Answer) -> None:
    assert answer.status < 500, (drawn, answer)
    if answer.status >= 400:
        assert answer.headers.get("Content-Type", "").startswith("application/json"), answer
        error = answer.json()["error"]
        assert all(isinstance(error[k], str) for k in ("kind", "type", "detail")), error
        assert "Traceback" not in error["detail"]
    assert answer.status == (drawn.expected or 200), (drawn, answer)
    if answer.status == 200:
        if answer.headers["Content-Type"].startswith("text/event-stream"):
            assert answer.body.rstrip().endswith(b"data: [DONE]"), answer
        else:
            assert answer.json()["choices"], answer


def test_three_hundred_malformed_inference_requests_never_get_a_5xx(door: FrontDoor) -> None:
    seen: dict[int, int] = {}

    @fuzz_settings(300)
    @given(inference_request())
    def one(drawn: Drawn) -> None:
        answer = send(door.port, drawn.method, drawn.path, drawn.headers, drawn.body)
        _check(drawn, answer)
        seen[answer.status] = seen.get(answer.status, 0) + 1

    one()
    print(f"300 inference requests: {sorted(seen.items())}")
    assert {200, 400, 401, 415}.issubset(seen), seen


def test_a_refusal_names_the_field_of_a_nearly_valid_body() -> None:
    """The check the fuzz relies on refuses what nearly_valid breaks, with the field."""
    body: dict[str, Any] = {"prompt": "x", "max_tokens": 4, "n": 2}
    for broken, field in (({**body, "n": [1]}, "n"), ({**body, "prompt": None}, "prompt")):
        with pytest.raises(Refused) as refused:
            parse_body(json.dumps(broken).encode(), chat=False)
        assert refused.value.param == field
