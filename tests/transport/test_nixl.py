"""NIXL-backed transport between two real processes in a private network namespace.

Skips cleanly when the optional ``nixl-cu12`` package (scripts/install-peers.sh) or network
namespaces are unavailable. The cases themselves live in engine_harness.py, shared with the
Mooncake TE engine.
"""

from __future__ import annotations

import pytest
from engine_harness import PeerEngineCases

from topkv.harness.netns import netns_available
from topkv.transport.arena.factory import missing_package

_why_not = missing_package("nixl") or netns_available()
pytestmark = pytest.mark.skipif(_why_not is not None, reason=str(_why_not))


class TestNixl(PeerEngineCases):
    transport = "nixl"
    secret = b"nixl-test-secret"
    option_sets = (
        pytest.param({}, id="ucx-default"),
        pytest.param({"ucx_tls": "tcp"}, id="ucx-tcp"),
    )
