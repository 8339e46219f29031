"""Throwaway certificate authorities and certificates for TLS tests, made with ``openssl``.

Shared by the etcd live tests and the control-plane TLS tests (``tests/`` is on the test
path). Every key is an unencrypted P-256 key written with mode 0600; certificates last two
days and name ``IP:127.0.0.1`` and ``DNS:localhost`` unless told otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

LOOPBACK_NAMES = "IP:127.0.0.1,DNS:localhost"


def need_openssl() -> None:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed; it makes the test certificates")


def openssl(workdir: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=workdir, check=True, capture_output=True, timeout=30)


def _private(path: Path) -> None:
    os.chmod(path, 0o600)


def make_ca(workdir: Path, name: str) -> Path:
    """``NAME.crt`` and ``NAME.key`` in ``workdir``: a self-signed CA; returns the cert."""
    openssl(
        workdir,
        *("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"),
        *("-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}"),
        *("-addext", "basicConstraints=critical,CA:TRUE"),
        *("-addext", "keyUsage=critical,keyCertSign,cRLSign"),
    )
    _private(workdir / f"{name}.key")
    return workdir / f"{name}.crt"


def make_leaf(
    workdir: Path, ca: str, name: str, usage: str, names: str = LOOPBACK_NAMES
) -> tuple[Path, Path]:
    """``NAME.crt`` signed by CA ``ca`` (extendedKeyUsage ``usage``, subjectAltName
    ``names``) and ``NAME.key``; returns (cert, key)."""
    openssl(
        workdir,
        *("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"),
        *("-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}"),
    )
    _private(workdir / f"{name}.key")
    (workdir / f"{name}.ext").write_text(
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        f"extendedKeyUsage={usage}\nsubjectAltName={names}\n"
    )
    openssl(
        workdir,
        *("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key"),
        *("-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext"),
    )
    return workdir / f"{name}.crt", workdir / f"{name}.key"
