"""The TLS and etcd-credential flags the service commands share, and what they resolve to.

TLS (:mod:`topkv.service.http.tls`): ``--tls-cert`` and ``--tls-key`` make a server serve HTTPS;
``--tls-ca`` is the CA its own calls (and ``topkv status``) verify their peer with.

etcd (:mod:`topkv.relay.registry.etcd_access`, docs/etcd.md): ``--etcd-user``,
``--etcd-password-file``, ``--etcd-ca``, ``--etcd-cert`` and ``--etcd-key`` set the
``TOPKV_ETCD_*`` variables the registry reads (a flag wins over its variable). There is no
password flag on purpose: a command line is visible to every user in ``ps``.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import typer

from topkv.errors import ConfigError
from topkv.relay.registry.etcd_access import (
    ENV_CA,
    ENV_CERT,
    ENV_KEY,
    ENV_PASSWORD,
    ENV_PASSWORD_FILE,
    ENV_USER,
    is_etcd_url,
    parse_etcd_url,
)
from topkv.service.http.tls import ClientTLS, TLSConfig

CERT_HELP = "serve HTTPS with this PEM certificate (chain); needs --tls-key"
KEY_HELP = "the PEM private key of --tls-cert (keep it mode 0600)"


def tls_cert_option() -> Path | None:
    return typer.Option(None, "--tls-cert", help=CERT_HELP)  # type: ignore[no-any-return]


def tls_key_option() -> Path | None:
    return typer.Option(None, "--tls-key", help=KEY_HELP)  # type: ignore[no-any-return]


def tls_ca_option(help_text: str) -> Path | None:
    return typer.Option(None, "--tls-ca", help=help_text)  # type: ignore[no-any-return]


def server_tls(cert: Path | None, key: Path | None, ca: Path | None) -> TLSConfig | None:
    """A server's TLS from its flags, every file checked now (None: none given)."""
    return TLSConfig.from_files(cert, key, ca)


def client_tls(ca: Path | None) -> ClientTLS | None:
    """A client's verification from ``--tls-ca``, the file checked now (None: the system's
    trust store for ``https://`` URLs)."""
    if ca is None:
        return None
    tls = ClientTLS(ca)
    tls.context()
    return tls


# -- etcd credentials ------------------------------------------------------------------------


def etcd_user_option() -> str:
    return typer.Option(  # type: ignore[no-any-return]
        "", "--etcd-user", help=f"etcd user to log in as (else ${ENV_USER} or USER@ in the URL)"
    )


def etcd_password_file_option() -> Path | None:
    return typer.Option(  # type: ignore[no-any-return]
        None,
        "--etcd-password-file",
        help=f"file holding the etcd user's password (else ${ENV_PASSWORD_FILE})",
    )


def etcd_ca_option() -> Path | None:
    return typer.Option(  # type: ignore[no-any-return]
        None, "--etcd-ca", help=f"etcds://: the CA that signed etcd's certificate (else ${ENV_CA})"
    )


def etcd_cert_option() -> Path | None:
    return typer.Option(  # type: ignore[no-any-return]
        None, "--etcd-cert", help=f"etcds://: a client certificate for etcd (else ${ENV_CERT})"
    )


def etcd_key_option() -> Path | None:
    return typer.Option(  # type: ignore[no-any-return]
        None, "--etcd-key", help=f"etcds://: the key of --etcd-cert (else ${ENV_KEY})"
    )


#: Stands in a command's signature for the five ``--etcd-*`` flags: :func:`with_etcd_flags`
#: puts them in its place and calls the command with their ``TOPKV_ETCD_*`` variables.
ETCD_FLAGS: Mapping[str, str] = MappingProxyType({})

#: The ``--etcd-*`` parameters, in order: name, type, option.
_ETCD_PARAMETERS: tuple[tuple[str, object, Callable[[], object]], ...] = (
    ("etcd_user", str, etcd_user_option),
    ("etcd_password_file", Path | None, etcd_password_file_option),
    ("etcd_ca", Path | None, etcd_ca_option),
    ("etcd_cert", Path | None, etcd_cert_option),
    ("etcd_key", Path | None, etcd_key_option),
)


def with_etcd_flags(command: Callable[..., None]) -> Callable[..., None]:
    """``command`` taking the ``--etcd-*`` flags where its ``etcd`` parameter
    (default :data:`ETCD_FLAGS`) stands, and called with what they resolve to:
    :func:`etcd_env` of them."""
    signature = inspect.signature(command, eval_str=True)
    parameters: list[inspect.Parameter] = []
    for parameter in signature.parameters.values():
        if parameter.name != "etcd":
            parameters.append(parameter)
            continue
        parameters += [
            inspect.Parameter(name, parameter.kind, default=option(), annotation=kind)
            for name, kind, option in _ETCD_PARAMETERS
        ]

    @functools.wraps(command)
    def with_flags(**given: Any) -> None:
        flags = [given.pop(name) for name, _, _ in _ETCD_PARAMETERS]
        command(**given, etcd=etcd_env(*flags))

    with_flags.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    with_flags.__annotations__ = {p.name: p.annotation for p in parameters}
    with_flags.__annotations__["return"] = signature.return_annotation
    return with_flags


def etcd_env(
    user: str,
    password_file: Path | None,
    ca: Path | None,
    cert: Path | None,
    key: Path | None,
) -> dict[str, str]:
    """The ``TOPKV_ETCD_*`` variables the etcd flags stand for (files as absolute paths, so
    a child process in another directory finds them); a password never, only its file."""
    env: dict[str, str] = {ENV_USER: user} if user else {}
    files = ((ENV_PASSWORD_FILE, password_file), (ENV_CA, ca), (ENV_CERT, cert), (ENV_KEY, key))
    env.update({name: str(path.absolute()) for name, path in files if path is not None})
    return env


def etcd_flags(env: Mapping[str, str]) -> list[str]:
    """The command-line flags that stand for ``env`` (what ``cluster up`` gives its
    children): user names and file paths only."""
    return [item for name, value in env.items() for item in (_FLAG_OF[name], value)]


def check_etcd_env(registry: str, env: Mapping[str, str]) -> None:
    """ConfigError when etcd flags were given for a registry that is not etcd, or when the
    registry URL and these settings do not fit together (checked before anything starts)."""
    if not env:
        return
    if not registry or not is_etcd_url(registry):
        flags = ", ".join(sorted(_FLAG_OF[name] for name in env))
        raise ConfigError(
            f"{flags} apply to an etcd registry; --registry is {registry or 'not given'!r}"
        )
    parse_etcd_url(registry, env=merged_etcd_env(env, os.environ))


def merged_etcd_env(flags: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with the flags' variables over it; ``--etcd-password-file`` replaces an
    inherited ``$TOPKV_ETCD_PASSWORD`` (a flag wins over a variable)."""
    merged = dict(environ)
    if ENV_PASSWORD_FILE in flags:
        merged.pop(ENV_PASSWORD, None)
    merged.update(flags)
    return merged


def apply_etcd_env(
    registry: str, env: Mapping[str, str], environ: MutableMapping[str, str] | None = None
) -> None:
    """Check, then set the flags' variables in this process for ``open_registry``."""
    check_etcd_env(registry, env)
    target = os.environ if environ is None else environ
    if ENV_PASSWORD_FILE in env:
        target.pop(ENV_PASSWORD, None)
    target.update(env)


_FLAG_OF = {
    ENV_USER: "--etcd-user",
    ENV_PASSWORD_FILE: "--etcd-password-file",
    ENV_CA: "--etcd-ca",
    ENV_CERT: "--etcd-cert",
    ENV_KEY: "--etcd-key",
}
