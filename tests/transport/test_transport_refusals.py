"""Unauthenticated peers and oversize headers are refused before anything is allocated."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from topkv.transport import framing
from topkv.transport.base import KVLayout, TransferDescriptor, TransferSink
from topkv.transport.errors import AuthenticationFailed, FrameRejected
from topkv.transport.shm import ShmSink, ShmSource, parse_shm_address
from topkv.transport.stream.handshake import HELLO, NONCE_SIZE, client_handshake
from topkv.transport.stream.receiving import HostAllocator, read_message
from topkv.transport.tcp import TcpSink, TcpSource, parse_tcp_address

SECRET = b"right-secret"
SMALL = KVLayout(2, 16, 2, 16, "fp16")


@pytest.fixture
def tcp_sink() -> Iterator[tuple[TcpSink, HostAllocator]]:
    allocator = HostAllocator()
    sink = TcpSink(
        SECRET, allocator=allocator, limits=framing.ReceiveLimits(max_transfer_bytes=1 << 20)
    )
    yield sink, allocator
    sink.close()


def _connect(sink: TransferSink) -> socket.socket:
    if sink.address.startswith("tcp://"):
        return socket.create_connection(parse_tcp_address(sink.address), timeout=5)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(parse_shm_address(sink.address))
    return sock


def test_wrong_secret_is_refused_by_tcp(tcp_sink: tuple[TcpSink, HostAllocator]) -> None:
    sink, allocator = tcp_sink
    source = TcpSource(b"wrong-secret")
    out = source.open(TransferDescriptor(1, "m", SMALL), sink.address)
    tensor = bytes(SMALL.tensor_bytes)
    for layer in range(SMALL.num_layers):
        out.send_layer(layer, [tensor, tensor])
    with pytest.raises(AuthenticationFailed):
        out.finish().result(10)
    source.close()
    assert allocator.allocations == 0


def test_wrong_secret_is_refused_by_shm() -> None:
    sink = ShmSink(SECRET)
    source = ShmSource(b"wrong-secret")
    try:
        with pytest.raises(AuthenticationFailed):
            source.open(TransferDescriptor(1, "m", SMALL), sink.address)
    finally:
        source.close()
        sink.close()


def test_garbage_peer_is_dropped_before_any_allocation(
    tcp_sink: tuple[TcpSink, HostAllocator],
) -> None:
    sink, allocator = tcp_sink
    with _connect(sink) as sock:
        hello = sock.recv(64)
        assert hello.startswith(HELLO) and len(hello) == len(HELLO) + NONCE_SIZE
        # A transfer header instead of the handshake answer: the server must hang up.
        header = framing.encode_transfer_header(TransferDescriptor(1, "m", SMALL))
        sock.sendall(header)
        with contextlib.suppress(ConnectionResetError):  # a reset (unread bytes) is fine too
            assert sock.recv(64) == b""
    assert allocator.allocations == 0


def test_oversize_header_is_rejected_before_allocation(
    tcp_sink: tuple[TcpSink, HostAllocator],
) -> None:
    sink, allocator = tcp_sink
    huge = KVLayout(80, 1 << 20, 8, 128, "fp16")  # 320 GiB claimed
    with _connect(sink) as sock:
        client_handshake(sock, SECRET)
        sock.sendall(framing.encode_transfer_header(TransferDescriptor(2, "m", huge)))
        reply = read_message(sock, framing.ReceiveLimits())
    assert isinstance(reply, framing.Control)
    assert reply.status == framing.ControlStatus.REJECTED
    assert "exceeds the receive limit" in reply.text
    assert allocator.allocations == 0


def test_mismatched_tensor_size_is_rejected() -> None:
    raw = bytearray(framing.encode_transfer_header(TransferDescriptor(3, "m", SMALL)))
    raw[40:48] = (12345).to_bytes(8, "little")  # tensor_bytes field
    with pytest.raises(FrameRejected, match="bytes per tensor"):
        framing.decode_transfer_header(bytes(raw), framing.ReceiveLimits())


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=framing.TRANSFER_HEADER_SIZE, max_size=framing.TRANSFER_HEADER_SIZE))
def test_random_transfer_headers_never_pass_unchecked(data: bytes) -> None:
    limits = framing.ReceiveLimits(max_transfer_bytes=1 << 30)
    data = framing.TRANSFER_MAGIC + data[8:]
    try:
        descriptor, streams = framing.decode_transfer_header(data, limits)
    except FrameRejected:
        return
    assert descriptor.layout.total_bytes <= limits.max_transfer_bytes
    assert 1 <= streams <= limits.max_streams


@given(
    layers=st.integers(1, 64),
    seq=st.integers(1, 4096),
    heads=st.integers(1, 16),
    dim=st.integers(1, 256),
    dtype=st.sampled_from(["fp8", "fp16", "bf16", "fp32"]),
    latent=st.booleans(),
    rid=st.integers(0, 2**64 - 1),
)
def test_transfer_header_round_trips(
    layers: int, seq: int, heads: int, dim: int, dtype: str, latent: bool, rid: int
) -> None:
    descriptor = TransferDescriptor(
        rid, "model-x", KVLayout(layers, seq, heads, dim, dtype, latent)
    )
    decoded, streams = framing.decode_transfer_header(
        framing.encode_transfer_header(descriptor, 3), framing.ReceiveLimits()
    )
    assert (decoded, streams) == (descriptor, 3)


def test_layer_header_for_another_request_is_rejected() -> None:
    mine = TransferDescriptor(1, "m", SMALL)
    other = TransferDescriptor(2, "m", SMALL)
    raw = framing.encode_layer_header(other, 0, (1, 2))
    with pytest.raises(FrameRejected, match="another request"):
        framing.decode_layer_header(raw, mine)
    bigger = TransferDescriptor(1, "m", KVLayout(2, 32, 2, 16, "fp16"))
    with pytest.raises(FrameRejected):
        framing.decode_layer_header(framing.encode_layer_header(bigger, 0, (1, 2)), mine)
