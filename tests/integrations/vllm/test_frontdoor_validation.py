"""The front door checks what it is sent before any work (issue 37): each hostile body is a
4xx JSON error naming the field and the rule, no instance is called, nothing is logged as
an error; valid requests still reach the instances, as the client sent them."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from frontdoor_fakes import ADMIN, Answer, FrontDoor, send

from topkv.integrations.vllm.frontdoor.validate import (
    MAX_CHOICES,
    MAX_INFERENCE_BODY_BYTES,
    MAX_TOKENS_WITHOUT_CONTEXT,
    Refused,
    ServedContext,
    check_context,
    json_errors,
    parse_body,
)
from topkv.service.http.util import MAX_JSON_DEPTH

CONTEXT = 4096
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FrontDoor]:
    front = FrontDoor(str(tmp_path_factory.mktemp("shm")), context=CONTEXT)
    yield front
    front.close()


def _error(answer: Answer, status: int) -> dict[str, Any]:
    """The front door's JSON error of ``status``: TopKV's keys and OpenAI's."""
    assert answer.status == status, answer
    assert answer.headers.get("Content-Type", "").startswith("application/json"), answer
    error = answer.json()["error"]
    assert {"kind", "type", "detail", "message", "code"} <= set(error), error
    assert error["message"] == error["detail"] and error["code"] == status
    assert "Traceback" not in error["detail"]
    return error  # type: ignore[no-any-return]


def _nest(depth: int) -> str:
    return "[" * depth + "]" * depth


HOSTILE: list[tuple[str, str, bytes, str, str | None, str]] = [
    # (case, path, raw body, error type, param, what the detail says)
    ("5,000-deep array", CHAT,
     b'{"messages": [{"role": "user", "content": ' + _nest(5000).encode() + b"}]}",
     "JSONError", None, f"nested deeper than {MAX_JSON_DEPTH} levels"),
    ("5,000 unclosed brackets", CHAT, b'{"messages": ' + b"[" * 5000,
     "JSONError", None, f"nested deeper than {MAX_JSON_DEPTH} levels"),
    ("deep in an unknown field", COMPLETIONS,
     b'{"prompt": "x", "vllm_xargs": ' + _nest(MAX_JSON_DEPTH + 1).encode() + b"}",
     "JSONError", None, "nested deeper"),
    ("max_tokens -1", COMPLETIONS, b'{"prompt": "x", "max_tokens": -1}',
     "ValidationError", "max_tokens", "max_tokens: Input should be greater than or equal to 1"),
    ("max_tokens 0", COMPLETIONS, b'{"prompt": "x", "max_tokens": 0}',
     "ValidationError", "max_tokens", "greater than or equal to 1"),
    ("max_tokens a string", COMPLETIONS, b'{"prompt": "x", "max_tokens": "16"}',
     "ValidationError", "max_tokens", "max_tokens: Input should be a valid integer"),
    ("max_completion_tokens -1", CHAT,
     b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}',
     "ValidationError", "max_completion_tokens", "max_completion_tokens: Input should be"),
    ("n 1000", COMPLETIONS, b'{"prompt": "x", "n": 1000}',
     "ValidationError", "n", f"n: Input should be less than or equal to {MAX_CHOICES}"),
    ("n 0", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "n": 0}',
     "ValidationError", "n", "n: Input should be greater than or equal to 1"),
    ("prompt an object", COMPLETIONS, b'{"prompt": {"text": "x"}}',
     "ValidationError", "prompt", "prompt: must be a non-empty string, a list of strings"),
    ("prompt token ids negative", COMPLETIONS, b'{"prompt": [1, -2]}',
     "ValidationError", "prompt", "list of token ids"),
    ("prompt empty", COMPLETIONS, b'{"prompt": ""}', "ValidationError", "prompt", "non-empty"),
    ("no prompt", COMPLETIONS, b'{"model": "m"}',
     "ValidationError", "prompt", "prompt: Field required"),
    ("temperature NaN", COMPLETIONS, b'{"prompt": "x", "temperature": NaN}',
     "JSONError", None, "NaN and Infinity are not JSON numbers"),
    ("temperature Infinity", CHAT,
     b'{"messages": [{"role": "user", "content": "x"}], "temperature": Infinity}',
     "JSONError", None, "NaN and Infinity are not JSON numbers"),
    ("-Infinity in an unknown field", COMPLETIONS,
     b'{"prompt": "x", "logit_bias": {"1": -Infinity}}',
     "JSONError", None, "NaN and Infinity are not JSON numbers"),
    ("1e999, infinite once parsed", COMPLETIONS, b'{"prompt": "x", "temperature": 1e999}',
     "JSONError", None, "the number 1e999 is out of range"),
    ("temperature 3", COMPLETIONS, b'{"prompt": "x", "temperature": 3}',
     "ValidationError", "temperature", "temperature: Input should be less than or equal to 2"),
    ("top_p 0", COMPLETIONS, b'{"prompt": "x", "top_p": 0}',
     "ValidationError", "top_p", "top_p: Input should be greater than 0"),
    ("presence_penalty -3", COMPLETIONS, b'{"prompt": "x", "presence_penalty": -3}',
     "ValidationError", "presence_penalty", "greater than or equal to -2"),
    ("stream a string", COMPLETIONS, b'{"prompt": "x", "stream": "false"}',
     "ValidationError", "stream", "stream: Input should be a valid boolean"),
    ("20 stop strings", COMPLETIONS, json.dumps({"prompt": "x", "stop": ["s"] * 20}).encode(),
     "ValidationError", "stop", "stop: must be a string or a list of at most 16 strings"),
    ("no messages", CHAT, b'{"messages": []}',
     "ValidationError", "messages", "messages: List should have at least 1 item"),
    ("content an object", CHAT, b'{"messages": [{"role": "user", "content": {"a": 1}}]}',
     "ValidationError", "messages.0.content", "messages.0.content: must be a string"),
    ("a message without a role", CHAT, b'{"messages": [{"content": "x"}]}',
     "ValidationError", "messages.0.role", "messages.0.role: Field required"),
    ("not JSON", COMPLETIONS, b"prompt=hello", "JSONError", None, "the body is not JSON"),
    ("not UTF-8", COMPLETIONS, b'{"prompt": "\xff\xfe"}', "JSONError", None, "not JSON"),
    ("a list", COMPLETIONS, b'[{"prompt": "x"}]',
     "ValidationError", None, "the body must be a JSON object"),
    ("empty", COMPLETIONS, b"", "JSONError", None, "the body is empty"),
    ("blank", CHAT, b" \n ", "JSONError", None, "the body is empty"),
    ("max_tokens past the context", COMPLETIONS,
     json.dumps({"prompt": "x", "max_tokens": CONTEXT + 1}).encode(),
     "ValidationError", "max_tokens",
     f"max_tokens: {CONTEXT + 1} is more than the model's context ({CONTEXT} tokens, its "
     "max_model_len)"),
    ("max_completion_tokens past the context", CHAT,
     json.dumps({"messages": [{"role": "user", "content": "x"}],
                 "max_completion_tokens": 10**9}).encode(),
     "ValidationError", "max_completion_tokens", "is more than the model's context"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "raw", "type_", "param", "says"),
    [case[1:] for case in HOSTILE],
    ids=[case[0] for case in HOSTILE],
)
def test_a_hostile_body_is_a_400_naming_the_rule_and_no_instance_is_called(
    door: FrontDoor,
    caplog: pytest.LogCaptureFixture,
    path: str,
    raw: bytes,
    type_: str,
    param: str | None,
    says: str,
) -> None:
    before = len(door.fake.received)
    with caplog.at_level(logging.WARNING):
        error = _error(door.post(path, raw), 400)
    assert (error["kind"], error["type"]) == ("bad_request", type_), error
    assert says in error["detail"], error
    assert error.get("param") == param, error
    assert len(door.fake.received) == before  # refused before any work
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_the_deep_nest_error_is_the_orchestrators(door: FrontDoor) -> None:
    """Same rule, same words, same kind and type as the orchestrator's API."""
    error = _error(door.post(CHAT, b'{"messages": ' + _nest(5000).encode() + b"}"), 400)
    assert error["detail"] == f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels"
    nan = _error(door.post(COMPLETIONS, b'{"prompt": "x", "temperature": NaN}'), 400)
    assert nan["detail"] == "NaN and Infinity are not JSON numbers; send finite numbers"


@pytest.mark.parametrize(
    "content_type", [b"text/plain", b"application/x-www-form-urlencoded", b"multipart/form-data"]
)
def test_a_body_that_is_not_json_by_its_content_type_is_415(
    door: FrontDoor, content_type: bytes
) -> None:
    headers = [("Authorization", f"Bearer {ADMIN}".encode()), ("Content-Type", content_type)]
    error = _error(door.post(COMPLETIONS, b'{"prompt": "x"}', headers), 415)
    assert error["kind"] == "unsupported_media_type"
    assert "send the request as application/json" in error["detail"]


@pytest.mark.parametrize(
    "content_type", [None, b"application/json; charset=utf-8", b"application/vnd.api+json"]
)
def test_a_json_content_type_or_none_is_read(door: FrontDoor, content_type: bytes | None) -> None:
    headers = [("Authorization", f"Bearer {ADMIN}".encode())]
    if content_type is not None:
        headers.append(("Content-Type", content_type))
    assert door.post(COMPLETIONS, b'{"prompt": "x"}', headers).status == 200


def test_a_body_over_the_limit_is_413_declared_or_not(door: FrontDoor) -> None:
    huge = b'{"prompt": "' + b"x" * MAX_INFERENCE_BODY_BYTES + b'"}'
    before = len(door.fake.received)
    declared = _error(door.post(COMPLETIONS, huge), 413)
    assert declared["kind"] == "too_large" and str(len(huge)) in declared["detail"]
    chunked = _error(door.post(CHAT, huge, chunked=True), 413)
    assert (
        chunked["kind"] == "too_large"
        and f"at most {MAX_INFERENCE_BODY_BYTES}" in (chunked["detail"])
    )
    # only the length is declared, nothing sent: refused at once
    lied = _error(door.post(COMPLETIONS, b"", content_length=1 << 40), 413)
    assert lied["kind"] == "too_large"
    assert len(door.fake.received) == before


def test_a_body_that_cannot_be_decoded_is_400(door: FrontDoor) -> None:
    headers = [
        ("Authorization", f"Bearer {ADMIN}".encode()),
        ("Content-Type", b"application/json"),
        ("Content-Encoding", b"gzip"),
    ]
    error = _error(door.post(COMPLETIONS, b'{"prompt": "not gzip"}', headers), 400)
    assert error["type"] == "PayloadError"
    zipped = gzip.compress(b'{"prompt": "x"}')
    assert door.post(COMPLETIONS, zipped, headers).status == 200


def test_aiohttps_own_refusals_are_json_too(door: FrontDoor) -> None:
    headers = [("Authorization", f"Bearer {ADMIN}".encode())]
    wrong_method = send(door.port, "GET", COMPLETIONS, headers)
    assert _error(wrong_method, 405)["kind"] == "method_not_allowed"
    assert wrong_method.headers["Allow"] == "POST"
    missing = _error(send(door.port, "POST", "/v1/nothing", headers, b"{}"), 404)
    assert missing["kind"] == "not_found"


def test_an_unexpected_failure_is_a_json_500_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def broken(request: web.Request) -> web.Response:
        raise RecursionError("deep inside")

    async def run() -> tuple[int, dict[str, Any]]:
        app = web.Application(middlewares=[json_errors])
        app.router.add_post("/x", broken)
        async with TestClient(TestServer(app)) as client:
            answer = await client.post("/x", data=b"{}")
            return answer.status, await answer.json()

    status, body = asyncio.run(run())
    assert status == 500 and body["error"]["kind"] == "internal"
    assert body["error"]["type"] == "RecursionError" and "deep inside" not in json.dumps(body)
    assert any(r.exc_info for r in caplog.records if r.levelno >= logging.ERROR)


# -- what is valid still works, and travels as sent -----------------------------------------


def _forwarded(door: FrontDoor, before: int) -> list[tuple[str, dict[str, Any]]]:
    """What the instances were sent since ``before``, load reports left out."""
    return [
        (path, body)
        for path, body in door.fake.received[before:]
        if "report_of" not in (body.get("kv_transfer_params") or {}).get("topkv", {})
    ]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("path", "request_body"),
    [
        (COMPLETIONS, {
            "model": "m", "prompt": [1, 2, 3], "max_tokens": CONTEXT, "temperature": 0.7,
            "top_p": 1, "n": 1, "stop": ["\n"], "seed": -(2**63), "logprobs": 2,
            "ignore_eos": True, "min_tokens": 1, "vllm_xargs": {"a": [1, "b", 2.5]},
            "a_future_extension": {"kept": [None, True, "as sent"]},
        }),
        (COMPLETIONS, {"prompt": ["one", "two"]}),
        (COMPLETIONS, {"prompt": [[1, 2], [3]], "max_tokens": 5}),
        (CHAT, {
            "model": "m", "max_completion_tokens": 8, "frequency_penalty": -2,
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}, "there"]},
                {"role": "assistant", "content": None, "tool_calls": []},
            ],
            "logprobs": True, "top_logprobs": 2, "chat_template_kwargs": {"x": 1},
        }),
    ],
)  # fmt: skip
def test_a_valid_request_reaches_the_instances_as_the_client_sent_it(
    door: FrontDoor, path: str, request_body: dict[str, Any], stream: bool
) -> None:
    sent = {**request_body, "stream": stream}
    before = len(door.fake.received)
    answer = door.post(path, json.dumps(sent).encode())
    assert answer.status == 200, answer
    if stream:
        assert answer.headers["Content-Type"].startswith("text/event-stream")
        assert answer.body.rstrip().endswith(b"data: [DONE]")
    else:
        assert answer.json()["choices"]
    (prefill_path, prefill), (decode_path, decode) = _forwarded(door, before)
    assert prefill_path == decode_path == path
    # the decode gets the client's body, nothing added but the transfer (and, to continue a
    # broken stream elsewhere, the token ids): no defaults, no fields dropped
    added = {"kv_transfer_params"} | ({"return_token_ids"} if stream else set())
    assert set(decode) == set(sent) | added
    assert {k: decode[k] for k in sent} == sent
    # the prefill gets it with one token asked for, unstreamed (as before)
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False
    assert "max_completion_tokens" not in prefill
    rewritten = {"max_tokens", "max_completion_tokens", "stream"}
    assert {k: v for k, v in prefill.items() if k in sent and k not in rewritten} == {
        k: v for k, v in sent.items() if k not in rewritten
    }


def test_max_tokens_up_to_the_context_passes(door: FrontDoor) -> None:
    body = {"prompt": "x", "max_tokens": CONTEXT}
    assert door.post(COMPLETIONS, json.dumps(body).encode()).status == 200
    assert door.fake.models_asked >= 1  # the context came from the instance's /v1/models


# -- the pieces --------------------------------------------------------------------------


def test_without_a_known_context_max_tokens_is_capped_at_the_stated_constant() -> None:
    check_context({"max_tokens": MAX_TOKENS_WITHOUT_CONTEXT}, None)
    with pytest.raises(Refused, match="the front door's cap while no instance") as refused:
        check_context({"max_tokens": MAX_TOKENS_WITHOUT_CONTEXT + 1}, None)
    assert refused.value.param == "max_tokens"
    check_context({"max_tokens": 10**6}, 10**7)  # a known context above the cap rules
    with pytest.raises(Refused, match="its max_model_len"):
        check_context({"max_completion_tokens": 33}, 32)


def test_the_served_context_is_learned_refreshed_and_retried() -> None:
    now = [0.0]
    answers: list[bytes | None] = [None, b'{"data": [{"id": "m"}]}']
    asked: list[int] = []

    async def fetch() -> bytes | None:
        asked.append(1)
        return answers.pop(0) if answers else b'{"data": [{"max_model_len": 2048}]}'

    context = ServedContext(refresh_s=60, retry_s=5, clock=lambda: now[0])

    async def current() -> int | None:
        return await context.current(fetch)

    assert asyncio.run(current()) is None and len(asked) == 1  # no instance answered
    assert asyncio.run(current()) is None and len(asked) == 1  # not again before 5 s
    now[0] = 5.0
    assert asyncio.run(current()) is None and len(asked) == 2  # a list without a context
    now[0] = 10.0
    assert asyncio.run(current()) == 2048 and len(asked) == 3
    now[0] = 69.0
    assert asyncio.run(current()) == 2048 and len(asked) == 3  # trusted for 60 s
    answers.append(b'{"data": [{"max_model_len": 4096}, {"max_model_len": 1024}]}')
    now[0] = 70.0
    assert asyncio.run(current()) == 1024 and len(asked) == 4  # the smallest card's
    answers.append(b"[" * 10_000)  # a hostile instance's answer: the old value is kept
    now[0] = 131.0
    assert asyncio.run(current()) == 1024
    assert not context.learn(b'{"data": [{"max_model_len": true}, {"max_model_len": -1}]}')


def test_parse_body_keeps_the_body_as_sent() -> None:
    raw = b'{"prompt": "x", "n": 2, "future": {"deep": [1, 2.5, "s"]}, "stream": false}'
    assert parse_body(raw, chat=False) == json.loads(raw)


def test_the_openai_client_is_served_and_reads_a_refusal(door: FrontDoor) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=door.url + "/v1", api_key=ADMIN, max_retries=0)
    answer = client.completions.create(model="m", prompt=[1, 2, 3], max_tokens=4, temperature=0)
    assert answer.choices[0].text == "ok"
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="m", messages=messages, max_tokens=4)
    assert chat.choices[0].message.content == "ok"
    pieces = client.chat.completions.create(model="m", messages=messages, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == "ok"
    with pytest.raises(openai.BadRequestError, match="n: Input should be less than or equal"):
        client.completions.create(model="m", prompt="x", n=1000)
