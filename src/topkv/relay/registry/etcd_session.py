"""HTTP to etcd's v3 gateway with TLS files and an auth token, and what its failures mean.

``etcd3gw`` has no authentication of its own; it sends every call through a
``requests.Session``, so :class:`EtcdSession` adds what it lacks:

* the token from ``/v3/auth/authenticate`` in the ``Authorization`` header of every call,
  logging in again once when etcd answers that the token is invalid or expired (simple
  tokens expire after ``--auth-token-ttl`` idle seconds; JWTs at their expiry);
* the CA file and client certificate on every request (a session's own ``verify`` loses to
  ``REQUESTS_CA_BUNDLE`` in requests, a request's does not).

:func:`explain_failure` turns an etcd or transport error into a RegistryError that says
which problem it is (no credentials, permission, TLS, ...) and what to set; no secret is
ever part of it.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import Any

import requests
from etcd3gw.exceptions import Etcd3Exception

from topkv.relay.registry.base import RegistryError
from topkv.relay.registry.etcd_access import (
    ENV_CA,
    ENV_CERT,
    ENV_KEY,
    ENV_PASSWORD,
    ENV_PASSWORD_FILE,
    PASSWORD_HINT,
    EtcdLogin,
    EtcdTLS,
)

log = logging.getLogger(__name__)

ETCD_ERRORS = (requests.RequestException, Etcd3Exception)

# etcd's answers (v3.4/3.5 gateway) that a fresh token cures: expired/unknown token, auth store
# changed since the token was issued, or auth turned on after this client logged in.
_STALE_TOKEN = ("invalid auth token", "auth store is old", "user name is empty")
_NO_AUTH = "authentication is not enabled"
_BAD_LOGIN = "invalid user ID or password"
_VERIFY_REASON = re.compile(r"certificate verify failed: ([^(\"']*)")


class EtcdSession(requests.Session):
    """requests session for one etcd endpoint; see the module docstring."""

    def __init__(
        self, endpoint: str, tls: EtcdTLS | None, login: EtcdLogin | None, timeout_s: float
    ) -> None:
        super().__init__()
        self._endpoint = endpoint
        self._verify: str | bool = tls.ca_file if tls is not None and tls.ca_file else True
        self._cert = tls.client_cert() if tls is not None else None
        self._login = login
        self._timeout_s = timeout_s
        self._auth_url: str | None = None
        self._token: str | None = None
        self._lock = threading.Lock()

    def log_in(self, auth_url: str) -> None:
        """Authenticate now (RegistryError on a wrong user or password); from then on every
        request carries the token."""
        if self._login is None:
            return
        with self._lock:
            self._token = self._authenticate(auth_url)
            self._auth_url = auth_url

    def request(self, method: str, url: Any, *args: Any, **kwargs: Any) -> requests.Response:
        kwargs.setdefault("verify", self._verify)
        if self._cert is not None:
            kwargs.setdefault("cert", self._cert)
        if self._auth_url is None:
            return super().request(method, url, *args, **kwargs)
        token = self._token
        response = self._send(method, url, token, args, kwargs)
        if not _token_is_stale(response):
            return response
        response.close()
        return self._send(method, url, self._fresh_token(token), args, kwargs)

    def _send(
        self, method: str, url: Any, token: str | None, args: Any, kwargs: dict[str, Any]
    ) -> requests.Response:
        headers = dict(kwargs.get("headers") or {})
        if token is not None:
            headers["Authorization"] = token
        return super().request(method, url, *args, **{**kwargs, "headers": headers})

    def _fresh_token(self, stale: str | None) -> str | None:
        with self._lock:
            if self._token == stale and self._auth_url is not None:
                self._token = self._authenticate(self._auth_url)
            return self._token

    def _authenticate(self, auth_url: str) -> str | None:
        assert self._login is not None
        user = self._login.user
        response = super().request(
            "POST",
            auth_url,
            json={"name": user, "password": self._login.password},
            timeout=self._timeout_s,
            verify=self._verify,
            cert=self._cert,
        )
        if response.ok:
            token = response.json().get("token")
            if isinstance(token, str) and token:
                return token
            raise RegistryError(f"etcd at {self._endpoint} logged user {user!r} in without a token")
        text = response.text
        if _NO_AUTH in text:
            log.warning(
                "etcd at %s has authentication disabled: user %r and its password go unused",
                self._endpoint,
                user,
            )
            return None
        if _BAD_LOGIN in text:
            raise RegistryError(
                f"etcd at {self._endpoint} refused the login of user {user!r}: wrong user name or "
                f"password (check {ENV_PASSWORD}, {ENV_PASSWORD_FILE} or the registry URL's user)"
            )
        raise RegistryError(
            f"etcd login of user {user!r} at {self._endpoint} failed: "
            f"HTTP {response.status_code} {etcd_message(text)}"
        )


def _token_is_stale(response: requests.Response) -> bool:
    if response.status_code not in (400, 401):
        return False
    return any(marker in response.text for marker in _STALE_TOKEN)


def etcd_message(text: str) -> str:
    """The ``message`` of an etcd gateway error body (or the start of the body)."""
    try:
        body = json.loads(text)
    except ValueError:
        return text[:200]
    if isinstance(body, dict):
        return str(body.get("message") or body.get("error") or text)[:200]
    return text[:200]


def explain_failure(
    exc: Exception,
    *,
    action: str,
    endpoint: str,
    prefix: str,
    login: EtcdLogin | None,
    tls: EtcdTLS | None,
) -> RegistryError:
    """A RegistryError saying what went wrong when ``action`` failed with ``exc``."""
    detail = getattr(exc, "detail_text", None) if isinstance(exc, Etcd3Exception) else None
    text = f"{detail or ''} {exc}"
    if "user name is empty" in text and login is None:
        return RegistryError(
            f"etcd at {endpoint} has authentication enabled and this registry has no credentials, "
            f"so {action} was refused: {PASSWORD_HINT}"
        )
    if "permission denied" in text:
        who = f"etcd user {login.user!r}" if login else "this etcd client"
        return RegistryError(
            f"{who} was denied {action} under {prefix!r} at {endpoint} (permission denied): "
            "grant the user a role with readwrite on the prefix (etcdctl role grant-permission "
            f"ROLE --prefix=true readwrite {prefix}; etcdctl user grant-role USER ROLE)"
        )
    if "invalid auth token" in text:
        return RegistryError(
            f"etcd at {endpoint} rejected the auth token (while {action}), even after a fresh login"
        )
    return _transport_failure(text, exc, action=action, endpoint=endpoint, tls=tls)


def _transport_failure(
    text: str, exc: Exception, *, action: str, endpoint: str, tls: EtcdTLS | None
) -> RegistryError:
    if "CERTIFICATE_VERIFY_FAILED" in text:
        match = _VERIFY_REASON.search(text)
        reason = match.group(1).strip(" .") if match else "certificate verify failed"
        ca = f"the CA file {tls.ca_file!r}" if tls is not None and tls.ca_file else "no CA file"
        return RegistryError(
            f"TLS verification of etcd's certificate at {endpoint} failed ({reason}) with {ca}: "
            f"set {ENV_CA} (or ?ca=) to the CA that signed etcd's server certificate, and make "
            "sure that certificate names the host in the registry URL"
        )
    if tls is not None and ("SSLError" in text or "EOF occurred" in text):
        if tls.cert_file is None:
            client = (
                f"it requires a client certificate (set {ENV_CERT} and {ENV_KEY}, or ?cert=&key=)"
            )
        else:
            client = (
                f"it refused the client certificate {tls.cert_file!r} (it must be signed by etcd's "
                "--trusted-ca-file CA and allow clientAuth)"
            )
        return RegistryError(
            f"etcd at {endpoint} broke off the TLS handshake (while {action}): {client}, "
            "or it does not speak TLS (then use etcd://)"
        )
    if tls is None and ("RemoteDisconnected" in text or "Connection aborted" in text):
        return RegistryError(
            f"etcd at {endpoint} closed the connection without answering (while {action}): "
            "if it serves TLS, use etcds://HOST:PORT"
        )
    if action == "connecting":
        return RegistryError(
            f"cannot reach etcd at {endpoint}: {exc.__class__.__name__}; "
            "is etcd running and is the address right?"
        )
    message = etcd_message(detail) if (detail := getattr(exc, "detail_text", None)) else str(exc)
    return RegistryError(
        f"{action} in etcd at {endpoint} failed: {message or exc.__class__.__name__}"
    )
