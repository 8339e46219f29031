"""Malformed input to a worker's control API: 200 random requests (routes, ids, bodies
nearly valid or not, headers) against one in-process
:class:`~topkv.service.worker.service.WorkerService` with the synthetic engine never get a 5xx,
except
the transport outcomes the executor reads (502 and 504) of a well-formed send or wait, and
every refusal is a JSON error.

The worker runs on an event loop of its own thread (see ``hostile_http.py``), the requests
are plain blocking HTTP exchanges.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hostile_http import (
    Answer,
    BackgroundLoop,
    assert_json_error,
    fuzz_settings,
    json_value,
    nearly_valid,
    send,
)
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from topkv.relay.registry.memory import MemoryRegistry
from topkv.service.http.auth import Credentials, ServerAuth, new_token
from topkv.service.messages import (
    DecodeRequest,
    GenerateRequest,
    PrefillRequest,
    ReceiveRequest,
    SendRequest,
    WaitRequest,
)
from topkv.service.worker.registrar import DirectRegistrar
from topkv.service.worker.service import WorkerConfig, WorkerFaults, WorkerService

ADMIN = new_token()


@dataclass
class LiveWorker:
    port: int
    tcp: str  # the worker's own tcp sink address (a destination that parses)


@pytest.fixture(scope="module")
def worker() -> Iterator[LiveWorker]:
    config = WorkerConfig(
        role="prefill",
        node="node-0",
        secret=b"fuzz-test-secret-0123456789abcdef",
        worker_id="fuzzed",
        media=("tcp", "shm"),
        faults=WorkerFaults(),
        auth=ServerAuth(Credentials.of(admin=[ADMIN])),
    )
    background = BackgroundLoop()
    service = WorkerService(config, DirectRegistrar(MemoryRegistry()))
    info = background.run(service.start())
    try:
        port = urllib.parse.urlsplit(info.control_url).port
        assert port is not None
        yield LiveWorker(port, f"tcp://{info.address}")
    finally:
        background.run(service.stop())
        background.close()


_SMALL_LAYOUT = st.fixed_dictionaries(
    {
        "num_layers": st.integers(1, 4),
        "seq_len": st.integers(1, 16),
        "kv_heads": st.integers(1, 2),
        "head_dim": st.integers(1, 16),
    },
    optional={"dtype": st.sampled_from(("fp16", "bf16", "fp8", "fp32")), "latent": st.booleans()},
)
_MEDIA = ("tcp", "shm", "emulated-rdma", "emulated-nvlink", "nixl", "bogus", "")
_TIMEOUT = st.floats(0.01, 0.2)  # short: a valid wait or send must not hold the test up
_IDS = st.sampled_from((0, 3, 7, 11))  # prefills take 0, 3 and 7: sends find some held


def _destinations(worker: LiveWorker) -> st.SearchStrategy[str]:
    return st.sampled_from(
        (
            worker.tcp,
            "tcp://127.0.0.1:1",
            "tcp://[::1]:1",
            "shm://topkv-nothing-here",
            "tcp://127.0.0.1",
            "tcp://:99999",
            "tcp://host:port",
            "garbage",
            "://",
            "tcp://",
        )
    ) | st.text(min_size=1, max_size=30)


def _bodies(worker: LiveWorker) -> dict[str, tuple[type[BaseModel], st.SearchStrategy[Any]]]:
    link = st.fixed_dictionaries(
        {
            "mode": st.sampled_from(("nvlink", "pcie", "rdma", "tcp")),
            "bandwidth_gbps": st.floats(100, 1000),
            "setup_s": st.floats(0, 0.001),
        }
    )
    return {
        "prefill": (
            PrefillRequest,
            st.one_of(
                st.fixed_dictionaries(
                    {"model_id": st.sampled_from(("m", "x" * 50)), "layout": _SMALL_LAYOUT},
                    optional={"wait": st.booleans()},
                ),
                st.fixed_dictionaries({"model_id": st.just("m"), "layout": _SMALL_LAYOUT}),
                st.fixed_dictionaries(
                    {"prompt": st.lists(st.integers(0, 1000), min_size=1, max_size=5)}
                ),
                st.fixed_dictionaries(
                    {"prompt_seed": st.integers(0, 99), "prompt_tokens": st.integers(1, 8)}
                ),
            ),
        ),
        "decode": (
            DecodeRequest,
            st.fixed_dictionaries(
                {"max_new_tokens": st.integers(1, 4)}, optional={"first_token": _IDS}
            ),
        ),
        "generate": (
            GenerateRequest,
            st.fixed_dictionaries(
                {"max_new_tokens": st.integers(1, 4)},
                optional={"prompt": st.lists(st.integers(0, 100), min_size=1, max_size=4)},
            ),
        ),
        "wait": (WaitRequest, st.fixed_dictionaries({"timeout_s": _TIMEOUT})),
        "receive": (
            ReceiveRequest,
            st.fixed_dictionaries(
                {
                    "request_id": _IDS,
                    "model_id": st.just("m"),
                    "layout": _SMALL_LAYOUT,
                    "medium": st.sampled_from(_MEDIA),
                },
                optional={"keep": st.booleans()},
            ),
        ),
        "send": (
            SendRequest,
            st.fixed_dictionaries(
                {
                    "request_id": _IDS,
                    "destination": _destinations(worker),
                    "medium": st.sampled_from(_MEDIA),
                    "timeout_s": _TIMEOUT,
                },
                optional={
                    "transfer_id": _IDS,
                    "schedule": st.sampled_from(("stream", "serial", "replay", "later")),
                    "link": link,
                },
            ),
        ),
    }


_ROUTES: tuple[tuple[str, str, str | None], ...] = (
    ("GET", "/healthz", None),
    ("GET", "/v1/info", None),
    ("GET", "/v1/kv", None),
    ("GET", "/v1/kv/{rid}", None),
    ("DELETE", "/v1/kv/{rid}", None),
    ("POST", "/v1/kv/{rid}/prefill", "prefill"),
    ("POST", "/v1/kv/{rid}/prefill", "prefill"),
    ("POST", "/v1/kv/{rid}/decode", "decode"),
    ("POST", "/v1/kv/{rid}/wait", "wait"),
    ("POST", "/v1/kv/{rid}/cancel", None),
    ("POST", "/v1/receive", "receive"),
    ("POST", "/v1/receive", "receive"),
    ("POST", "/v1/send", "send"),
    ("POST", "/v1/send", "send"),
    ("POST", "/v1/send", "send"),
    ("POST", "/v1/generate", "generate"),
)


@dataclass
class Drawn:
    method: str
    path: str
    body: bytes
    headers: list[tuple[str, bytes]]
    body_kind: str | None
    well_formed: bool
    destination: str = ""  # a well-formed send's


@st.composite
def control_request(draw: st.DrawFn, worker: LiveWorker) -> Drawn:
    method, template, body_kind = draw(st.sampled_from(_ROUTES))
    if draw(st.integers(0, 9)) == 0:
        method = draw(st.sampled_from(("GET", "PUT", "PATCH", "DELETE", "POST")))
    junk = draw(st.integers(0, 9)) < 2
    rid = draw(st.sampled_from(("-1", "x", "9" * 25, "") if junk else ("0", "3", "7")))
    path = template.format(rid=urllib.parse.quote(rid, safe=""))
    bodies = _bodies(worker)
    body = b""
    well_formed = False
    destination = ""
    if body_kind is not None and draw(st.integers(0, 9)) < 8:
        model, valid = bodies[body_kind]
        body = draw(nearly_valid(draw(valid)))
        try:
            parsed = model.model_validate_json(body or b"{}")
            well_formed = True
        except ValidationError:
            pass
        else:
            destination = parsed.destination if isinstance(parsed, SendRequest) else ""
    elif draw(st.booleans()):
        body = draw(st.binary(max_size=64) | json_value.map(lambda v: json.dumps(v).encode()))
    token = ADMIN if draw(st.integers(0, 9)) < 8 else draw(st.sampled_from(("", "tkv_nope")))
    headers = [("Authorization", f"Bearer {token}".encode())] if token else []
    headers.append(("Content-Type", draw(st.sampled_from((b"application/json", b"text/x")))))
    return Drawn(method, path, body, headers, body_kind, well_formed, destination)


def _check(drawn: Drawn, answer: Answer) -> None:
    # the transport's outcomes of a well-formed wait, or of a well-formed send to an address
    # (of a peer that is not there): a destination that is no address at all is a 400
    address = drawn.destination.startswith(("tcp://", "shm://")) and drawn.destination not in (
        "tcp://host:port",
        "tcp://",
    )
    transport_outcome = (
        drawn.well_formed
        and drawn.method == "POST"
        and (drawn.body_kind == "wait" or (drawn.body_kind == "send" and address))
        and answer.status in (502, 504)
    )
    assert answer.status < 500 or transport_outcome, (drawn, answer)
    if transport_outcome:
        error = answer.json()["error"]
        assert error["kind"] in ("unreachable", "timeout", "transport", "source_lost"), error
    elif answer.status >= 400:
        assert_json_error(answer)


def test_two_hundred_malformed_control_requests_never_get_a_5xx(worker: LiveWorker) -> None:
    seen: dict[int, int] = {}

    @fuzz_settings(200)
    @given(control_request(worker))
    def one(drawn: Drawn) -> None:
        answer = send(worker.port, drawn.method, drawn.path, drawn.headers, drawn.body)
        _check(drawn, answer)
        seen[answer.status] = seen.get(answer.status, 0) + 1

    one()
    print(f"200 control requests: {sorted(seen.items())}")
    assert {200, 201, 400, 401, 404}.issubset(seen), seen


def test_a_send_its_request_dooms_is_400_one_the_transport_fails_502(worker: LiveWorker) -> None:
    """A medium unknown or not offered here, a destination that is no address: the request's
    fault (400, kind transport, as /v1/receive answers). A peer that is not there: the
    transport's (502); nothing arriving in time: 504."""
    headers = [("Authorization", f"Bearer {ADMIN}".encode())]
    layout = {"num_layers": 1, "seq_len": 2, "kv_heads": 1, "head_dim": 2}
    prefill = json.dumps({"model_id": "m", "layout": layout}).encode()
    assert send(worker.port, "POST", "/v1/kv/98/prefill", headers, prefill).status == 201

    def send_to(destination: str, medium: str = "tcp") -> tuple[int, dict[str, str]]:
        body = {"request_id": 98, "destination": destination, "medium": medium, "timeout_s": 1}
        answer = send(worker.port, "POST", "/v1/send", headers, json.dumps(body).encode())
        return answer.status, answer.json()["error"]

    for destination, medium in (
        ("garbage", "tcp"),
        ("tcp://host:port", "tcp"),
        ("tcp://127.0.0.1:1", "carrier-pigeon"),
        ("tcp://127.0.0.1:1", "nixl"),  # not offered by this worker
        ("nothing", "shm"),
    ):
        status, error = send_to(destination, medium)
        assert (status, error["kind"]) == (400, "transport"), (destination, medium, error)
    status, error = send_to("tcp://127.0.0.1:1")
    assert (status, error["kind"]) == (502, "transport"), error
    receive = {"request_id": 97, "model_id": "m", "layout": layout, "medium": "tcp"}
    assert (
        send(worker.port, "POST", "/v1/receive", headers, json.dumps(receive).encode()).status
        == 200
    )
    wait = send(worker.port, "POST", "/v1/kv/97/wait", headers, b'{"timeout_s": 0.05}')
    assert (wait.status, wait.json()["error"]["kind"]) == (504, "timeout")
    for rid in (97, 98):
        assert send(worker.port, "DELETE", f"/v1/kv/{rid}", headers).status == 200


def test_a_send_to_a_host_that_cannot_be_named_is_not_acknowledged(worker: LiveWorker) -> None:
    headers = [("Authorization", f"Bearer {ADMIN}".encode())]
    layout = {"num_layers": 1, "seq_len": 2, "kv_heads": 1, "head_dim": 2}
    prefill = json.dumps({"model_id": "m", "layout": layout}).encode()
    assert send(worker.port, "POST", "/v1/kv/99/prefill", headers, prefill).status == 201
    body = {"request_id": 99, "destination": "tcp://" + "a" * 300 + ":1", "medium": "tcp",
            "timeout_s": 1.0}  # fmt: skip
    answer = send(worker.port, "POST", "/v1/send", headers, json.dumps(body).encode())
    send(worker.port, "DELETE", "/v1/kv/99", headers)
    assert answer.status != 200, answer
