"""Mooncake TE-backed transport between two real processes in a private network namespace.

Skips cleanly when the optional ``mooncake-transfer-engine-non-cuda`` package
(scripts/install-peers.sh) or network namespaces are unavailable. The cases themselves live
in engine_harness.py, shared with the NIXL engine.
"""

from __future__ import annotations

import pytest
from engine_harness import PeerEngineCases

from topkv.harness.netns import netns_available
from topkv.transport.arena.factory import missing_package

_why_not = missing_package("mooncake") or netns_available()
pytestmark = pytest.mark.skipif(_why_not is not None, reason=str(_why_not))


class TestMooncake(PeerEngineCases):
    transport = "mooncake"
    secret = b"mooncake-test-secret"
    option_sets = (
        pytest.param({}, id="default"),
        pytest.param({"protocol": "tcp"}, id="tcp"),
    )
