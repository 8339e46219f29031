"""The etcd registry against real etcd servers with authentication and with TLS.

Each server here is this module's own (the shared ``etcd_url`` server stays open to the
other tests): one with ``auth enable`` (root, a worker user with readwrite on ``/topkv/``,
one with no role; tokens live 2 s so a refresh happens), one serving TLS, one requiring
client certificates. A throwaway CA and certificates come from the ``openssl`` command
(``tests/tls_certs.py``); the servers are ``tests/etcd_servers.py``'s.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from etcd_servers import (
    OTHER_PASSWORD,
    WORKER_PASSWORD,
    enable_auth,
    start_etcd,
    stop_etcd,
)
from tls_certs import make_ca, make_leaf, need_openssl
from topkv.relay.registry.etcd import EtcdRegistry
from topkv.relay.registry.etcd_session import EtcdSession
from topkv.relay.registry.memory import RegistryError, open_registry
from topkv.relay.workers import RegistryEvent, WorkerInfo

pytestmark = pytest.mark.etcd

TOKEN_TTL_S = 2


def _info(worker_id: str, capacity: int = 4) -> WorkerInfo:
    return WorkerInfo.model_validate(
        {"worker_id": worker_id, "role": "decode", "node": "n0", "gpus": [0], "capacity": capacity}
    )


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="topkv-etcd-live-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def auth_port(workdir: Path) -> Iterator[int]:
    etcd = start_etcd(workdir, "auth", extra=(f"--auth-token-ttl={TOKEN_TTL_S}",))
    try:
        enable_auth(etcd.port)
        yield etcd.port
    finally:
        stop_etcd(etcd)


@pytest.fixture(scope="module")
def certs(workdir: Path) -> Path:
    """ca (signs server + client), otherca (signs stranger); the server cert also allows
    clientAuth: etcd's gateway dials etcd itself with it when client certs are required."""
    need_openssl()
    path = workdir / "certs"
    path.mkdir()
    make_ca(path, "ca")
    make_ca(path, "otherca")
    make_leaf(path, "ca", "server", "serverAuth,clientAuth")
    make_leaf(path, "ca", "client", "clientAuth")
    make_leaf(path, "otherca", "stranger", "clientAuth")
    return path


def _server_tls(certs: Path) -> tuple[Path, Path, Path]:
    return certs / "ca.crt", certs / "server.crt", certs / "server.key"


@pytest.fixture(scope="module")
def tls_port(workdir: Path, certs: Path) -> Iterator[int]:
    etcd = start_etcd(workdir, "tls", tls=_server_tls(certs))
    try:
        yield etcd.port
    finally:
        stop_etcd(etcd)


@pytest.fixture(scope="module")
def mtls_port(workdir: Path, certs: Path) -> Iterator[int]:
    etcd = start_etcd(
        workdir,
        "mtls",
        tls=_server_tls(certs),
        client_cert=(str(certs / "client.crt"), str(certs / "client.key")),
        extra=("--client-cert-auth", f"--trusted-ca-file={certs / 'ca.crt'}"),
    )
    try:
        yield etcd.port
    finally:
        stop_etcd(etcd)


class _Events:
    def __init__(self) -> None:
        self.events: list[RegistryEvent] = []
        self._cond = threading.Condition()

    def __call__(self, event: RegistryEvent) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def wait_for(self, pred: Callable[[list[RegistryEvent]], bool], timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not pred(self.events):
                left = deadline - time.monotonic()
                assert left > 0, f"timed out; events so far: {self.events}"
                self._cond.wait(left)


def _register_list_heartbeat(registry: EtcdRegistry, worker_id: str) -> None:
    registration = registry.register(_info(worker_id), ttl_s=30)
    try:
        assert worker_id in [w.worker_id for w in registry.workers()]
        registration.heartbeat()
    finally:
        registration.deregister()
        registry.close()


def test_etcd_auth_without_credentials_cannot_register(auth_port: int) -> None:
    registry = EtcdRegistry.from_url(f"etcd://127.0.0.1:{auth_port}", env={})
    with pytest.raises(RegistryError, match="has authentication enabled and this registry has no"):
        registry.register(_info("intruder"))
    with pytest.raises(RegistryError, match=r"no credentials.*TOPKV_ETCD_PASSWORD"):
        registry.workers()
    registry.close()


def test_etcd_auth_worker_registers_lists_heartbeats_and_watches(
    auth_port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret_file = tmp_path / "etcd-password"
    secret_file.write_text(WORKER_PASSWORD + "\n")
    monkeypatch.delenv("TOPKV_ETCD_PASSWORD", raising=False)
    monkeypatch.setenv("TOPKV_ETCD_PASSWORD_FILE", str(secret_file))
    logins: list[str] = []
    authenticate = EtcdSession._authenticate

    def counting(session: EtcdSession, auth_url: str) -> str | None:
        logins.append(auth_url)
        return authenticate(session, auth_url)

    monkeypatch.setattr(EtcdSession, "_authenticate", counting)
    registry = open_registry(f"etcd://worker@127.0.0.1:{auth_port}")
    events = _Events()
    registry.watch(events)
    time.sleep(0.2)  # let the watch stream open
    registration = registry.register(_info("w1"), ttl_s=30)
    events.wait_for(lambda evs: any(e.kind == "join" and e.worker_id == "w1" for e in evs))
    assert [w.worker_id for w in registry.workers()] == ["w1"]
    registration.heartbeat()
    # Idle past the token's TTL: the next calls log in again by themselves.
    time.sleep(TOKEN_TTL_S + 1.5)
    assert len(logins) == 1
    registration.update(_info("w1", capacity=9))
    got = registry.get("w1")
    assert got is not None and got.capacity == 9
    assert len(logins) == 2, "the expired token was not renewed"
    events.wait_for(lambda evs: any(e.kind == "update" for e in evs))
    registration.deregister()
    events.wait_for(lambda evs: any(e.kind == "leave" and e.worker_id == "w1" for e in evs))
    assert registry.workers() == []
    registry.close()


def test_etcd_auth_wrong_password_is_named(auth_port: int) -> None:
    wrong = "wrong-Zx9-guess"
    with pytest.raises(RegistryError, match="refused the login of user 'worker': wrong user") as e:
        EtcdRegistry.from_url(
            f"etcd://worker@127.0.0.1:{auth_port}", env={"TOPKV_ETCD_PASSWORD": wrong}
        )
    assert wrong not in str(e.value)
    inline = f"etcd://worker:{wrong}@127.0.0.1:{auth_port}"
    with pytest.raises(RegistryError, match="wrong user name or password") as e:
        EtcdRegistry.from_url(inline, env={})
    assert wrong not in str(e.value)


def test_etcd_auth_permission_denied_is_named(auth_port: int) -> None:
    registry = EtcdRegistry.from_url(
        f"etcd://other@127.0.0.1:{auth_port}", env={"TOPKV_ETCD_PASSWORD": OTHER_PASSWORD}
    )
    with pytest.raises(
        RegistryError, match=r"user 'other' was denied writing .* '/topkv/workers/'.*grant"
    ):
        registry.register(_info("w2"))
    registry.close()


def test_etcd_tls_registers_with_the_ca(tls_port: int, certs: Path) -> None:
    ca = str(certs / "ca.crt")
    url = f"etcds://127.0.0.1:{tls_port}"
    _register_list_heartbeat(EtcdRegistry.from_url(url, env={"TOPKV_ETCD_CA": ca}), "t1")
    _register_list_heartbeat(EtcdRegistry.from_url(f"{url}/q?ca={ca}", env={}), "t2")


def test_etcd_tls_untrusted_ca_or_plain_http_fails(tls_port: int, certs: Path) -> None:
    other = str(certs / "otherca.crt")
    with pytest.raises(RegistryError, match=r"TLS verification of etcd's certificate .* failed"):
        EtcdRegistry.from_url(f"etcds://127.0.0.1:{tls_port}?ca={other}", env={})
    with pytest.raises(RegistryError, match="if it serves TLS, use etcds://"):
        EtcdRegistry.from_url(f"etcd://127.0.0.1:{tls_port}", env={})


def test_etcd_mutual_tls(mtls_port: int, certs: Path) -> None:
    url = f"etcds://127.0.0.1:{mtls_port}"
    env = {
        "TOPKV_ETCD_CA": str(certs / "ca.crt"),
        "TOPKV_ETCD_CERT": str(certs / "client.crt"),
        "TOPKV_ETCD_KEY": str(certs / "client.key"),
    }
    _register_list_heartbeat(EtcdRegistry.from_url(url, env=env), "m1")
    no_cert = {"TOPKV_ETCD_CA": env["TOPKV_ETCD_CA"]}
    with pytest.raises(RegistryError, match="requires a client certificate"):
        EtcdRegistry.from_url(url, env=no_cert)
    stranger = {
        **no_cert,
        "TOPKV_ETCD_CERT": str(certs / "stranger.crt"),
        "TOPKV_ETCD_KEY": str(certs / "stranger.key"),
    }
    with pytest.raises(RegistryError, match="refused the client certificate"):
        EtcdRegistry.from_url(url, env=stranger)
