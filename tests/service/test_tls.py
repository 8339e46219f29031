"""TLS on the control plane: HTTPS orchestrator and workers, verifying clients, clear errors.

A throwaway CA (``ca``) signs the servers' certificate (for 127.0.0.1 and localhost); a
second CA (``otherca``) and a certificate for another host name play the wrong ones. The
certificates come from the ``openssl`` command (``tests/tls_certs.py``). Workers are
:class:`~topkv.service.worker.service.WorkerService` in the test's event loop; the last test runs
``topkv cluster up --tls``'s processes and ``topkv status --tls-ca``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import pytest

from tls_certs import make_ca, make_leaf, need_openssl
from topkv.errors import ConfigError
from topkv.jsonout import loads_strict
from topkv.relay.executor import AttemptFailed, AttemptPlan
from topkv.relay.registry.memory import MemoryRegistry
from topkv.service.cluster.local import LocalCluster, SmokeLayout, run_smoke
from topkv.service.cluster.tokens import ClusterTokens
from topkv.service.http.auth import Credentials, ServerAuth
from topkv.service.http.tls import ClientTLS, ServerTLS, TLSConfig, TLSFailure
from topkv.service.messages import LayoutModel, PrefillRequest
from topkv.service.orchestrator.api import OrchestratorServiceConfig, serve_orchestrator
from topkv.service.orchestrator.client import OrchestratorClient, http_json
from topkv.service.orchestrator.executor import RemoteExecutor
from topkv.service.worker.registrar import DirectRegistrar, HttpRegistrar
from topkv.service.worker.service import WorkerConfig, WorkerService
from topkv.transport.base import KVLayout

SECRET = b"tls-test-secret-0123456789abcdef"
MODEL = "m"
RID = 7
LAYOUT = SmokeLayout(layers=2, tokens=16, kv_heads=2, head_dim=16)
TOPKV = [sys.executable, "-c", "from topkv.cli.main import app; app()"]
ClusterFactory = Callable[..., LocalCluster]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    need_openssl()
    path = tmp_path_factory.mktemp("pki")
    make_ca(path, "ca")
    make_ca(path, "otherca")
    make_leaf(path, "ca", "server", "serverAuth")
    make_leaf(path, "ca", "elsewhere", "serverAuth", names="DNS:elsewhere.example")
    make_leaf(path, "otherca", "stranger", "serverAuth")
    return path


def _tls(pki: Path, leaf: str = "server", ca: str = "ca") -> TLSConfig:
    config = TLSConfig.from_files(pki / f"{leaf}.crt", pki / f"{leaf}.key", pki / f"{ca}.crt")
    assert config is not None
    return config


def _worker(
    role: str,
    tls: TLSConfig | None,
    *,
    orchestrator: str = "",
    auth: ServerAuth | None = None,
    worker_id: str = "",
) -> WorkerConfig:
    return WorkerConfig(
        role="prefill" if role == "prefill" else "decode",
        node="node-0",
        secret=SECRET,
        worker_id=worker_id or f"{role}0",
        media=("tcp", "shm"),
        orchestrator_url=orchestrator,
        auth=auth,
        tls=tls,
    )


@asynccontextmanager
async def _orchestrator(auth: ServerAuth | None, tls: TLSConfig | None) -> AsyncIterator[str]:
    stop = asyncio.Event()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    config = OrchestratorServiceConfig(auth=auth, tls=tls)
    task = asyncio.create_task(serve_orchestrator(config, "127.0.0.1", 0, stop, ready))
    try:
        yield await asyncio.wait_for(ready, 20)
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)


def test_tls_files_are_checked_and_named_never_shown(
    pki: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cert, key, ca = pki / "server.crt", pki / "server.key", pki / "ca.crt"
    key_text = key.read_text()
    with pytest.raises(ConfigError, match="--tls-cert needs --tls-key too"):
        TLSConfig.from_files(cert, None, ca)
    with pytest.raises(ConfigError, match="--tls-key needs --tls-cert too"):
        TLSConfig.from_files(None, key, None)
    assert TLSConfig.from_files(None, None, None) is None
    only_ca = TLSConfig.from_files(None, None, ca)  # a client-only service (verifies peers)
    assert only_ca is not None and only_ca.serve is None and only_ca.verify.ca_file == ca
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cases: list[tuple[tuple[Path | None, Path | None, Path | None], str]] = [
        (
            (tmp_path / "missing.crt", key, None),
            r"certificate .*missing\.crt \(--tls-cert\): No such",
        ),
        ((tmp_path, key, None), r"\(--tls-cert\) is not a regular file"),
        ((key, key, None), r"server\.key \(--tls-cert\) holds no PEM certificate"),
        ((cert, tmp_path / "missing.key", None), r"missing\.key \(--tls-key\): No such"),
        ((cert, pki / "stranger.key", None), r"stranger\.key \(--tls-key\) is not the key of"),
        ((cert, garbage, None), r"garbage\.pem \(--tls-key\) holds no unencrypted PEM"),
        ((None, None, garbage), r"CA file .*garbage\.pem \(--tls-ca\) holds no PEM"),
        ((None, None, tmp_path / "nope.crt"), r"CA file .*nope\.crt \(--tls-ca\): No such"),
    ]
    for files, message in cases:
        with pytest.raises(ConfigError, match=message) as refused:
            TLSConfig.from_files(*files)
        assert key_text.strip().splitlines()[1] not in str(refused.value)
    loose = tmp_path / "loose.key"
    loose.write_bytes(key.read_bytes())
    os.chmod(loose, 0o644)
    with caplog.at_level(logging.WARNING, logger="topkv.service.http.tls"):
        ServerTLS(cert, loose).context()
    assert any("loose.key is readable by other users" in r.getMessage() for r in caplog.records)


def test_executor_moves_kv_between_https_workers_and_refuses_an_untrusted_ca(pki: Path) -> None:
    layout = KVLayout(num_layers=3, seq_len=16, kv_heads=2, head_dim=16, dtype="fp16")

    async def main() -> None:
        registry = MemoryRegistry()
        async with AsyncExitStack() as stack:
            workers = []
            for role in ("prefill", "decode"):
                worker = WorkerService(_worker(role, _tls(pki)), DirectRegistrar(registry))
                await worker.start()
                stack.push_async_callback(worker.stop)
                assert worker.info is not None and worker.info.control_url.startswith("https://")
                workers.append(worker.info)
            source, destination = workers
            good = RemoteExecutor(tls=ClientTLS(pki / "ca.crt"))
            stack.push_async_callback(good.close)
            body = PrefillRequest(model_id=MODEL, layout=LayoutModel.of(layout), wait=True)
            await asyncio.wait_for(good.prefill(source, RID, body), 20)
            plan = AttemptPlan(RID, MODEL, layout, source, destination, "pcie", 1, 10.0)
            delivery = await asyncio.wait_for(good.transfer(plan), 20)
            held = await good.source_summary(source, RID)
            assert delivery.digest == held.digest != 0
            for tls, trust in (
                (ClientTLS(pki / "otherca.crt"), r"with CA file .*otherca\.crt"),
                (None, "with the system's trust store"),
            ):
                wrong = RemoteExecutor(tls=tls)
                stack.push_async_callback(wrong.close)
                with pytest.raises(AttemptFailed, match=f"TLS verification .* failed {trust}"):
                    await asyncio.wait_for(wrong.source_summary(source, RID), 10)

    asyncio.run(main())


def test_workers_register_over_https_and_the_orchestrator_moves_kv_between_them(
    pki: Path,
) -> None:
    tokens = ClusterTokens()

    def auth(name: str) -> ServerAuth:
        accepted = Credentials.of(admin=[tokens.admin])
        return ServerAuth(accepted, client_token=tokens.worker_token(name))

    async def main() -> None:
        orchestrator_auth = tokens.orchestrator_auth(["prefill", "decode", "stray"])
        async with AsyncExitStack() as stack:
            url = await stack.enter_async_context(_orchestrator(orchestrator_auth, _tls(pki)))
            assert url.startswith("https://127.0.0.1:")
            for role in ("prefill", "decode"):
                config = _worker(role, _tls(pki), orchestrator=url, auth=auth(role))
                worker = WorkerService(config)  # registers through HttpRegistrar, over https
                await asyncio.wait_for(worker.start(), 20)
                stack.push_async_callback(worker.stop)
            client = OrchestratorClient(url, token=tokens.admin, tls=ClientTLS(pki / "ca.crt"))
            listed = await asyncio.to_thread(client.wait_workers, 1, 1, 10)
            assert all(w["worker"]["control_url"].startswith("https://") for w in listed)
            await asyncio.to_thread(client.submit, request_id=1, model="m", layout=LAYOUT.as_json())
            record = await asyncio.to_thread(client.wait_done, 1, 30)
            assert record["state"] == "delivered", record
            assert record["decode_check"]["matches_source"]
            # A registrar that trusts another CA cannot register; nor can plain http.
            stray = auth("stray")
            for registrar, message in (
                (HttpRegistrar(url, stray.client_token, ClientTLS(pki / "otherca.crt")), "TLS"),
                (
                    HttpRegistrar(url.replace("https://", "http://"), stray.client_token),
                    "closed the connection without an HTTP answer: if it serves TLS, use https",
                ),
            ):
                config = _worker("decode", None, auth=stray, worker_id="stray0")
                worker = WorkerService(config, registrar)
                with pytest.raises(TLSFailure, match=message):
                    await asyncio.wait_for(worker.start(), 10)
                await worker.stop()
            assert len(await asyncio.to_thread(client.workers)) == 2

    asyncio.run(main())


def test_plain_http_against_https_and_the_wrong_certificate_fail_clearly(pki: Path) -> None:
    ca = ClientTLS(pki / "ca.crt")

    async def main() -> None:
        async with (
            _orchestrator(None, _tls(pki)) as https,
            _orchestrator(None, None) as plain,
            _orchestrator(None, _tls(pki, "elsewhere")) as elsewhere,
            _orchestrator(None, _tls(pki, "stranger", "otherca")) as stranger,
        ):
            assert await asyncio.to_thread(http_json, "GET", f"{https}/healthz", tls=ca)
            cases = [
                (https.replace("https://", "http://"), None, "if it serves TLS, use https://"),
                (plain.replace("http://", "https://"), ca, "does not speak TLS: use http://"),
                (elsewhere, ca, "certificate is not issued to 127.0.0.1"),
                (stranger, ca, r"TLS verification .* failed with CA file .*ca\.crt"),
                (https, None, "failed with the system's trust store .*give the CA .* --tls-ca"),
            ]
            for url, tls, message in cases:
                with pytest.raises(TLSFailure, match=message):
                    await asyncio.to_thread(
                        http_json, "GET", f"{url}/healthz", timeout_s=5, tls=tls
                    )

    asyncio.run(main())


def _status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TOPKV, "status", "--json", *args], capture_output=True, text=True, timeout=60
    )


def test_cluster_up_tls_serves_https_and_status_verifies_with_the_ca(
    make_cluster: ClusterFactory,
) -> None:
    cluster = make_cluster(prefill=1, decode=1, tls=True)
    assert cluster.orchestrator_url.startswith("https://") and cluster.pki is not None
    described = cluster.describe()
    assert described["tls"] == {"ca_file": str(cluster.pki.ca_file)}
    assert all(w["control_url"].startswith("https://") for w in described["workers"])
    tls_dir = cluster.pki.ca_file.parent
    assert stat.S_IMODE(cluster.pki.key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(tls_dir.stat().st_mode) == 0o700
    assert not (tls_dir / "ca.key").exists(), "the throwaway CA's key outlived the signing"
    report = run_smoke(cluster.client(), 1, LAYOUT)
    assert report["verified"] == 1
    assert cluster.token_files is not None
    token = ["--token-file", str(cluster.token_files.admin)]
    url = ["--orchestrator", cluster.orchestrator_url]
    done = _status(*url, *token, "--tls-ca", str(cluster.pki.ca_file))
    assert done.returncode == 0, done.stderr
    status = loads_strict(done.stdout)
    assert len(status["workers"]) == 2 and len(status["transfers"]["transfers"]) == 1
    refused = _status(*url, *token)  # no --tls-ca: the system's store does not know the CA
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "TLS verification of the server's certificate failed" in refused.stderr
    assert "--tls-ca" in refused.stderr
    plain = cluster.orchestrator_url.replace("https://", "http://")
    refused = _status("--orchestrator", plain, *token)
    assert refused.returncode == 2 and "if it serves TLS, use https://" in refused.stderr
