"""One way to reach the Kubernetes API for topkv's commands: in-cluster (the pod's service
account) or ``$KUBECONFIG`` / ``~/.kube/config``, or an explicit server URL."""

from __future__ import annotations

import httpx2
from lightkube import Client, KubeConfig
from lightkube.config.models import Cluster, User

from topkv.errors import ConfigError


def api_client(
    server: str | None = None,
    *,
    namespace: str | None = None,
    token: str | None = None,
    timeout_s: float = 10.0,
) -> Client:
    """A client for ``server`` (with ``token``, or none) or, without one, from the
    environment; ConfigError when no credentials are found."""
    if server is not None:
        config = KubeConfig.from_one(
            cluster=Cluster(server=server), user=User(token=token), namespace=namespace
        )
    else:
        try:
            config = KubeConfig.from_env()
        except Exception as exc:  # lightkube raises its ConfigError or OSError
            raise ConfigError(
                f"no Kubernetes credentials ({exc}): run in a pod with a service account, "
                "set KUBECONFIG, or pass --server"
            ) from None
    return Client(config, namespace=namespace, timeout=httpx2.Timeout(timeout_s))
