"""``topkv router --adp``: which kv_both sets it accepts (the policy never moves the last
decode instance, and a kv_consumer now counts as one)."""

from __future__ import annotations

import pytest

from topkv.cli.router import _adp_options
from topkv.errors import ConfigError


def test_adp_needs_a_kv_both_instance() -> None:
    with pytest.raises(ConfigError, match="at least one kv_both instance"):
        _adp_options("on", [], None, 2.0)


def test_one_kv_both_instance_is_enough_and_off_is_none() -> None:
    options = _adp_options("on", ["both0"], "token", 0.5)
    assert options is not None
    assert options.movable == frozenset({"both0"})
    assert options.config.ttft_target_s == 0.5
    assert _adp_options("off", ["both0"], None, 2.0) is None
