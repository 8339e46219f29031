"""The connector's media without vLLM: what an instance offers, what its settings allow, and
which medium the picker's policy gives a pair (nixl among them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from topkv.integrations.vllm.connector.media import offered_media, pair_medium
from topkv.integrations.vllm.connector.params import MEDIA, ConnectorConfigError, ConnectorSettings
from topkv.integrations.vllm.frontdoor.picker import NoInstance, Picker
from topkv.relay.executor import AttemptPlan
from topkv.relay.registry.memory import MemoryRegistry
from topkv.relay.workers import WorkerCapabilities, WorkerInfo
from topkv.service.orchestrator.executor import RemoteExecutor
from topkv.service.worker.media import why_unavailable
from topkv.transport import media as path_media
from topkv.transport.base import KVLayout
from topkv.transport.media import MediumChoice

NIXL = "nixl://127.0.0.1:9100"


def _worker(
    worker_id: str,
    role: str,
    host: str,
    media: tuple[str, ...],
    *,
    rdma: bool = False,
    sinks: tuple[str, ...] = (),
) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        role=role,  # type: ignore[arg-type]
        node=host,
        host_id=host,
        capabilities=WorkerCapabilities(media=media, rdma=rdma),
        address=f"tcp://{worker_id}:7000" if "tcp" in media else "",
        control_url=f"http://{worker_id}",
        sink_addresses=sinks,
    )


def _settings(tmp_path: Path, **extra: object) -> ConnectorSettings:
    (tmp_path / "secret").write_text("x" * 32)
    return ConnectorSettings.from_extra(
        {"secret_file": str(tmp_path / "secret"), **extra}, "kv_consumer"
    )


def test_media_setting_is_checked_and_kept_in_order(tmp_path: Path) -> None:
    assert _settings(tmp_path).media is None  # the default: every medium installed here
    assert _settings(tmp_path, media=["nixl", "tcp"]).media == ("tcp", "nixl")
    assert _settings(tmp_path, media="tcp,shm").media == ("shm", "tcp")
    with pytest.raises(ConnectorConfigError, match="unknown medium carrier"):
        _settings(tmp_path, media=["tcp", "carrier"])
    with pytest.raises(ConnectorConfigError, match="non-empty list"):
        _settings(tmp_path, media=[])
    assert _settings(tmp_path).ucx_tls  # NIXL's agents get a UCX transport list


def test_the_offer_is_what_is_installed_or_exactly_what_was_asked(tmp_path: Path) -> None:
    offer = offered_media(_settings(tmp_path))
    assert {"shm", "tcp"} <= set(offer.media)
    for medium in MEDIA:  # each medium is offered or says why not
        assert (medium in offer.media) != (medium in offer.unavailable)
        assert (medium in offer.media) == (why_unavailable(medium) is None)
    assert offered_media(_settings(tmp_path, media=["tcp"])).media == ("tcp",)
    missing = [m for m in ("nixl", "mooncake") if why_unavailable(m) is not None]
    for medium in missing:  # forcing a medium this host lacks is an error, not a fallback
        with pytest.raises(ConnectorConfigError, match=medium):
            offered_media(_settings(tmp_path, media=[medium]))


def test_the_policy_picks_the_medium_from_what_both_offer() -> None:
    registry = MemoryRegistry()
    picker = Picker(registry, "/run/x", affinity=False)
    everything = ("shm", "tcp", "nixl")
    registry.register(_worker("p0", "prefill", "hostA", everything))
    registry.register(_worker("d0", "decode", "hostA", everything, sinks=(NIXL,)))
    registry.register(_worker("d1", "decode", "hostA", ("shm", "tcp")))

    assert picker.pick(1 << 20).medium == "shm"  # one host: the pcie path, over shm
    route = picker.pick(1 << 20, media=["nixl"])
    assert (route.decode.worker_id, route.medium, route.destination) == ("d0", "nixl", NIXL)
    # restricted to tcp and nixl, the same-host pcie path's own order (shm, tcp) decides
    assert picker.pick(1 << 20, media=["tcp", "nixl"]).medium == "tcp"
    with pytest.raises(NoInstance, match="nixl"):
        picker.pick(1 << 20, exclude={"d0"}, media=["nixl"])


def test_an_rdma_pair_across_hosts_goes_over_nixl_where_both_offer_it() -> None:
    prefill = _worker("p0", "prefill", "hostA", ("tcp", "nixl"), rdma=True)
    decode = _worker("d0", "decode", "hostB", ("tcp", "nixl"), rdma=True, sinks=(NIXL,))
    assert pair_medium("rdma", prefill, decode)[0] == "nixl"
    tcp_only = _worker("d1", "decode", "hostB", ("tcp",), rdma=True)
    assert pair_medium("rdma", prefill, tcp_only)[0] == "tcp"
    medium, why = pair_medium("pcie", prefill, decode, ["shm"])
    assert medium is None and "shm" in why  # shm cannot join two hosts

    registry = MemoryRegistry()
    registry.register(prefill)
    registry.register(decode)
    route = Picker(registry, "/run/x", affinity=False).pick(1 << 20)
    assert (route.path_class, route.medium, route.destination) == ("rdma", "nixl", NIXL)


def test_the_executor_and_the_connector_make_one_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """The orchestrator's executor and the connector's pair_medium both ask
    topkv.transport.media.medium_for which medium carries a pair's path class."""
    asked: list[tuple[str, str | None]] = []
    decide = path_media.medium_for

    def recording(path_class: str, *args: Any, **kwargs: Any) -> MediumChoice:
        choice = decide(path_class, *args, **kwargs)
        asked.append((path_class, choice.medium))
        return choice

    monkeypatch.setattr(path_media, "medium_for", recording)
    prefill = _worker("p0", "prefill", "hostA", ("tcp", "nixl"), rdma=True)
    decode = _worker("d0", "decode", "hostB", ("tcp", "nixl"), rdma=True, sinks=(NIXL,))
    plan = AttemptPlan(1, "m", KVLayout(1, 1, 1, 1), prefill, decode, "rdma", 1, 1.0)
    assert RemoteExecutor().medium_for(plan) == "nixl"
    assert asked == [("rdma", "nixl")]
    assert pair_medium("tcp", prefill, decode)[0] == "tcp"
    assert asked == [("rdma", "nixl"), ("tcp", "tcp")]
