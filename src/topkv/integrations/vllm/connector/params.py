"""What the connector is configured with, and what each request tells it (no vLLM here).

``kv_connector_extra_config`` (one per vLLM instance) -> :class:`ConnectorSettings`;
a request's ``kv_transfer_params`` -> :class:`SendParams` (prefill) or :class:`LoadParams`
(decode). Both come from outside the process, so every field is checked and a bad one is a
:class:`ConnectorConfigError` that names it.

Per-request parameters, as the front door (``topkv router``) sends them::

    prefill: {"do_remote_decode": true,
              "topkv": {"transfer_id": 17, "destination": "shm:///tmp/x.sock",
                        "skip_tokens": 64}}   (optional: the decode holds tokens 0..63)
    decode:  {"do_remote_prefill": true,
              "topkv": {"transfer_id": 17, "medium": "shm", "timeout_s": 30}}
    report:  {"topkv": {"report_of": 17}}   (a decode's load report, for a streamed answer)
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from topkv.errors import ConfigError
from topkv.integrations.vllm.connector.layout import BlockLayout, parse_layout

Medium = Literal["shm", "tcp", "nixl", "mooncake"]
#: The media a connector can move KV over (a sink on decode, a source on prefill);
#: ``nixl`` and ``mooncake`` only where their packages load (``scripts/install-vllm.sh``).
MEDIA: tuple[Medium, ...] = ("shm", "tcp", "nixl", "mooncake")
#: The URL scheme of each medium's sink address (a prefill's ``destination``).
SCHEMES = tuple(f"{m}://" for m in MEDIA)
#: What UCX (under NIXL) uses unless ``ucx_tls`` or ``$UCX_TLS`` says otherwise: the setting
#: vLLM's own NixlConnector was run with on this CPU host (issue 14's notes).
DEFAULT_UCX_TLS = "tcp,self,sm"
#: Environment variable naming the file that holds the transports' shared secret.
SECRET_FILE_ENV = "TOPKV_KV_SECRET_FILE"


class ConnectorConfigError(ConfigError):
    """A connector setting or a request's kv_transfer_params that cannot be used."""


def shm_socket_path(shm_dir: str, worker_id: str) -> str:
    """Where the decode instance ``worker_id`` listens for shm senders (same host only)."""
    return os.path.join(shm_dir, f"topkv-vllm-{worker_id}.sock")


def _str(config: Mapping[str, Any], key: str, default: str = "") -> str:
    value = config.get(key, default)
    if not isinstance(value, str):
        raise ConnectorConfigError(f"kv_connector_extra_config.{key} must be a string")
    return value


def _number(config: Mapping[str, Any], key: str, default: float, low: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= low:
        raise ConnectorConfigError(
            f"kv_connector_extra_config.{key} must be a number >= {low}, got {value!r}"
        )
    return float(value)


@dataclass(frozen=True)
class ConnectorSettings:
    """One instance's connector settings (``kv_connector_extra_config``)."""

    secret: bytes
    worker_id: str
    role: Literal["prefill", "decode"]
    block_layout: BlockLayout | None  # None: from the platform (CPU: cpu-packed)
    tcp_host: str
    tcp_port: int
    shm_dir: str
    registry_url: str  # empty: do not register
    token: str | None  # this instance's worker token for the registry
    api_url: str  # the instance's OpenAI API, for the front door
    host_id: str
    load_timeout_s: float
    #: The media this instance may offer (None: every one installed here, as ``topkv
    #: worker`` offers them). ``kv_connector_extra_config.media``, e.g. ``["tcp", "nixl"]``.
    media: tuple[str, ...] | None = None
    #: UCX transports for NIXL's agents (``$UCX_TLS``, else :data:`DEFAULT_UCX_TLS`).
    ucx_tls: str = DEFAULT_UCX_TLS
    #: The host arena a decode's NIXL or Mooncake sink registers (bytes).
    arena_bytes: int = 256 << 20

    @classmethod
    def from_extra(cls, config: Mapping[str, Any], kv_role: str) -> ConnectorSettings:
        secret_file = _str(config, "secret_file", os.environ.get(SECRET_FILE_ENV, ""))
        if not secret_file:
            raise ConnectorConfigError(
                "TopKVConnector needs the transports' shared secret: set "
                f"kv_connector_extra_config.secret_file or ${SECRET_FILE_ENV}"
            )
        try:
            secret = Path(secret_file).read_bytes().strip()
        except OSError as exc:
            raise ConnectorConfigError(f"{secret_file}: cannot read the secret: {exc}") from exc
        if len(secret) < 16:
            raise ConnectorConfigError(f"{secret_file}: the secret must be >= 16 bytes")
        role = _str(config, "role", "decode" if kv_role == "kv_consumer" else "prefill")
        if role not in ("prefill", "decode"):
            raise ConnectorConfigError(f"kv_connector_extra_config.role {role!r}: prefill|decode")
        worker_id = _str(config, "worker_id", f"vllm-{role}-{socket.gethostname()}-{os.getpid()}")
        layout = _str(config, "block_layout")
        token = None
        token_file = _str(config, "token_file")
        if token_file:
            try:
                token = Path(token_file).read_text().strip()
            except OSError as exc:
                raise ConnectorConfigError(f"{token_file}: cannot read the token: {exc}") from exc
        return cls(
            secret=secret,
            worker_id=worker_id,
            role=role,  # type: ignore[arg-type]  # checked above
            block_layout=parse_layout(layout) if layout else None,
            tcp_host=_str(config, "tcp_host", "127.0.0.1"),
            tcp_port=int(_number(config, "tcp_port", 0, 0)),
            shm_dir=_str(config, "shm_dir", "/tmp"),
            registry_url=_str(config, "registry_url"),
            token=token,
            api_url=_str(config, "api_url"),
            host_id=_str(config, "host_id", socket.gethostname()),
            load_timeout_s=_number(config, "load_timeout_s", 30.0, 0.1),
            media=_media(config),
            ucx_tls=_str(config, "ucx_tls", os.environ.get("UCX_TLS") or DEFAULT_UCX_TLS),
            arena_bytes=int(_number(config, "arena_mb", 256, 1) * (1 << 20)),
        )


def _media(config: Mapping[str, Any]) -> tuple[str, ...] | None:
    """``kv_connector_extra_config.media``: a list of media names (None: not given)."""
    value = config.get("media")
    if value is None:
        return None
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, list) or not value or not all(isinstance(m, str) for m in value):
        raise ConnectorConfigError(
            f"kv_connector_extra_config.media must be a non-empty list of {MEDIA}, got {value!r}"
        )
    unknown = [m for m in value if m not in MEDIA]
    if unknown:
        raise ConnectorConfigError(
            f"kv_connector_extra_config.media: unknown medium {', '.join(unknown)}; "
            f"choose from {', '.join(MEDIA)}"
        )
    return tuple(m for m in MEDIA if m in value)


def _topkv_part(params: Mapping[str, Any] | None, flag: str) -> Mapping[str, Any] | None:
    if not params or not params.get(flag):
        return None
    part = params.get("topkv")
    if not isinstance(part, Mapping):
        return None  # another connector's request
    transfer_id = part.get("transfer_id")
    if isinstance(transfer_id, bool) or not isinstance(transfer_id, int) or transfer_id < 0:
        raise ConnectorConfigError(
            f"kv_transfer_params.topkv.transfer_id must be an int >= 0, got {transfer_id!r}"
        )
    return part


@dataclass(frozen=True)
class SendParams:
    transfer_id: int
    destination: str
    #: Fault injection (tests, chaos): "corrupt" flips one bit of one layer after its CRC-64
    #: was taken, so the destination must catch it. It can only spoil this request's copy.
    fault: str | None = None
    #: Leading prompt tokens not to send: the destination is believed to hold them (its
    #: prefix cache). If it does not, its load fails and vLLM recomputes: never wrong.
    skip_tokens: int = 0

    @classmethod
    def of(cls, params: Mapping[str, Any] | None) -> SendParams | None:
        part = _topkv_part(params, "do_remote_decode")
        if part is None:
            return None
        destination = part.get("destination")
        if not isinstance(destination, str) or not destination.startswith(SCHEMES):
            raise ConnectorConfigError(
                "kv_transfer_params.topkv.destination must be shm://PATH or "
                f"(tcp|nixl|mooncake)://HOST:PORT, got {destination!r}"
            )
        fault = part.get("fault")
        if fault not in (None, "corrupt"):
            raise ConnectorConfigError(f"kv_transfer_params.topkv.fault {fault!r}: only 'corrupt'")
        skip = part.get("skip_tokens", 0)
        if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
            raise ConnectorConfigError(
                f"kv_transfer_params.topkv.skip_tokens must be an int >= 0, got {skip!r}"
            )
        return cls(part["transfer_id"], destination, fault, skip)


@dataclass(frozen=True)
class LoadParams:
    transfer_id: int
    medium: Medium
    timeout_s: float | None

    @classmethod
    def of(cls, params: Mapping[str, Any] | None) -> LoadParams | None:
        part = _topkv_part(params, "do_remote_prefill")
        if part is None:
            return None
        medium = part.get("medium")
        if medium not in MEDIA:
            raise ConnectorConfigError(
                f"kv_transfer_params.topkv.medium must be one of {MEDIA}, got {medium!r}"
            )
        timeout = part.get("timeout_s")
        if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
            raise ConnectorConfigError("kv_transfer_params.topkv.timeout_s must be > 0")
        return cls(part["transfer_id"], medium, None if timeout is None else float(timeout))


def report_of(params: Mapping[str, Any] | None) -> int | None:
    """The transfer id a report request asks about (``{"topkv": {"report_of": ID}}``)."""
    part = params.get("topkv") if params else None
    if not isinstance(part, Mapping) or "report_of" not in part:
        return None
    asked = part["report_of"]
    if isinstance(asked, bool) or not isinstance(asked, int) or asked < 0:
        raise ConnectorConfigError(
            f"kv_transfer_params.topkv.report_of must be an int >= 0, got {asked!r}"
        )
    return asked
