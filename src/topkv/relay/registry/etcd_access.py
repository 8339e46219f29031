"""How to reach an etcd registry: the URL, its credentials and TLS files, and redaction.

Grammar (docs/etcd.md)::

    etcd://[USER[:PASSWORD]@]HOST:PORT[/PREFIX][?ca=FILE&cert=FILE&key=FILE]   plain HTTP
    etcds://...                                                                 TLS

A setting in the URL wins over its environment variable:

* ``TOPKV_ETCD_USER``: the etcd user when the URL names none.
* ``TOPKV_ETCD_PASSWORD`` or ``TOPKV_ETCD_PASSWORD_FILE`` (one of them; the file's trailing
  newline is dropped): the password when the URL carries none. Prefer these to an inline
  password, which shell history and process lists see.
* ``TOPKV_ETCD_CA``, ``TOPKV_ETCD_CERT``, ``TOPKV_ETCD_KEY``: the CA file that verifies etcd's
  certificate, and a client certificate and key for mutual TLS (``etcds://`` only).

A password never appears in :func:`redact_url`, in ``repr`` of these objects, or in the
messages of the errors raised here.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from topkv.errors import ConfigError

DEFAULT_PREFIX = "/topkv"
SCHEMES = ("etcd", "etcds")

ENV_USER = "TOPKV_ETCD_USER"
ENV_PASSWORD = "TOPKV_ETCD_PASSWORD"
ENV_PASSWORD_FILE = "TOPKV_ETCD_PASSWORD_FILE"
ENV_CA = "TOPKV_ETCD_CA"
ENV_CERT = "TOPKV_ETCD_CERT"
ENV_KEY = "TOPKV_ETCD_KEY"

_QUERY_ENV = {"ca": ENV_CA, "cert": ENV_CERT, "key": ENV_KEY}
_GRAMMAR = "expected etcd[s]://[USER@]HOST:PORT[/prefix][?ca=FILE&cert=FILE&key=FILE]"
PASSWORD_HINT = f"put USER@ in the registry URL and set {ENV_PASSWORD} or {ENV_PASSWORD_FILE}"


@dataclass(frozen=True)
class EtcdLogin:
    """An etcd user and its password (left out of ``repr``)."""

    user: str
    password: str = field(repr=False)


@dataclass(frozen=True)
class EtcdTLS:
    """TLS to etcd: the CA that verifies its certificate (None: the system's trust store) and
    an optional client certificate and key (mutual TLS)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def check(self) -> None:
        """ConfigError unless every file given exists and loads (the key matching the cert)."""
        context = ssl.create_default_context()
        if self.ca_file is not None:
            _readable(self.ca_file, "CA file", "ca", ENV_CA)
            try:
                context.load_verify_locations(cafile=self.ca_file)
            except OSError as exc:  # ssl.SSLError included
                raise ConfigError(
                    f"etcd CA file {self.ca_file!r} holds no usable PEM certificate "
                    f"({_ssl_reason(exc)}): "
                    f"give the CA that signed etcd's server certificate (?ca= or {ENV_CA})"
                ) from None
        if self.cert_file is not None and self.key_file is not None:
            _readable(self.cert_file, "client certificate", "cert", ENV_CERT)
            _readable(self.key_file, "client key", "key", ENV_KEY)
            try:
                # An encrypted key gets an empty password (and fails), not a prompt on the tty.
                context.load_cert_chain(self.cert_file, self.key_file, password=lambda: b"")
            except OSError as exc:  # ssl.SSLError included
                raise ConfigError(
                    f"etcd client certificate {self.cert_file!r} and key {self.key_file!r} do not "
                    f"load as a pair ({_ssl_reason(exc)}): give a PEM certificate and its own "
                    "unencrypted private key"
                ) from None

    def client_cert(self) -> tuple[str, str] | None:
        if self.cert_file is None or self.key_file is None:
            return None
        return (self.cert_file, self.key_file)


@dataclass(frozen=True)
class EtcdAccess:
    """Everything needed to open one etcd registry."""

    host: str
    port: int
    prefix: str = DEFAULT_PREFIX
    tls: EtcdTLS | None = None
    login: EtcdLogin | None = None

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def url(self) -> str:
        """The URL of this registry with the user but never the password (safe to log)."""
        user = f"{quote(self.login.user, safe='')}@" if self.login else ""
        scheme = "etcds" if self.tls else "etcd"
        return f"{scheme}://{user}{self.endpoint}{self.prefix}"


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***``; safe to log or put in an error message.

    Conservative on malformed input: everything up to the last ``@`` after the scheme is
    userinfo, and only a user name free of URL delimiters is kept.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "***" if "@" in url else url
    userinfo, at, after = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.partition(":")[0]
    if any(ch in user for ch in "/?#[]"):
        user = "***"
    return f"{scheme}://{user}:***@{after}"


def is_etcd_url(url: str) -> bool:
    return url.partition("://")[0].lower() in SCHEMES and "://" in url


def parse_etcd_url(url: str, env: Mapping[str, str] | None = None) -> EtcdAccess:
    """Parse an ``etcd://`` or ``etcds://`` URL plus the ``TOPKV_ETCD_*`` variables of ``env``
    (default: the process environment); raise ConfigError, without the password, when invalid."""
    environ = os.environ if env is None else env
    scheme = url.partition("://")[0].lower()
    if scheme not in SCHEMES or "://" not in url:
        raise _bad(url, "the scheme must be etcd:// (plain HTTP) or etcds:// (TLS)")
    if "#" in url:
        raise _bad(url, "'#' is not allowed (percent-encode it as %23 in a password)")
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
        raw_user, raw_password = parts.username, parts.password
    except ValueError as exc:
        raise _bad(url, _safe_reason(exc)) from None
    if not host:
        raise _bad(url, "no host")
    if port is None or port == 0:
        raise _bad(url, "no port (1-65535)")
    prefix = parts.path if parts.path not in ("", "/") else DEFAULT_PREFIX
    files = _query_files(url, parts.query)
    tls_files = {
        name: files.get(name) or _env(environ, env_name) for name, env_name in _QUERY_ENV.items()
    }
    tls = _tls(scheme, tls_files, files)
    login = _login(url, raw_user, raw_password, environ)
    return EtcdAccess(host=host, port=port, prefix=prefix, tls=tls, login=login)


def _bad(url: str, why: str) -> ConfigError:
    return ConfigError(f"bad etcd registry URL {redact_url(url)!r}: {why}; {_GRAMMAR}")


def _safe_reason(exc: ValueError) -> str:
    # urllib's messages quote the offending port or netloc, which may hold the password.
    text = str(exc)
    if "out of range" in text:
        return "the port must be 1-65535"
    if "Port could not be cast" in text:
        return "the port is not a number (percent-encode ':', '/', '?' and '@' in a password)"
    return "it does not parse as a URL (percent-encode ':', '/', '?', '@' and '[' in a password)"


def _env(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name, "")
    return value or None


def _query_files(url: str, query: str) -> dict[str, str]:
    files: dict[str, str] = {}
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise _bad(url, "the query must be ca=FILE, cert=FILE and/or key=FILE") from None
    for name, value in pairs:
        if name not in _QUERY_ENV:
            raise _bad(url, f"unknown query parameter {name!r} (known: ca, cert, key)")
        if name in files:
            raise _bad(url, f"query parameter {name!r} given twice")
        if not value:
            raise _bad(url, f"query parameter {name!r} is empty")
        files[name] = value
    return files


def _tls(scheme: str, tls_files: dict[str, str | None], in_url: dict[str, str]) -> EtcdTLS | None:
    given = [name for name, value in tls_files.items() if value]
    if scheme == "etcd":
        if given:
            sources = ", ".join(f"?{n}=" if n in in_url else _QUERY_ENV[n] for n in given)
            raise ConfigError(
                f"TLS files are set ({sources}) but the registry URL is etcd:// (plain HTTP): "
                "use etcds://HOST:PORT for TLS, or unset them"
            )
        return None
    cert, key = tls_files["cert"], tls_files["key"]
    if (cert is None) != (key is None):
        missing = f"key (?key= or {ENV_KEY})" if key is None else f"cert (?cert= or {ENV_CERT})"
        raise ConfigError(
            f"etcd client TLS needs both a certificate and its key: the {missing} is missing"
        )
    return EtcdTLS(ca_file=tls_files["ca"], cert_file=cert, key_file=key)


def _login(
    url: str, raw_user: str | None, raw_password: str | None, environ: Mapping[str, str]
) -> EtcdLogin | None:
    if raw_user is not None and raw_user == "":
        raise _bad(url, "the user before '@' is empty")
    user = unquote(raw_user) if raw_user is not None else _env(environ, ENV_USER)
    password = unquote(raw_password) if raw_password is not None else None
    if password is None:
        password = _password_from_env(environ)
    if user is None:
        if password is not None:
            raise ConfigError(
                f"an etcd password is set but no etcd user: put USER@ in the registry URL "
                f"or set {ENV_USER}"
            )
        return None
    if not password:
        raise ConfigError(f"etcd user {user!r} has no password: {PASSWORD_HINT}")
    return EtcdLogin(user=user, password=password)


def _password_from_env(environ: Mapping[str, str]) -> str | None:
    inline, path = _env(environ, ENV_PASSWORD), _env(environ, ENV_PASSWORD_FILE)
    if inline is not None and path is not None:
        raise ConfigError(f"both {ENV_PASSWORD} and {ENV_PASSWORD_FILE} are set: set only one")
    if path is None:
        return inline
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"cannot read the etcd password file {path!r} ({ENV_PASSWORD_FILE}): "
            f"{exc.__class__.__name__}"
        ) from None
    password = text.rstrip("\r\n")
    if not password:
        raise ConfigError(f"the etcd password file {path!r} ({ENV_PASSWORD_FILE}) is empty")
    return password


def _ssl_reason(exc: OSError) -> str:
    reason = getattr(exc, "reason", None)
    return str(reason) if reason else exc.__class__.__name__


def _readable(path: str, what: str, query: str, env_name: str) -> None:
    if not Path(path).is_file():
        raise ConfigError(f"etcd {what} {path!r} (?{query}= or {env_name}) is not a readable file")
