"""The front door's client scope, without vLLM: a client token gets inference answers from
(fake) instances and a 403 naming the rule everywhere else; the admin token still works
everywhere; `topkv token new --scope client` + `topkv router --client-token-file`; what
`vllm up` writes in its run directory and tells applications to use."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web
from router_thread import RouterThread

from topkv.cli.options.auth import front_door_auth
from topkv.integrations.vllm.stack.instances import StackFiles
from topkv.relay.workers import WorkerCapabilities, WorkerInfo
from topkv.service.http.auth import Access, digest_line, new_token, tagged_scope

ADMIN, WORKER = new_token("admin"), new_token("worker")
CLIENT = new_token("client")
TOPKV = [sys.executable, "-c", "from topkv.cli.main import app; app()"]
INFERENCE = [
    ("POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 4}),
    (
        "POST",
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    ),
    ("GET", "/v1/models", None),
]


def _call(
    url: str, token: str | None, body: object = None, method: str | None = None
) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class FakeInstance:
    """A stand-in vLLM instance: answers completions, chats and models, and records the
    Authorization header of every call it gets (the front door must send none)."""

    def __init__(self) -> None:
        self.authorizations: list[str | None] = []
        self.runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    async def complete(self, request: web.Request) -> web.Response:
        self.authorizations.append(request.headers.get("Authorization"))
        params = {"topkv": {"kv_bytes": 64, "verified": True}}
        return web.json_response(
            {"choices": [{"index": 0, "text": "ok"}], "kv_transfer_params": params}
        )

    async def models(self, request: web.Request) -> web.Response:
        self.authorizations.append(request.headers.get("Authorization"))
        return web.json_response({"object": "list", "data": [{"id": "m"}]})


def _instance(worker_id: str, role: str, url: str) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        role=role,  # type: ignore[arg-type]
        node="hostA",
        host_id="hostA",
        capabilities=WorkerCapabilities(media=("shm", "tcp")),
        address="tcp://127.0.0.1:7000",
        control_url=url,
        capacity=4,
    )


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterThread, FakeInstance]]:
    """A front door (client tokens accepted, /metrics protected) over a fake prefill and a
    fake decode instance, registered in its embedded registry."""
    shm = str(tmp_path_factory.mktemp("shm"))
    thread = RouterThread(ADMIN, WORKER, shm, client=CLIENT, protect_metrics=True)
    fake = FakeInstance()
    url = asyncio.run_coroutine_threadsafe(fake.start(), thread.loop).result(10)
    registry = thread.server.registry
    for worker_id, role in (("prefill0", "prefill"), ("decode0", "decode")):
        registry.register(_instance(worker_id, role, url), ttl_s=600)  # type: ignore[union-attr]
    yield thread, fake
    assert fake.runner is not None
    asyncio.run_coroutine_threadsafe(fake.runner.cleanup(), thread.loop).result(10)
    thread.close()


def test_a_client_token_gets_inference_answers(door: tuple[RouterThread, FakeInstance]) -> None:
    router, fake = door
    for method, path, body in INFERENCE:
        for token in (CLIENT, ADMIN):
            status, text = _call(router.url + path, token, body, method)
            assert status == 200, (path, text)
            assert ("ok" in text) if body is not None else ('"m"' in text)
        assert _call(router.url + path, WORKER, body, method)[0] == 403
        assert _call(router.url + path, None, body, method)[0] == 401
    # the front door calls its instances with no credential: it forwards no token
    assert fake.authorizations and set(fake.authorizations) == {None}


def test_a_client_token_is_403_on_every_other_route(
    door: tuple[RouterThread, FakeInstance],
) -> None:
    router, _ = door
    others = [r for r in router.server.router.routes() if r.access is not Access.INFERENCE]
    checked = set()
    for route in others:
        path = route.path.replace("{worker_id}", "decode0")
        body = {} if route.method in ("POST", "PUT") else None
        status, text = _call(router.url + path, CLIENT, body, route.method)
        if route.access is Access.PUBLIC:
            assert status == 200, path
            continue
        assert status == 403, (route.method, path, status, text)
        assert "a client token may call only the inference endpoints" in text
        assert CLIENT not in text
        checked.add((route.method, route.path))
    assert {("GET", "/v1/adp"), ("GET", "/metrics"), ("POST", "/v1/workers")} <= checked
    assert ("DELETE", "/v1/workers/{worker_id}") in checked
    # the admin token still reaches them (the registration is still there: 403 left it)
    assert _call(router.url + "/v1/adp", ADMIN)[0] == 200
    assert _call(router.url + "/metrics", ADMIN)[0] == 200
    assert _call(router.url + "/metrics", WORKER)[0] == 403
    assert [w.worker_id for w in router.server.registry.workers("decode")] == ["decode0"]


def test_front_door_auth_loads_client_tokens_from_the_flag_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = tmp_path / "admin"
    admin.write_text(ADMIN)
    admin.chmod(0o600)
    clients = tmp_path / "clients"
    clients.write_text(f"{CLIENT}\n{digest_line(new_token('client'))}\n")
    clients.chmod(0o600)
    monkeypatch.delenv("TOPKV_CLIENT_TOKEN_FILE", raising=False)
    plain = front_door_auth(admin, None, None, insecure=False, protect_metrics=False)
    assert plain is not None and plain.credentials.client == ()
    assert plain.credentials.authenticate(CLIENT) is None
    flagged = front_door_auth(admin, None, clients, insecure=False, protect_metrics=False)
    monkeypatch.setenv("TOPKV_CLIENT_TOKEN_FILE", str(clients))
    from_env = front_door_auth(admin, None, None, insecure=False, protect_metrics=True)
    for auth in (flagged, from_env):
        assert auth is not None and len(auth.credentials.client) == 2
        principal = auth.credentials.authenticate(CLIENT)
        assert principal is not None and principal.scope == "client"
        assert auth.client_token == ADMIN  # what it presents to the registry: unchanged
    assert from_env is not None and from_env.protect_metrics


def test_token_new_scope_client_and_topkv_router_client_token_file(tmp_path: Path) -> None:
    client_file, admin_file = tmp_path / "client.token", tmp_path / "admin.token"
    made = subprocess.run(
        [*TOPKV, "token", "new", str(client_file), "--scope", "client"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    client = client_file.read_text().strip()
    assert stat.S_IMODE(client_file.stat().st_mode) == 0o600
    assert tagged_scope(client) == "client" and made.stdout.strip() == digest_line(client)
    subprocess.run([*TOPKV, "token", "new", str(admin_file)], check=True, timeout=60)
    admin = admin_file.read_text().strip()
    assert tagged_scope(admin) is None  # the default: untagged, as before
    process = subprocess.Popen(
        [*TOPKV, "router", "--port", "0", "--token-file", str(admin_file),
         "--client-token-file", str(client_file)],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stderr is not None
        line = process.stderr.readline()
        found = re.search(r"on (http://\S+)", line)
        assert found, line
        url = found.group(1)
        body = {"model": "m", "prompt": "x"}
        assert _call(url + "/v1/completions", client, body)[0] == 503  # let in: no instance
        assert _call(url + "/v1/models", client)[0] == 503
        assert _call(url + "/v1/adp", client)[0] == 403
        assert _call(url + "/v1/adp", admin)[0] == 200
        assert _call(url + "/v1/completions", "tkv_client_guess", body)[0] == 401
        process.send_signal(signal.SIGINT)
        assert process.wait(20) == 0
    finally:
        process.kill()
    # the client token given as the admin token: a configuration error, named
    refused = subprocess.run(
        [*TOPKV, "router", "--port", "0", "--token-file", str(client_file)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2
    assert "holds a client token" in refused.stderr and str(client_file) in refused.stderr
    assert client not in refused.stderr and "Traceback" not in refused.stderr


def test_vllm_up_run_dir_holds_a_client_token_and_names_it_as_the_api_key(
    tmp_path: Path,
) -> None:
    files = StackFiles.create(tmp_path)
    assert files.client_file == tmp_path / "client-token"
    for path in (files.client_file, files.admin_file, files.worker_file):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert files.client_file.read_text().strip() == files.client_token
    scopes = [tagged_scope(t) for t in (files.admin_token, files.worker_token, files.client_token)]
    assert scopes == ["admin", "worker", "client"]
    assert len({files.admin_token, files.worker_token, files.client_token}) == 3
    note = files.api_key_note()
    assert note.startswith(f"api_key in {files.client_file}")
    assert files.client_token not in note and files.admin_token not in note
    credentials = files.front_door_auth().credentials
    for token, scope in ((files.client_token, "client"), (files.admin_token, "admin")):
        principal = credentials.authenticate(token)
        assert principal is not None and principal.scope == scope
