"""Every medium a worker's host has is offered, selectable by the orchestrator, and forcible.

The contract of issue 12: ``topkv cluster up --prefill 1 --decode 1 --media tcp,shm,nixl,
mooncake --smoke 4 --force-transport X --json`` in a private network namespace prints one
JSON object whose ``results`` carry ``"transport": X`` and ``"verified": true``, exit 0; a
medium that is not installed exits 2 naming it and how to install it. NIXL and Mooncake are
optional (scripts/install-peers.sh): their cases skip cleanly without them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from topkv.errors import ConfigError
from topkv.harness.netns import netns_available
from topkv.jsonout import loads_strict
from topkv.relay.executor import AttemptFailed, AttemptPlan
from topkv.relay.transfers import FailureKind
from topkv.relay.workers import WorkerCapabilities, WorkerInfo
from topkv.service.orchestrator.executor import RemoteExecutor
from topkv.service.worker.media import (
    check_medium,
    parse_media,
    resolve_media,
    served_media,
    why_unavailable,
)
from topkv.transport import catalog
from topkv.transport.arena import factory as arena_factory
from topkv.transport.base import KVLayout

TOPKV = [sys.executable, "-c", "from topkv.cli.main import app; app()"]
_NETNS = netns_available()
_INSTALLED = [m for m in ("nixl", "mooncake") if why_unavailable(m) is None]


def _cluster_up(tmp_path: Path, *args: str, in_netns: bool) -> subprocess.CompletedProcess[str]:
    argv = [*TOPKV, "cluster", "up", "--port", "0", "--run-dir", str(tmp_path), *args]
    if in_netns:  # a private namespace with only loopback: NIXL and Mooncake bind every interface
        argv = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def _medium_case(medium: str) -> object:
    marks = []
    if medium in ("nixl", "mooncake"):
        reason = why_unavailable(medium) or (f"network namespace: {_NETNS}" if _NETNS else None)
        marks.append(pytest.mark.skipif(reason is not None, reason=str(reason)))
    return pytest.param(medium, marks=marks, id=medium)


@pytest.mark.parametrize("medium", [_medium_case(m) for m in ("tcp", "shm", "nixl", "mooncake")])
def test_cluster_up_forced_smoke_reports_the_medium(tmp_path: Path, medium: str) -> None:
    media = ",".join(["tcp", "shm", *_INSTALLED])
    done = _cluster_up(
        tmp_path,
        *("--prefill", "1", "--decode", "1", "--media", media, "--smoke", "4"),
        *("--force-transport", medium, "--json"),
        in_netns=_NETNS is None,
    )
    assert done.returncode == 0, done.stderr + done.stdout
    report = loads_strict(done.stdout)  # one JSON object, nothing else on stdout
    assert set(report) == {"cluster", "smoke", "results"}
    assert len(report["results"]) == 4
    for result in report["results"]:
        assert result["transport"] == medium and result["verified"] is True, result
        assert result["emulated"] is False and result["attempts"] == 1
    assert report["smoke"]["verified"] == 4
    assert {r["medium"] for r in report["smoke"]["results"]} == {medium}
    for worker in report["cluster"]["workers"]:
        assert worker["media"] == media.split(","), worker


def _shim_without(tmp_path: Path, module: str) -> dict[str, str]:
    """An environment in which ``module`` is present but cannot load (as without its libs)."""
    package, _, child = module.partition(".")
    shim = tmp_path / "shim" / package
    shim.mkdir(parents=True)
    broken = 'raise ImportError("simulated: not installed")\n'
    (shim / "__init__.py").write_text("" if child else broken)
    if child:
        (shim / f"{child}.py").write_text(broken)
    path = os.pathsep.join([str(tmp_path / "shim"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


@pytest.mark.parametrize("medium", ["nixl", "mooncake"])
def test_a_medium_not_installed_exits_2_naming_it_and_the_install(
    tmp_path: Path, medium: str
) -> None:
    module = {"nixl": "nixl_cu12", "mooncake": "mooncake.engine"}[medium]
    env = _shim_without(tmp_path, module)
    forced = subprocess.run(
        [*TOPKV, "cluster", "up", "--port", "0", "--smoke", "4", "--force-transport", medium],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    worker = subprocess.run(
        [*TOPKV, "worker", "--role", "decode", "--media", f"tcp,{medium}",
         "--orchestrator", "http://127.0.0.1:9"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    for done in (forced, worker):
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("topkv: error:") and "Traceback" not in done.stderr
        assert medium in done.stderr and "scripts/install-peers.sh" in done.stderr


@pytest.mark.skipif(why_unavailable("cuda") is None, reason="this host has a usable GPU")
def test_cuda_without_a_gpu_is_refused_cleanly() -> None:
    done = subprocess.run(
        [*TOPKV, "cluster", "up", "--port", "0", "--smoke", "1", "--force-transport", "cuda"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "cuda" in done.stderr and "GPU" in done.stderr
    assert "Traceback" not in done.stderr
    with pytest.raises(ConfigError, match="cuda"):
        resolve_media(("tcp", "cuda"))


def test_media_parsing_and_the_default_offer() -> None:
    assert parse_media("") is None
    assert parse_media("shm, tcp,shm") == ("tcp", "shm")
    with pytest.raises(ConfigError, match="unknown medium carrier-pigeon"):
        parse_media("tcp,carrier-pigeon")
    offer = resolve_media(None)
    assert offer.media[:2] == ("tcp", "shm")
    assert set(offer.media) | set(offer.unavailable) == {"tcp", "shm", "nixl", "mooncake", "cuda"}
    assert "shm" not in resolve_media(None, shm=False).media
    with pytest.raises(ConfigError, match="contradicts --no-shm"):
        resolve_media(("tcp", "shm"), shm=False)


def test_a_synthetic_worker_offering_every_medium_never_imports_torch() -> None:
    code = (
        "import sys; from topkv.service.worker.service import WorkerService; "
        "from topkv.service.compute.engines import EngineSpec, build_engine; "
        "from topkv.service.worker.media import resolve_media, register_arena_media; "
        "build_engine(EngineSpec()); offer = resolve_media(None); "
        "register_arena_media(offer.media, '127.0.0.1'); "
        "print('torch' in sys.modules, offer.media)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    if why_unavailable("cuda") is not None:  # no GPU node: cuda is never probed
        assert done.stdout.startswith("False"), done.stdout


def test_register_all_registers_only_the_arena_transports_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(catalog, "_CATALOG", dict(catalog._CATALOG))
    probed: list[str] = []
    monkeypatch.setattr(arena_factory, "missing_package", lambda name: probed.append(name))
    before = set(catalog.available())
    assert arena_factory.register_all(names=["nixl"]) == {"nixl": None}
    assert probed == ["nixl"] and set(catalog.available()) - before == {"nixl"}


def _worker(worker_id: str, host: str, media: tuple[str, ...], rdma: bool = False) -> WorkerInfo:
    role = "prefill" if worker_id.startswith("p") else "decode"
    caps = WorkerCapabilities(rdma=rdma, shm="shm" in media, tcp="tcp" in media, media=media)
    return WorkerInfo(worker_id=worker_id, role=role, node=host, host_id=host, capabilities=caps)


def _plan(path_class: str, src: WorkerInfo, dst: WorkerInfo, request_id: int = 1) -> AttemptPlan:
    return AttemptPlan(request_id, "m", KVLayout(1, 1, 1, 1), src, dst, path_class, 1, 1.0)


def test_the_orchestrator_selects_an_engine_medium_both_workers_offer() -> None:
    executor = RemoteExecutor()
    both = ("tcp", "shm", "nixl", "mooncake")
    p, d = _worker("p0", "a", both, rdma=True), _worker("d0", "b", both, rdma=True)
    assert executor.medium_for(_plan("rdma", p, d)) == "nixl"
    plain = _worker("d1", "b", ("tcp", "shm"), rdma=True)
    assert executor.medium_for(_plan("rdma", p, plain)) == "emulated-rdma"
    assert executor.medium_for(_plan("tcp", p, d)) == "tcp"
    executor.force_medium(1, "mooncake")
    assert executor.medium_for(_plan("pcie", p, d)) == "mooncake"
    with pytest.raises(AttemptFailed) as refused:
        executor.medium_for(_plan("pcie", p, plain))
    assert refused.value.kind == FailureKind.TRANSPORT
    assert "d1 does not offer mooncake" in str(refused.value)
    executor.force_medium(1, None)
    assert executor.medium_for(_plan("tcp", p, plain)) == "tcp"


def test_registrations_list_media_and_old_ones_mean_tcp_and_shm() -> None:
    assert served_media(_worker("p0", "a", ("tcp", "nixl"))) == {"tcp", "nixl"}
    legacy = WorkerInfo(worker_id="p1", role="prefill", node="a", host_id="a")
    assert served_media(legacy) == {"tcp", "shm"}
    shm_only = _worker("d0", "b", ("shm",))
    assert "needs one host" in str(check_medium("shm", _worker("p0", "a", ("shm",)), shm_only))
    assert "does not offer tcp" in str(check_medium("emulated-rdma", legacy, shm_only))
