"""NIXL-backed transport between two real processes in a private network namespace.

Skips cleanly when the optional ``nixl-cu12`` package (scripts/install-peers.sh) or network
namespaces are unavailable. The cases themselves live in arena_harness.py, shared with the
Mooncake TE transport.
"""

from __future__ import annotations

import pytest
from arena_harness import ArenaPeerCases

from topkv.harness.netns import netns_available
from topkv.transport.arena.factory import missing_package

_why_not = missing_package("nixl") or netns_available()
pytestmark = pytest.mark.skipif(_why_not is not None, reason=str(_why_not))


class TestNixl(ArenaPeerCases):
    transport = "nixl"
    secret = b"nixl-test-secret"
    option_sets = (
        pytest.param({}, id="ucx-default"),
        pytest.param({"ucx_tls": "tcp"}, id="ucx-tcp"),
    )
