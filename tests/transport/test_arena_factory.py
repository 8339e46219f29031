"""The arena transports' factory: what ``register_all`` puts in the transport catalog."""

from __future__ import annotations

from typing import Any

import pytest

from topkv.transport import catalog
from topkv.transport.arena import factory as arena_factory
from topkv.transport.base import TransportMode
from topkv.transport.errors import TransportUnavailable


@pytest.fixture(autouse=True)
def scratch_catalog(monkeypatch: pytest.MonkeyPatch) -> None:
    """Register into a copy, so other tests see the catalog as it was."""
    monkeypatch.setattr(catalog, "_CATALOG", dict(catalog._CATALOG))


def test_registers_every_arena_transport_and_reports_why_one_is_missing() -> None:
    reasons = arena_factory.register_all()
    assert set(reasons) == {"nixl", "mooncake", "cuda"}
    for name, (mode, _) in arena_factory.ARENA_TRANSPORTS.items():
        info = catalog.get(name)
        assert (info.name, info.mode, info.emulated) == (name, mode, False)
        assert reasons[name] == arena_factory.missing_package(name)
        if reasons[name] is not None:
            assert "unavailable" in info.description
            with pytest.raises(TransportUnavailable, match=name):
                info.make_source(b"secret")
            with pytest.raises(TransportUnavailable, match=name):
                info.make_sink(b"secret")
    assert catalog.get("cuda").mode is TransportMode.NVLINK
    assert arena_factory.register_all() == reasons  # idempotent


def test_available_only_leaves_missing_transports_out() -> None:
    before = set(catalog.available())
    reasons = arena_factory.register_all(available_only=True)
    added = set(catalog.available()) - before
    assert added == {name for name, reason in reasons.items() if reason is None}


def test_registered_factories_bind_host_and_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str, bytes, dict[str, Any]]] = []

    def fake(kind: str) -> Any:
        def make(name: str, secret: bytes, **options: Any) -> str:
            calls.append((kind, name, secret, options))
            return f"{kind}:{name}"

        return make

    monkeypatch.setattr(arena_factory, "missing_package", lambda name: None)
    monkeypatch.setattr(arena_factory, "make_sink", fake("sink"))
    monkeypatch.setattr(arena_factory, "make_source", fake("source"))
    assert arena_factory.register_all(host="10.0.0.7", capacity_bytes=1 << 20) == dict.fromkeys(
        arena_factory.ARENA_TRANSPORTS
    )
    for name in arena_factory.ARENA_TRANSPORTS:
        catalog.get(name).make_sink(b"s")
        catalog.get(name).make_source(b"s")
    sinks = {name: options for kind, name, _, options in calls if kind == "sink"}
    sources = {name: options for kind, name, _, options in calls if kind == "source"}
    bound = {"host": "10.0.0.7", "capacity_bytes": 1 << 20}
    assert sinks == {name: bound for name in arena_factory.ARENA_TRANSPORTS}
    assert sources == {"nixl": {}, "mooncake": {"host": "10.0.0.7"}, "cuda": {}}
