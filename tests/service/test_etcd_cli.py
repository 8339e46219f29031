"""The etcd credential flags (``--etcd-user``, ``--etcd-password-file``, ``--etcd-ca``,
``--etcd-cert``, ``--etcd-key``) of the service commands, and ``topkv cluster up`` against an
etcd with ``auth enable`` (the live tests' server: ``tests/etcd_servers.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from etcd_servers import WORKER_PASSWORD, enable_auth, start_etcd, stop_etcd
from topkv.cli.options.security import apply_etcd_env, check_etcd_env, etcd_env, etcd_flags
from topkv.errors import ConfigError
from topkv.jsonout import loads_strict

TOPKV = [sys.executable, "-c", "from topkv.cli.main import app; app()"]


def test_the_etcd_flags_become_variables_and_child_flags(tmp_path: Path) -> None:
    password = tmp_path / "pw"
    password.write_text("secret-Zx9\n")
    env = etcd_env("worker", password, None, None, None)
    assert env == {"TOPKV_ETCD_USER": "worker", "TOPKV_ETCD_PASSWORD_FILE": str(password)}
    assert etcd_flags(env) == ["--etcd-user", "worker", "--etcd-password-file", str(password)]
    with pytest.raises(ConfigError, match=r"--etcd-password-file, --etcd-user apply to an etcd"):
        check_etcd_env("memory", env)
    with pytest.raises(ConfigError, match=r"TLS files are set .* etcd:// "):
        check_etcd_env("etcd://127.0.0.1:2379", etcd_env("", None, password, None, None))
    environ = {"TOPKV_ETCD_PASSWORD": "inherited"}
    apply_etcd_env("etcd://127.0.0.1:2379", env, environ)  # the flag wins over the variable
    assert environ == env
    check_etcd_env("memory", {})  # no flags: nothing to check


@pytest.mark.etcd
def test_cluster_up_registers_in_an_auth_enabled_etcd_with_the_flags(tmp_path: Path) -> None:
    etcd = start_etcd(tmp_path, "auth")
    try:
        enable_auth(etcd.port)
        password = tmp_path / "etcd-password"
        password.write_text(WORKER_PASSWORD + "\n")
        password.chmod(0o600)
        clean = {k: v for k, v in os.environ.items() if not k.startswith("TOPKV_ETCD_")}
        env = {**clean, "TOPKV_ETCD_PASSWORD": "inherited-wrong"}  # the flag wins over it

        def cluster_up(
            run_dir: Path, env: dict[str, str], *flags: str
        ) -> subprocess.CompletedProcess[str]:
            registry = ("--registry", f"etcd://127.0.0.1:{etcd.port}", "--port", "0")
            smoke = ("--smoke", "1", "--smoke-layers", "2", "--smoke-tokens", "16", "--json")
            return subprocess.run(
                [*TOPKV, "cluster", "up", *registry, *smoke, "--run-dir", str(run_dir), *flags],
                capture_output=True,
                text=True,
                timeout=60,
                env=env,
            )

        run_dir = tmp_path / "run"
        flags = ("--etcd-user", "worker", "--etcd-password-file", str(password))
        done = cluster_up(run_dir, env, *flags)
        assert done.returncode == 0, done.stderr
        smoke = loads_strict(done.stdout)["smoke"]
        assert smoke["submitted"] == smoke["verified"] == 1
        for text in [done.stdout, done.stderr, *(p.read_text() for p in run_dir.glob("*.log"))]:
            assert WORKER_PASSWORD not in text
        refused = cluster_up(tmp_path / "refused", clean)  # no credentials: etcd refuses them
        assert refused.returncode != 0
        assert "authentication enabled" in refused.stderr and "Traceback" not in refused.stderr
    finally:
        stop_etcd(etcd)
