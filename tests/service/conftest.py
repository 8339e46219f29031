"""Fixtures for service tests: a real etcd server (on any address) and a cluster factory."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from service_helpers import start_etcd, stop_etcd

from topkv.service.cluster.local import ClusterConfig, LocalCluster


@pytest.fixture(scope="session")
def etcd_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, url = start_etcd("127.0.0.1", tmp_path_factory.mktemp("etcd"))
    try:
        yield url
    finally:
        stop_etcd(proc)


ClusterFactory = Callable[..., LocalCluster]


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[ClusterFactory]:
    """Start clusters of real processes; every one is stopped when the test ends."""
    started: list[LocalCluster] = []

    def make(**kwargs: object) -> LocalCluster:
        kwargs.setdefault("port", 0)
        config = ClusterConfig(**kwargs)  # type: ignore[arg-type]
        cluster = LocalCluster(config, tmp_path / f"cluster{len(started)}")
        started.append(cluster)
        cluster.start()
        return cluster

    try:
        yield make
    finally:
        for cluster in started:
            cluster.stop()
