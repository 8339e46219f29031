"""Two-process cases shared by the host-memory arena transports (NIXL, Mooncake TE).

Each transport's test module subclasses :class:`ArenaPeerCases`, names its transport, secret
and option sets, and skips itself when its package or network namespaces are missing. Every
case starts a sink process and a sender process that share one loopback-only namespace, so
the library's every-interface listeners stay private.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import ClassVar

import pytest

from topkv.harness.netns import PrivateNetns
from topkv.harness.peers import expected_digest, spawn_sender, spawn_sink
from topkv.transport.base import KVLayout

LAYOUTS = [
    KVLayout(4, 64, 4, 64, "fp16"),
    KVLayout(3, 33, 2, 128, "fp32"),
    KVLayout(5, 100, 1, 576, "bf16", latent=True),
    KVLayout(2, 128, 8, 64, "fp8"),
]


class ArenaPeerCases:
    """The cases every such arena transport must pass; subclasses set the class attributes."""

    transport: ClassVar[str]
    secret: ClassVar[bytes]
    # Transport options as pytest.param(options, id=...); the bit-exact case runs once per entry.
    option_sets: ClassVar[tuple[object, ...]]

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "options" in metafunc.fixturenames:
            metafunc.parametrize("options", self.option_sets)

    @pytest.fixture
    def netns(self) -> Iterator[PrivateNetns]:
        with PrivateNetns() as ns:
            yield ns

    @pytest.mark.timeout(180)
    def test_moves_random_kv_of_several_shapes_bit_exactly(
        self, netns: PrivateNetns, options: dict[str, str]
    ) -> None:
        sink, address = spawn_sink(
            netns, self.transport, self.secret, first=10, count=len(LAYOUTS), options=options
        )
        try:
            for index, layout in enumerate(LAYOUTS):
                seed = 10 + index
                sender = spawn_sender(
                    netns, self.transport, address, self.secret, seed, layout, options=options
                )
                try:
                    sent = sender.record(60)
                    got = sink.record(60)
                finally:
                    sender.stop()
                assert sent["ok"] is True, sent
                assert got == {
                    "rid": seed,
                    "ok": True,
                    "sha256": expected_digest(layout.total_bytes, seed),
                }
        finally:
            sink.stop()

    @pytest.mark.timeout(120)
    def test_corruption_is_caught_by_crc64_on_both_sides(self, netns: PrivateNetns) -> None:
        sink, address = spawn_sink(netns, self.transport, self.secret, first=5)
        sender = spawn_sender(
            netns, self.transport, address, self.secret, 5, LAYOUTS[0], mode="corrupt"
        )
        try:
            got = sink.record(60)
            sent = sender.record(60)
        finally:
            sender.stop()
            sink.stop()
        assert (got["ok"], got["error"]) == (False, "ChecksumMismatch")
        assert "CRC-64" in got["message"]
        assert (sent["ok"], sent["error"]) == (False, "ChecksumMismatch")

    @pytest.mark.timeout(120)
    def test_sender_killed_mid_transfer_fails_the_receiver_fast(self, netns: PrivateNetns) -> None:
        sink, address = spawn_sink(netns, self.transport, self.secret, first=9)
        sender = spawn_sender(
            netns, self.transport, address, self.secret, 9, LAYOUTS[0], mode="hang-after-2"
        )
        try:
            sender.line("SENT2", 60)
            sink.line("LAYER 9 1", 60)  # both layers landed and were verified
            sender.stop()
            start = time.monotonic()
            got = sink.record(30)
            assert time.monotonic() - start < 10
        finally:
            sink.stop()
        assert (got["ok"], got["error"]) == (False, "PeerDied")
        assert "2/4 layers" in got["message"]

    @pytest.mark.timeout(120)
    def test_receiver_killed_fails_the_sender_cleanly(self, netns: PrivateNetns) -> None:
        sink, address = spawn_sink(netns, self.transport, self.secret, first=3)
        sender = spawn_sender(
            netns,
            self.transport,
            address,
            self.secret,
            3,
            LAYOUTS[0],
            mode="wait-before-2",
            repeat=2,
        )
        try:
            assert sender.record(60)["ok"] is True
            assert sink.record(60)["ok"] is True
            sender.line("WAITING", 30)
            sink.stop()
            sender.tell()
            start = time.monotonic()
            sent = sender.record(30)
            assert time.monotonic() - start < 10
        finally:
            sender.stop()
        assert (sent["ok"], sent["error"]) == (False, "PeerDied")

    @pytest.mark.timeout(120)
    def test_a_sender_without_the_secret_is_refused(self, netns: PrivateNetns) -> None:
        sink, address = spawn_sink(netns, self.transport, self.secret, first=4)
        sender = spawn_sender(netns, self.transport, address, b"wrong-secret", 4, LAYOUTS[0])
        try:
            sent = sender.record(60)
        finally:
            sender.stop()
            sink.stop()
        assert (sent["ok"], sent["error"]) == (False, "AuthenticationFailed")
