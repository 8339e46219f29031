"""TLS on the control plane: the orchestrator's and the workers' HTTP servers, and every
client of them (the remote executor, a worker's registrar, ``topkv status``).

A server given ``--tls-cert`` and ``--tls-key`` serves HTTPS (TLS 1.2 or newer) and
advertises ``https://`` URLs. ``--tls-ca`` names the CA its *own outgoing calls* verify
their peer against: the orchestrator's executor verifies the workers with it, a worker
verifies the orchestrator it registers with. Without ``--tls-ca`` a client trusts the
system's store. Every client checks the host name against the certificate.

Servers do not ask for client certificates: callers are authenticated by their bearer tokens
(:mod:`topkv.service.http.auth`), which TLS keeps off the wire in clear text. (So ``topkv status``
needs only the CA and the admin token, not a certificate of its own.)

Files are checked when a context is built: a missing or unreadable file, a file that holds
no PEM certificate, and a key that is not the certificate's own each raise a
:class:`~topkv.errors.ConfigError` naming the file (never its content). A TLS failure met by
a client (an untrusted or mismatched certificate, plain HTTP against HTTPS or the reverse)
becomes a :class:`TLSFailure` that says which and what to change.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import logging
import os
import secrets
import shutil
import socket
import ssl
import stat
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from topkv.errors import ConfigError
from topkv.service.errors import ServiceUnreachable

log = logging.getLogger(__name__)

#: OpenSSL's verify codes for a certificate issued to another host name or IP address.
_NAME_MISMATCH = (62, 64)
#: OpenSSL reasons meaning "the peer answered with something that is not TLS".
_NOT_TLS = (
    "WRONG_VERSION_NUMBER",
    "RECORD_LAYER_FAILURE",
    "PACKET_LENGTH_TOO_LONG",
    "HTTP_REQUEST",
)


class TLSFailure(ServiceUnreachable):
    """A client could not make a TLS connection: the peer's certificate failed verification,
    or one side speaks TLS and the other plain HTTP."""


def _read_check(path: Path, what: str, flag: str) -> None:
    try:
        info = path.stat()
    except OSError as exc:
        raise ConfigError(f"{what} {path} ({flag}): {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{what} {path} ({flag}) is not a regular file")
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path} ({flag}): {exc.strerror}") from None


def _load_ca(context: ssl.SSLContext, path: Path, what: str, flag: str) -> None:
    _read_check(path, what, flag)
    try:
        context.load_verify_locations(cafile=str(path))
    except (ssl.SSLError, ValueError):
        raise ConfigError(f"{what} {path} ({flag}) holds no PEM certificate") from None


@dataclass(frozen=True)
class ServerTLS:
    """What a server serves HTTPS with: its certificate (chain) and private key files."""

    cert_file: Path
    key_file: Path

    def context(self) -> ssl.SSLContext:
        """A server context (TLS 1.2+); ConfigError naming the file that does not load."""
        # The certificate file must hold certificates (not, say, the key given twice).
        _load_ca(
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), self.cert_file, "certificate", "--tls-cert"
        )
        _read_check(self.key_file, "private key", "--tls-key")
        if self.key_file.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("private key %s is readable by other users; chmod 600 it", self.key_file)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            # An encrypted key gets an empty password (and fails), never a prompt on the tty.
            context.load_cert_chain(str(self.cert_file), str(self.key_file), password=lambda: b"")
        except ssl.SSLError as exc:
            if "KEY_VALUES_MISMATCH" in str(exc):
                raise ConfigError(
                    f"private key {self.key_file} (--tls-key) is not the key of certificate "
                    f"{self.cert_file} (--tls-cert)"
                ) from None
            raise ConfigError(
                f"private key {self.key_file} (--tls-key) holds no unencrypted PEM private key"
            ) from None
        return context


@dataclass(frozen=True)
class ClientTLS:
    """How a client verifies the servers it calls over HTTPS: against ``ca_file`` (None:
    the system's trust store), with the host name checked."""

    ca_file: Path | None = None
    _cache: dict[str, ssl.SSLContext] = field(
        default_factory=dict, repr=False, compare=False, hash=False
    )

    def context(self) -> ssl.SSLContext:
        """The client context (built once); ConfigError when the CA file does not load."""
        cached = self._cache.get("context")
        if cached is None:
            cached = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
            cached.minimum_version = ssl.TLSVersion.TLSv1_2
            cached.check_hostname = True
            if self.ca_file is not None:
                _load_ca(cached, self.ca_file, "CA file", "--tls-ca")
            self._cache["context"] = cached
        return cached


@dataclass(frozen=True)
class TLSConfig:
    """A service's TLS: what it serves with (None: plain HTTP) and how its own clients verify
    their peers."""

    serve: ServerTLS | None = None
    verify: ClientTLS = field(default_factory=ClientTLS)

    @classmethod
    def from_files(cls, cert: Path | None, key: Path | None, ca: Path | None) -> TLSConfig | None:
        """From ``--tls-cert``, ``--tls-key`` and ``--tls-ca`` (None when none is given);
        every file is checked now, so a bad one stops the service before it starts."""
        if (cert is None) != (key is None):
            given, missing = (
                ("--tls-cert", "--tls-key") if key is None else ("--tls-key", "--tls-cert")
            )
            raise ConfigError(f"{given} needs {missing} too (a certificate and its key)")
        if cert is None and ca is None:
            return None
        serve = ServerTLS(cert, key) if cert is not None and key is not None else None
        config = cls(serve, ClientTLS(ca))
        config.check()
        return config

    def check(self) -> None:
        if self.serve is not None:
            self.serve.context()
        self.verify.context()

    def server_context(self) -> ssl.SSLContext | None:
        return self.serve.context() if self.serve is not None else None


def server_context(tls: TLSConfig | None) -> ssl.SSLContext | None:
    """The context a server listens with (None: plain HTTP)."""
    return tls.server_context() if tls is not None else None


def served_url(url: str, tls: TLSConfig | None) -> str:
    """``url`` (``http://HOST:PORT`` of a listening site) as ``https://`` when it serves TLS."""
    if tls is not None and tls.serve is not None and url.startswith("http://"):
        return "https://" + url[len("http://") :]
    return url


def client_tls(tls: TLSConfig | None) -> ClientTLS | None:
    """How a service's own clients verify their peers."""
    return tls.verify if tls is not None else None


def client_context(tls: ClientTLS | None) -> ssl.SSLContext | None:
    """The context a client connects with (None: the system's trust store, the default)."""
    return tls.context() if tls is not None else None


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop(0)
        if current is None or any(current is s for s in seen) or len(seen) > 16:
            continue
        seen.append(current)
        todo += [current.__cause__, current.__context__]
        for name in ("certificate_error", "os_error", "reason"):
            inner = getattr(current, name, None)
            if isinstance(inner, BaseException):
                todo.append(inner)
    return seen


def tls_failure(
    url: str, exc: BaseException, ca: ClientTLS | None = None, *, user_url: bool = True
) -> TLSFailure | None:
    """A :class:`TLSFailure` explaining ``exc`` (met calling ``url``), or None when ``exc``
    is no TLS problem. Names the CA file, never a certificate's content.

    ``user_url``: ``url`` was typed by a user, so a server hanging up on a plain HTTP
    request is likely a TLS server (a registered URL carries its server's own scheme)."""
    parts = urlsplit(url)
    where = f"{parts.scheme}://{parts.netloc}"
    trust = f"CA file {ca.ca_file}" if ca is not None and ca.ca_file else "the system's trust store"
    chain = _chain(exc)
    for error in chain:
        # (aiohttp's wrapper is an SSLCertVerificationError too, without the details)
        if isinstance(error, ssl.SSLCertVerificationError) and hasattr(error, "verify_code"):
            message = error.verify_message or error.reason or "verification failed"
            if error.verify_code in _NAME_MISMATCH:
                return TLSFailure(
                    f"{where}: the server's certificate is not issued to {parts.hostname} "
                    f"({message}): give it a certificate whose subjectAltName names the host "
                    "or address clients use"
                )
            return TLSFailure(
                f"{where}: TLS verification of the server's certificate failed with {trust} "
                f"({message}): give the CA that signed it with --tls-ca"
            )
    for error in chain:
        if isinstance(error, ssl.SSLError) and any(r in str(error) for r in _NOT_TLS):
            return TLSFailure(
                f"{where} does not speak TLS: use http://, or start the server with "
                "--tls-cert and --tls-key"
            )
    if user_url and parts.scheme == "http" and any(_broke_off(e) for e in chain):
        return TLSFailure(
            f"{where} closed the connection without an HTTP answer: if it serves TLS, use "
            "https:// (and --tls-ca to verify it)"
        )
    for error in chain:
        if isinstance(error, ssl.SSLError):
            return TLSFailure(f"{where}: TLS handshake failed ({error.reason or error})")
    return None


def _broke_off(error: BaseException) -> bool:
    """The peer closed without answering (a TLS server meeting a plain HTTP request)."""
    return isinstance(
        error,
        http.client.RemoteDisconnected | ConnectionResetError | aiohttp.ServerDisconnectedError,
    )


# -- a throwaway CA (``topkv cluster up --tls``) ---------------------------------------------


@dataclass(frozen=True)
class ThrowawayPKI:
    """A CA certificate and one server certificate and key it signed (the CA's own key is
    deleted once it signed: nothing else can be issued under it)."""

    ca_file: Path
    cert_file: Path
    key_file: Path

    def config(self) -> TLSConfig:
        return TLSConfig(ServerTLS(self.cert_file, self.key_file), ClientTLS(self.ca_file))


def _subject_alt_names(hosts: Iterable[str]) -> str:
    names: list[str] = []
    for host in ("127.0.0.1", "::1", "localhost", socket.gethostname(), *hosts):
        name = host.strip("[]")
        if name in ("", "0.0.0.0", "::"):
            continue
        try:
            entry = f"IP:{ipaddress.ip_address(name)}"
        except ValueError:
            entry = f"DNS:{name}"
        if entry not in names:
            names.append(entry)
    return ",".join(names)


def make_throwaway_pki(directory: Path, hosts: Iterable[str] = ()) -> ThrowawayPKI:
    """Make a CA and a server certificate valid for loopback, this host's name and ``hosts``
    in ``directory`` (mode 0700; keys 0600) with the ``openssl`` command; ConfigError when it
    is missing or fails."""
    binary = shutil.which("openssl")
    if binary is None:
        raise ConfigError("--tls makes its certificates with the openssl command: install it")
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    (directory / "server.ext").write_text(
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        f"extendedKeyUsage=serverAuth\nsubjectAltName={_subject_alt_names(hosts)}\n"
    )
    steps = [
        ["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "30"],
        ["-subj", "/CN=topkv throwaway CA", "-addext", "basicConstraints=critical,CA:TRUE"],
        ["req", "-new", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=topkv"],
        ["x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-days", "30"],
        ["-set_serial", str(secrets.randbits(63)), "-out", "server.crt"],
    ]
    commands = [
        steps[0] + steps[1] + ["-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        steps[2],
        steps[3] + steps[4] + ["-extfile", "server.ext"],
    ]
    try:
        for args in commands:
            done = subprocess.run(
                [binary, *args],
                cwd=directory,
                capture_output=True,
                timeout=30,
                preexec_fn=lambda: os.umask(0o077),
            )
            if done.returncode != 0:
                tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:]
                raise ConfigError(f"openssl {args[0]} failed in {directory}: {' '.join(tail)}")
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"cannot run openssl in {directory}: {exc}") from None
    finally:
        for leftover in ("ca.key", "server.csr", "server.ext"):
            with contextlib.suppress(FileNotFoundError):
                (directory / leftover).unlink()
    os.chmod(directory / "server.key", 0o600)
    return ThrowawayPKI(directory / "ca.crt", directory / "server.crt", directory / "server.key")
