"""Bearer tokens and scopes on the control plane: 401 without a valid token, 403 for the
wrong scope or another worker's id, token files written 0600, and the unsafe mode only on
request. Against a live orchestrator (in this process and as ``topkv cluster up``)."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from topkv.errors import ConfigError
from topkv.service.cluster.tokens import ClusterTokens
from topkv.service.http.auth import (
    Credentials,
    ServerAuth,
    auth_headers,
    digest_line,
    new_token,
    read_token,
    read_token_lines,
    write_token_file,
)
from topkv.service.orchestrator.api import OrchestratorServiceConfig, serve_orchestrator

TOPKV = [sys.executable, "-c", "from topkv.cli.main import app; app()"]


def _worker(worker_id: str) -> dict[str, Any]:
    return {"worker": {"worker_id": worker_id, "role": "decode", "node": "n0"}, "ttl_s": 30}


# -- tokens and files ------------------------------------------------------------------------


def test_credentials_tell_scopes_apart_and_accept_digests() -> None:
    admin, worker = new_token(), new_token()
    credentials = Credentials.of(admin=[digest_line(admin)], worker=[worker])
    admin_principal = credentials.authenticate(admin)
    worker_principal = credentials.authenticate(worker)
    assert admin_principal is not None and admin_principal.scope == "admin"
    assert worker_principal is not None and worker_principal.scope == "worker"
    assert credentials.authenticate(new_token()) is None
    assert credentials.authenticate(admin + "x") is None
    assert Credentials().authenticate(admin) is None
    with pytest.raises(ConfigError, match="64 hex"):
        Credentials.of(admin=["sha256:beef"])


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_only_the_exact_token_authenticates(candidate: str) -> None:
    token = "tkv_fixed-token-for-the-property"
    credentials = Credentials.of(admin=[token])
    principal = credentials.authenticate(candidate)
    assert (principal is not None) == (candidate == token)


def test_token_files_are_0600_and_bad_ones_are_named(tmp_path: Path) -> None:
    path = write_token_file(tmp_path / "sub" / "token", "tkv_abc")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_token(path) == "tkv_abc"
    loose = tmp_path / "loose"
    loose.write_text("tkv_abc\n")
    os.chmod(loose, 0o644)
    write_token_file(loose, "tkv_new")  # an existing file is tightened, not left 0644
    assert stat.S_IMODE(loose.stat().st_mode) == 0o600
    cases = {
        "empty": (b"\n\n", "is empty"),
        "binary": (b"\xff\xfe", "non-ASCII"),
        "spaces": (b"two words\n", "not a token"),
    }
    for name, (content, message) in cases.items():
        bad = tmp_path / name
        bad.write_bytes(content)
        with pytest.raises(ConfigError, match=message):
            read_token_lines(bad)
    with pytest.raises(ConfigError, match="regular file"):
        read_token_lines(tmp_path)
    with pytest.raises(ConfigError, match="cannot read"):
        read_token_lines(tmp_path / "missing")
    two = tmp_path / "two"
    two.write_text("tkv_a\ntkv_b\n")
    with pytest.raises(ConfigError, match="exactly one token"):
        read_token(two)


# -- a live orchestrator ---------------------------------------------------------------------


@asynccontextmanager
async def _orchestrator(auth: ServerAuth | None) -> AsyncIterator[str]:
    stop = asyncio.Event()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        serve_orchestrator(OrchestratorServiceConfig(auth=auth), "127.0.0.1", 0, stop, ready)
    )
    try:
        yield await asyncio.wait_for(ready, 30)
    finally:
        stop.set()
        await task


async def _call(
    http: aiohttp.ClientSession, method: str, url: str, token: str | None, body: Any = None
) -> tuple[int, Any, dict[str, str]]:
    async with http.request(method, url, json=body, headers=auth_headers(token)) as answer:
        text = await answer.text()
        payload = json.loads(text) if text.startswith(("{", "[")) else text
        return answer.status, payload, dict(answer.headers)


def test_orchestrator_answers_401_403_and_binds_worker_ids_to_their_tokens() -> None:
    tokens = ClusterTokens()
    mine, other = tokens.worker_token("worker-a"), tokens.worker_token("worker-b")

    async def main() -> None:
        async with (
            _orchestrator(tokens.orchestrator_auth(["worker-a", "worker-b"])) as url,
            aiohttp.ClientSession() as http,
        ):

            async def call(method: str, path: str, token: str | None, body: Any = None) -> int:
                status, _, headers = await _call(http, method, url + path, token, body)
                if status == 401:
                    assert headers.get("WWW-Authenticate", "").startswith("Bearer")
                return status

            request = {"model": "m", "layout": {"num_layers": 1, "seq_len": 1, "kv_heads": 1,
                                                "head_dim": 1}}  # fmt: skip
            # the attack, with no credentials and with a made-up one
            for token in (None, "tkv_guess"):
                assert await call("POST", "/v1/workers", token, _worker("evil")) == 401
                assert await call("DELETE", "/v1/workers/decode-0", token) == 401
                assert await call("POST", "/v1/requests", token, request) == 401
                assert await call("GET", "/v1/workers", token) == 401
            # probes, the schema and (by default) the metrics stay open
            for path in ("/healthz", "/readyz", "/openapi.json", "/metrics"):
                assert await call("GET", path, None) in (200, 503), path
            # a worker token: its own registration only, nothing admin
            assert await call("POST", "/v1/workers", mine, _worker("w-a")) == 201
            assert await call("PUT", "/v1/workers/w-a/heartbeat", mine) == 200
            assert await call("POST", "/v1/workers", other, _worker("w-a")) == 403
            assert await call("PUT", "/v1/workers/w-a/heartbeat", other) == 403
            assert await call("DELETE", "/v1/workers/w-a", other) == 403
            assert await call("POST", "/v1/requests", mine, request) == 403
            assert await call("GET", "/v1/transfers", mine) == 403
            assert await call("GET", "/v1/topology", mine) == 403
            status, listing, _ = await _call(http, "GET", url + "/v1/workers", tokens.admin)
            assert status == 200
            assert [w["worker"]["worker_id"] for w in listing["workers"]] == ["w-a"]
            # the owner may leave; then the id is free for another token
            assert await call("DELETE", "/v1/workers/w-a", mine) == 204
            assert await call("POST", "/v1/workers", other, _worker("w-a")) == 201
            # admin deletes any worker
            assert await call("DELETE", "/v1/workers/w-a", tokens.admin) == 204
            status, listing, _ = await _call(http, "GET", url + "/v1/workers", tokens.admin)
            assert listing["workers"] == []

    asyncio.run(main())


def test_protected_metrics_need_an_admin_token() -> None:
    tokens = ClusterTokens()
    auth = ServerAuth(
        Credentials.of(admin=[tokens.admin], worker=[tokens.worker]),
        client_token=tokens.admin,
        protect_metrics=True,
    )

    async def main() -> None:
        async with _orchestrator(auth) as url, aiohttp.ClientSession() as http:
            statuses = [
                (await _call(http, "GET", url + "/metrics", token))[0]
                for token in (None, tokens.worker, tokens.admin)
            ]
            assert statuses == [401, 403, 200]
            assert (await _call(http, "GET", url + "/healthz", None))[0] == 200

    asyncio.run(main())


def test_a_server_runs_open_only_when_told_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError, match="auth=None"):
        OrchestratorServiceConfig()

    async def main() -> None:
        async with _orchestrator(None) as url, aiohttp.ClientSession() as http:
            status, _, _ = await _call(http, "POST", url + "/v1/workers", None, _worker("w"))
            assert status == 201

    with caplog.at_level("WARNING"):
        asyncio.run(main())
    assert "authentication is OFF" in caplog.text


def test_orchestrator_command_without_a_token_says_what_to_do(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TOPKV_TOKEN_FILE"}
    done = subprocess.run(
        [*TOPKV, "orchestrator", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2
    assert "--token-file" in done.stderr and "--insecure-no-auth" in done.stderr
    assert "Traceback" not in done.stderr


# -- topkv cluster up ------------------------------------------------------------------------


def _status(url: str, token: str | None = None, method: str = "GET", body: Any = None) -> int:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers=auth_headers(token))
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def test_cluster_up_writes_0600_tokens_before_ready_and_refuses_the_attack(
    tmp_path: Path,
) -> None:
    proc = subprocess.Popen(
        [*TOPKV, "cluster", "up", "--prefill", "1", "--decode", "1", "--port", "0",
         "--run-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        ready_file = tmp_path / "orchestrator.ready.json"
        deadline = time.monotonic() + 90
        while not ready_file.exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the orchestrator did not come up"
            time.sleep(0.05)
        url = json.loads(ready_file.read_text())["url"]
        # the token files exist, 0600, before /readyz answers 200 (they were there first)
        for name in ("token", "worker-token"):
            path = tmp_path / name
            assert path.is_file() and stat.S_IMODE(path.stat().st_mode) == 0o600, name
        while _status(url + "/readyz") != 200:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the cluster never became ready"
            time.sleep(0.1)
        admin = (tmp_path / "token").read_text().strip()
        worker = (tmp_path / "worker-token").read_text().strip()
        evil = _worker("evil")
        assert _status(url + "/v1/workers", None, "POST", evil) == 401
        assert _status(url + "/v1/workers/decode-n", None, "DELETE") == 401
        listing = json.loads(
            urllib.request.urlopen(
                urllib.request.Request(url + "/v1/workers", headers=auth_headers(admin)),
                timeout=5,
            ).read()
        )
        real = [w["worker"]["worker_id"] for w in listing["workers"]]
        assert len(real) == 2
        # the cluster's worker token is not the workers' own: it cannot remove them
        for worker_id in real:
            assert _status(f"{url}/v1/workers/{worker_id}", worker, "DELETE") == 403
        request = {"model": "m", "layout": {"num_layers": 1, "seq_len": 1, "kv_heads": 1,
                                            "head_dim": 1}}  # fmt: skip
        assert _status(url + "/v1/requests", worker, "POST", request) == 403
        assert _status(url + "/v1/requests", admin, "POST", request) == 202
        # every secret stayed out of the logs
        logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.log"))
        assert admin not in logs and worker not in logs
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_deployment_by_hand_with_token_files(tmp_path: Path) -> None:
    """``topkv token new`` files wired into an orchestrator and two workers by their flags;
    the workers hold only their worker token and the admin token's digest."""

    def run(*args: str) -> str:
        done = subprocess.run([*TOPKV, *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    admin_file, worker_file = tmp_path / "admin.token", tmp_path / "worker.token"
    digest = run("token", "new", str(admin_file))
    run("token", "new", str(worker_file))
    control = write_token_file(tmp_path / "control.sha256", digest)
    assert run("token", "digest", str(admin_file)) == digest
    processes: list[subprocess.Popen[str]] = []
    env = {**os.environ, "TOPKV_SECRET": "hand-made-deployment-secret"}
    try:
        ready = tmp_path / "orchestrator.json"
        processes.append(
            subprocess.Popen(
                [
                    *TOPKV,
                    "orchestrator",
                    "--port",
                    "0",
                    "--ready-file",
                    str(ready),
                    "--token-file",
                    str(admin_file),
                    "--worker-token-file",
                    str(worker_file),
                ],
                env=env,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline and processes[0].poll() is None
            time.sleep(0.05)
        url = json.loads(ready.read_text())["url"]
        for gpu, role in enumerate(("prefill", "decode")):
            processes.append(
                subprocess.Popen(
                    [
                        *TOPKV,
                        "worker",
                        "--role",
                        role,
                        "--gpu",
                        str(gpu),
                        "--orchestrator",
                        url,
                        "--control-token-file",
                        str(control),
                    ],
                    env={**env, "TOPKV_TOKEN_FILE": str(worker_file)},
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        admin = read_token(admin_file)
        while _status(url + "/readyz") != 200:
            assert time.monotonic() < deadline, "the workers did not register"
            assert all(p.poll() is None for p in processes)
            time.sleep(0.1)
        request = {
            "request_id": 1,
            "model": "m",
            "layout": {"num_layers": 2, "seq_len": 8, "kv_heads": 1, "head_dim": 8},
        }
        assert _status(url + "/v1/requests", admin, "POST", request) == 202
        while True:
            answer = urllib.request.urlopen(
                urllib.request.Request(url + "/v1/requests/1", headers=auth_headers(admin)),
                timeout=5,
            )
            record = json.loads(answer.read())
            if record["decode_check"] is not None:
                break
            assert time.monotonic() < deadline, record
            time.sleep(0.1)
        assert record["state"] == "delivered" and record["decode_check"]["matches_source"]
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
