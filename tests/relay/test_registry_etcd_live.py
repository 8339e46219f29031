"""The etcd registry against real etcd servers with authentication and with TLS.

Each server here is this module's own (the shared ``etcd_url`` server stays open to the
other tests): one with ``auth enable`` (root, a worker user with readwrite on ``/topkv/``,
one with no role; tokens live 2 s so a refresh happens), one serving TLS, one requiring
client certificates. A throwaway CA and certificates come from the ``openssl`` command.
"""

from __future__ import annotations

import base64
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from topkv.relay.etcd_session import EtcdSession
from topkv.relay.registry import RegistryError, open_registry
from topkv.relay.registry_etcd import EtcdRegistry
from topkv.relay.workers import RegistryEvent, WorkerInfo

pytestmark = pytest.mark.etcd

ROOT_PASSWORD = "root-Zx9-pw"
WORKER_PASSWORD = "worker-Zx9-pw"
OTHER_PASSWORD = "other-Zx9-pw"
TOKEN_TTL_S = 2


def _info(worker_id: str, capacity: int = 4) -> WorkerInfo:
    return WorkerInfo.model_validate(
        {"worker_id": worker_id, "role": "decode", "node": "n0", "gpus": [0], "capacity": capacity}
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class _Etcd:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path


def _start_etcd(
    workdir: Path,
    name: str,
    *,
    tls: tuple[Path, Path, Path] | None = None,
    client_cert: tuple[str, str] | None = None,
    extra: tuple[str, ...] = (),
) -> _Etcd:
    """etcd on free loopback ports; ``tls`` = (ca, server cert, server key) serves HTTPS."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd binary not installed (apt-get install etcd-server); .ci/run installs it")
    client_port, peer_port = _free_port(), _free_port()
    client = f"{'https' if tls else 'http'}://127.0.0.1:{client_port}"
    peer = f"http://127.0.0.1:{peer_port}"
    args = [
        binary,
        f"--name={name}",
        f"--data-dir={workdir / name}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster={name}={peer}",
        *extra,
    ]
    if tls is not None:
        args += [f"--cert-file={tls[1]}", f"--key-file={tls[2]}"]
    log = workdir / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    etcd = _Etcd(proc, client_port, log)
    verify: str | bool = str(tls[0]) if tls else True
    deadline = time.monotonic() + 20
    while True:
        try:
            if requests.get(f"{client}/health", timeout=1, verify=verify, cert=client_cert).ok:
                return etcd
        except requests.RequestException:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(etcd)
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"etcd {name} did not become healthy within 20 s:\n{tail}")
        time.sleep(0.1)


def _stop(etcd: _Etcd) -> None:
    etcd.proc.terminate()
    try:
        etcd.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        etcd.proc.kill()
        etcd.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="topkv-etcd-live-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _enable_auth(port: int) -> None:
    """Users root, worker (readwrite on /topkv/) and other (no role); then ``auth enable``."""
    base = f"http://127.0.0.1:{port}/v3/auth"
    calls: list[tuple[str, dict[str, Any]]] = [
        ("user/add", {"name": "root", "password": ROOT_PASSWORD}),
        ("user/grant", {"user": "root", "role": "root"}),
        ("user/add", {"name": "worker", "password": WORKER_PASSWORD}),
        ("user/add", {"name": "other", "password": OTHER_PASSWORD}),
        ("role/add", {"name": "topkv"}),
        (
            "role/grant",
            {
                "name": "topkv",
                "perm": {
                    "permType": "READWRITE",
                    "key": _b64("/topkv/"),
                    "range_end": _b64("/topkv0"),
                },
            },
        ),
        ("user/grant", {"user": "worker", "role": "topkv"}),
        ("enable", {}),
    ]
    for path, body in calls:
        response = requests.post(f"{base}/{path}", json=body, timeout=5)
        assert response.ok, f"{path}: {response.status_code} {response.text}"


@pytest.fixture(scope="module")
def auth_port(workdir: Path) -> Iterator[int]:
    etcd = _start_etcd(workdir, "auth", extra=(f"--auth-token-ttl={TOKEN_TTL_S}",))
    try:
        _enable_auth(etcd.port)
        yield etcd.port
    finally:
        _stop(etcd)


def _openssl(workdir: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=workdir, check=True, capture_output=True, timeout=30)


def _make_ca(workdir: Path, name: str) -> None:
    _openssl(
        workdir,
        *("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"),
        *("-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}"),
        *("-addext", "basicConstraints=critical,CA:TRUE"),
        *("-addext", "keyUsage=critical,keyCertSign,cRLSign"),
    )


def _make_leaf(workdir: Path, ca: str, name: str, usage: str) -> None:
    _openssl(
        workdir,
        *("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"),
        *("-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}"),
    )
    (workdir / f"{name}.ext").write_text(
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        f"extendedKeyUsage={usage}\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n"
    )
    _openssl(
        workdir,
        *("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key"),
        *("-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext"),
    )


@pytest.fixture(scope="module")
def certs(workdir: Path) -> Path:
    """ca (signs server + client), otherca (signs stranger); the server cert also allows
    clientAuth: etcd's gateway dials etcd itself with it when client certs are required."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed; it makes the test certificates")
    path = workdir / "certs"
    path.mkdir()
    _make_ca(path, "ca")
    _make_ca(path, "otherca")
    _make_leaf(path, "ca", "server", "serverAuth,clientAuth")
    _make_leaf(path, "ca", "client", "clientAuth")
    _make_leaf(path, "otherca", "stranger", "clientAuth")
    return path


def _server_tls(certs: Path) -> tuple[Path, Path, Path]:
    return certs / "ca.crt", certs / "server.crt", certs / "server.key"


@pytest.fixture(scope="module")
def tls_port(workdir: Path, certs: Path) -> Iterator[int]:
    etcd = _start_etcd(workdir, "tls", tls=_server_tls(certs))
    try:
        yield etcd.port
    finally:
        _stop(etcd)


@pytest.fixture(scope="module")
def mtls_port(workdir: Path, certs: Path) -> Iterator[int]:
    etcd = _start_etcd(
        workdir,
        "mtls",
        tls=_server_tls(certs),
        client_cert=(str(certs / "client.crt"), str(certs / "client.key")),
        extra=("--client-cert-auth", f"--trusted-ca-file={certs / 'ca.crt'}"),
    )
    try:
        yield etcd.port
    finally:
        _stop(etcd)


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
