"""The tokens of one local cluster (``topkv cluster up``, chaos, the demo), and their files.

Written into the run directory with mode 0600 before any process starts:

* ``token``: the admin token (submit, cancel, read everything, delete any worker; the
  orchestrator's executor presents it to the workers' control APIs);
* ``worker-token``: a worker token, for adding a worker to the cluster by hand;
* ``tokens/<worker>.token``: each worker's own worker token (so no worker can act for
  another's id: a worker id belongs to the token that registered it);
* ``tokens/worker-tokens``: every worker token the orchestrator accepts;
* ``tokens/control.sha256``: the admin token's SHA-256, which the workers' control APIs
  accept; the workers never hold the admin token itself.

The data plane's shared secret is not among them: the supervisor hands it to each process
it starts in that process's environment, never over the control plane.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from topkv.service.http.auth import (
    Credentials,
    ServerAuth,
    digest_line,
    new_token,
    write_token_file,
)

ADMIN_FILE = "token"
WORKER_FILE = "worker-token"
TOKENS_DIR = "tokens"


@dataclass(frozen=True)
class ClusterTokens:
    """An admin token, a shared worker token and a key deriving each worker's own token."""

    admin: str = field(default_factory=new_token)
    worker: str = field(default_factory=new_token)
    _worker_key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)

    def worker_token(self, worker_name: str) -> str:
        """The worker token of ``worker_name`` (the same name gives the same token)."""
        mac = hmac.new(self._worker_key, worker_name.encode(), hashlib.sha256).digest()
        return "tkv_w_" + base64.urlsafe_b64encode(mac).decode().rstrip("=")

    def worker_tokens(self, worker_names: Iterable[str]) -> list[str]:
        return [self.worker, *(self.worker_token(name) for name in worker_names)]

    def orchestrator_auth(self, worker_names: Iterable[str]) -> ServerAuth:
        """What an in-process registration server or orchestrator of this cluster accepts."""
        credentials = Credentials.of(admin=[self.admin], worker=self.worker_tokens(worker_names))
        return ServerAuth(credentials, client_token=self.admin)

    def write(self, run_dir: Path, worker_names: Iterable[str]) -> TokenFiles:
        """Write every token file of the cluster (mode 0600); where they are."""
        names = list(worker_names)
        tokens = run_dir / TOKENS_DIR
        files = TokenFiles(
            admin=write_token_file(run_dir / ADMIN_FILE, self.admin),
            worker=write_token_file(run_dir / WORKER_FILE, self.worker),
            accepted_workers=write_token_file(
                tokens / "worker-tokens", "\n".join(self.worker_tokens(names))
            ),
            control=write_token_file(tokens / "control.sha256", digest_line(self.admin)),
            tokens_dir=tokens,
        )
        for name in names:
            write_token_file(files.of_worker(name), self.worker_token(name))
        return files


@dataclass(frozen=True)
class TokenFiles:
    admin: Path
    worker: Path
    accepted_workers: Path
    control: Path
    tokens_dir: Path

    def of_worker(self, worker_name: str) -> Path:
        return self.tokens_dir / f"{worker_name}.token"
