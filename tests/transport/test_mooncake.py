"""Mooncake TE-backed transport between two real processes in a private network namespace.

Skips cleanly when the optional ``mooncake-transfer-engine-non-cuda`` package
(scripts/install-peers.sh) or network namespaces are unavailable. The cases themselves live
in arena_harness.py, shared with the NIXL transport.
"""

from __future__ import annotations

import pytest
from arena_harness import ArenaPeerCases

from topkv.harness.netns import netns_available
from topkv.transport.arena.factory import missing_package

_why_not = missing_package("mooncake") or netns_available()
pytestmark = pytest.mark.skipif(_why_not is not None, reason=str(_why_not))


class TestMooncake(ArenaPeerCases):
    transport = "mooncake"
    secret = b"mooncake-test-secret"
    option_sets = (
        pytest.param({}, id="default"),
        pytest.param({"protocol": "tcp"}, id="tcp"),
    )
