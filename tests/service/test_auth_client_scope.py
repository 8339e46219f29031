"""The client scope on the control plane: each :class:`Access` admits exactly its scopes
(a client token only the inference endpoints), the orchestrator's API and a worker's
control API refuse a client token (they never load client tokens), and a token tagged with
one scope is refused in another scope's file with a message naming the file, not the token."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from topkv.cli.options.auth import orchestrator_auth, worker_auth
from topkv.errors import ConfigError
from topkv.harness.inprocess_cluster import InProcessCluster, WorkerSpec
from topkv.relay.registry.memory import MemoryRegistry
from topkv.service.cluster.tokens import ClusterTokens
from topkv.service.http.auth import (
    Access,
    Credentials,
    Route,
    ServerAuth,
    auth_headers,
    digest_line,
    new_token,
    read_token,
    secured_app,
    tagged_scope,
    write_token_file,
)
from topkv.service.orchestrator.api import OrchestratorServiceConfig, serve_orchestrator

TOPKV = [sys.executable, "-c", "from topkv.cli.main import app; app()"]
ADMIN, WORKER, CLIENT = new_token("admin"), new_token("worker"), new_token("client")

#: What each scope gets on an endpoint of each access (metrics protected): 200 or 403.
EXPECTED = {
    Access.PUBLIC: {"admin": 200, "worker": 200, "client": 200},
    Access.METRICS: {"admin": 200, "worker": 403, "client": 403},
    Access.WORKER: {"admin": 200, "worker": 200, "client": 403},
    Access.INFERENCE: {"admin": 200, "worker": 403, "client": 200},
    Access.ADMIN: {"admin": 200, "worker": 403, "client": 403},
}


def test_each_access_admits_exactly_its_scopes() -> None:
    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    routes = [Route("GET", f"/{access.value}", ok, access) for access in Access]
    credentials = Credentials.of(admin=[ADMIN], worker=[WORKER], client=[digest_line(CLIENT)])
    app = secured_app(routes, ServerAuth(credentials, protect_metrics=True))
    tokens = {"admin": ADMIN, "worker": WORKER, "client": CLIENT}

    async def main() -> None:
        async with TestServer(app) as server, aiohttp.ClientSession() as http:
            for access, by_scope in EXPECTED.items():
                for scope, want in by_scope.items():
                    url = str(server.make_url(f"/{access.value}"))
                    async with http.get(url, headers=auth_headers(tokens[scope])) as answer:
                        assert answer.status == want, (access, scope)
                        text = await answer.text()
                    if want == 403:
                        assert "needs" in text and tokens[scope] not in text
                        rule = "a client token may call only the inference endpoints"
                        assert (rule in text) == (scope == "client")
                if access is not Access.PUBLIC:
                    async with http.get(str(server.make_url(f"/{access.value}"))) as answer:
                        assert answer.status == 401

    asyncio.run(main())


def test_a_token_in_several_scopes_counts_as_the_strongest() -> None:
    both = new_token()
    credentials = Credentials.of(admin=[both], client=[both])
    principal = credentials.authenticate(both)
    assert principal is not None and principal.scope == "admin"
    principal = Credentials.of(worker=[both], client=[both]).authenticate(both)
    assert principal is not None and principal.scope == "worker"


def test_the_orchestrator_and_a_worker_refuse_a_client_token() -> None:
    tokens = ClusterTokens()
    request = {"model": "m", "layout": {"num_layers": 1, "seq_len": 1, "kv_heads": 1,
                                        "head_dim": 1}}  # fmt: skip
    worker = {"worker": {"worker_id": "w0", "role": "decode", "node": "n0"}, "ttl_s": 30}

    async def status(http: aiohttp.ClientSession, method: str, url: str, body: object) -> int:
        async with http.request(method, url, json=body, headers=auth_headers(CLIENT)) as r:
            text = await r.text()
            assert CLIENT not in text
            return r.status

    async def main() -> None:
        stop = asyncio.Event()
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        config = OrchestratorServiceConfig(auth=tokens.orchestrator_auth(["w0"]))
        task = asyncio.create_task(serve_orchestrator(config, "127.0.0.1", 0, stop, ready))
        try:
            url = await asyncio.wait_for(ready, 30)
            async with aiohttp.ClientSession() as http:
                calls = [
                    ("POST", "/v1/workers", worker),
                    ("PUT", "/v1/workers/w0/heartbeat", None),
                    ("DELETE", "/v1/workers/w0", None),
                    ("GET", "/v1/workers", None),
                    ("POST", "/v1/requests", request),
                    ("GET", "/v1/transfers", None),
                    ("GET", "/v1/topology", None),
                    ("GET", "/v1/adp", None),
                ]
                for method, path, body in calls:
                    assert await status(http, method, url + path, body) == 401, path
        finally:
            stop.set()
            await task
        async with InProcessCluster(MemoryRegistry()) as cluster:
            await cluster.start([WorkerSpec("decode", "n0", 0, worker_id="d0")])
            control = cluster.info("d0").control_url
            async with aiohttp.ClientSession() as http:
                for method, path, body in (
                    ("GET", "/v1/info", None),
                    ("GET", "/v1/kv", None),
                    ("POST", "/v1/role", {"role": "prefill"}),
                    ("POST", "/v1/send", {}),
                ):
                    assert await status(http, method, control + path, body) == 401, path

    asyncio.run(main())


def test_the_orchestrator_and_workers_never_load_client_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = write_token_file(tmp_path / "admin", ADMIN)
    worker = write_token_file(tmp_path / "worker", WORKER)
    control = write_token_file(tmp_path / "control", digest_line(ADMIN))
    clients = write_token_file(tmp_path / "clients", CLIENT)
    monkeypatch.setenv("TOPKV_CLIENT_TOKEN_FILE", str(clients))
    for auth in (
        orchestrator_auth(admin, worker, insecure=False, protect_metrics=False),
        worker_auth(worker, control, insecure=False, needs_token=True),
    ):
        assert auth is not None and auth.credentials.client == ()
        assert auth.credentials.authenticate(CLIENT) is None


def test_a_misfiled_tagged_token_is_refused_naming_the_file(tmp_path: Path) -> None:
    for scope, wrong in (("admin", CLIENT), ("worker", ADMIN), ("client", WORKER)):
        with pytest.raises(ConfigError, match=f"where {scope} tokens belong") as refused:
            Credentials.of(**{scope: [wrong]})
        assert wrong not in str(refused.value)
    # untagged tokens and digests go anywhere (tokens made before scopes had tags)
    untagged = new_token()
    assert tagged_scope(untagged) is None
    Credentials.of(admin=[untagged], worker=[untagged], client=[digest_line(CLIENT)])
    client_file = write_token_file(tmp_path / "client-token", CLIENT)
    with pytest.raises(ConfigError, match="holds a client token") as refused:
        Credentials.from_files(client_file)
    assert str(client_file) in str(refused.value) and CLIENT not in str(refused.value)
    assert "--client-token-file" in str(refused.value)
    with pytest.raises(ConfigError, match="holds a client token"):
        read_token(client_file, "admin token file", scope="admin")
    assert read_token(client_file) == CLIENT  # a client reads its own token
    # a worker whose control-token file holds a client token does not start
    with pytest.raises(ConfigError, match="holds a client token"):
        worker_auth(None, client_file, insecure=False, needs_token=False)
    # nor does an orchestrator given it as its admin token
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOPKV_")}
    done = subprocess.run(
        [*TOPKV, "orchestrator", "--port", "0", "--token-file", str(client_file)],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert done.returncode == 2 and "holds a client token" in done.stderr
    assert CLIENT not in done.stderr and "Traceback" not in done.stderr
