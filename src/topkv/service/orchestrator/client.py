"""A small blocking JSON client for the orchestrator's HTTP API (CLI, supervisor, tests)."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from typing import Any

from topkv.service.errors import ServiceError, ServiceUnreachable
from topkv.service.http.auth import auth_headers
from topkv.service.http.tls import ClientTLS, client_context, tls_failure


class ApiError(ServiceError):
    """The service answered with an error status; ``status`` and ``body`` say which."""

    def __init__(self, status: int, body: Any, url: str) -> None:
        error = body.get("error") if isinstance(body, dict) else None
        detail = error.get("detail") if isinstance(error, dict) else str(body)[:300]
        super().__init__(f"{url} -> HTTP {status}: {detail}")
        self.status = status
        self.body = body


def http_json(
    method: str,
    url: str,
    body: object | None = None,
    timeout_s: float = 10.0,
    token: str | None = None,
    tls: ClientTLS | None = None,
) -> Any:
    """Send ``body`` as JSON (with ``token`` as the bearer token), return the decoded JSON
    answer (None when empty). ``tls``: how an ``https://`` server is verified (None: the
    system's trust store)."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers=auth_headers(token))
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(
            request, timeout=timeout_s, context=client_context(tls)
        ) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            payload = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            payload = raw.decode(errors="replace")
        raise ApiError(exc.code, payload, url) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise _unreachable(url, exc, tls) from None
    return json.loads(raw) if raw else None


def http_text(
    url: str, timeout_s: float = 10.0, token: str | None = None, tls: ClientTLS | None = None
) -> str:
    request = urllib.request.Request(url, headers=auth_headers(token))
    try:
        with urllib.request.urlopen(
            request, timeout=timeout_s, context=client_context(tls)
        ) as response:
            return bytes(response.read()).decode()
    except urllib.error.HTTPError as exc:
        raise ApiError(exc.code, exc.read().decode(errors="replace"), url) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise _unreachable(url, exc, tls) from None


def _unreachable(url: str, exc: Exception, tls: ClientTLS | None) -> ServiceUnreachable:
    """A TLS failure explained (:class:`~topkv.service.http.tls.TLSFailure`), else unreachable."""
    return tls_failure(url, exc, tls) or ServiceUnreachable(
        f"{url} unreachable: {getattr(exc, 'reason', exc)}"
    )


class OrchestratorClient:
    """Typed-enough helpers over the orchestrator's endpoints."""

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 10.0,
        token: str | None = None,
        tls: ClientTLS | None = None,
    ) -> None:
        """``token``: the admin token (None: the orchestrator runs without authentication).
        ``tls``: how an ``https://`` orchestrator is verified (None: the system's store)."""
        self.base = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.token = token
        self.tls = tls

    def get(self, path: str) -> Any:
        url = f"{self.base}{path}"
        return http_json("GET", url, timeout_s=self.timeout_s, token=self.token, tls=self.tls)

    def post(self, path: str, body: object) -> Any:
        url = f"{self.base}{path}"
        return http_json(
            "POST", url, body, timeout_s=self.timeout_s, token=self.token, tls=self.tls
        )

    def workers(self) -> list[dict[str, Any]]:
        return list(self.get("/v1/workers")["workers"])

    def transfers(self, limit: int = 100) -> dict[str, Any]:
        return dict(self.get(f"/v1/transfers?limit={limit}"))

    def submit(self, **body: object) -> dict[str, Any]:
        return dict(self.post("/v1/requests", {k: v for k, v in body.items() if v is not None}))

    def request(self, request_id: int) -> dict[str, Any]:
        return dict(self.get(f"/v1/requests/{request_id}"))

    def metrics(self) -> str:
        return http_text(f"{self.base}/metrics", self.timeout_s, token=self.token, tls=self.tls)

    def wait_done(self, request_id: int, timeout_s: float, decoded: bool = True) -> dict[str, Any]:
        """Poll until the request is terminal (and, if delivered, checked by decode)."""
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        while True:
            record = self.request(request_id)
            terminal = record["state"] in ("delivered", "failed", "cancelled")
            checked = record["state"] != "delivered" or not decoded or record["decode_check"]
            if terminal and checked:
                return record
            if time.monotonic() > deadline:
                raise ServiceError(
                    f"request {request_id} still {record['state']} after {timeout_s} s"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    def wait_workers(self, prefill: int, decode: int, timeout_s: float) -> list[dict[str, Any]]:
        """Poll ``/v1/workers`` until at least ``prefill`` + ``decode`` workers are listed."""
        deadline = time.monotonic() + timeout_s
        while True:
            workers = self.workers()
            roles = [w["worker"]["role"] for w in workers]
            if roles.count("prefill") >= prefill and roles.count("decode") >= decode:
                return workers
            if time.monotonic() > deadline:
                raise ServiceError(
                    f"only {roles.count('prefill')}/{prefill} prefill and "
                    f"{roles.count('decode')}/{decode} decode workers registered "
                    f"after {timeout_s} s"
                )
            time.sleep(0.05)
