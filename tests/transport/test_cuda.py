"""CUDA transport (PyTorch peer copies, CUDA IPC, pinned staging) and shared arena pieces.

The GPU cases need a CUDA build of torch and at least one GPU; without one they skip with
the reason. The arena allocator and the IPC-handle decoder run everywhere.
"""

from __future__ import annotations

import pickle
import threading

import pytest

from topkv.harness.peers import expected_digest, kv_digest, spawn_sender, spawn_sink
from topkv.transport.arena.factory import missing_package
from topkv.transport.arena.protocol import ARENA_ALIGN, Arena, parse_arena_address
from topkv.transport.base import KVLayout, TransferDescriptor
from topkv.transport.errors import FrameRejected, ResourceExhausted, TransportError

SECRET = b"cuda-test-secret"
LAYOUTS = [
    KVLayout(4, 64, 4, 64, "fp16"),
    KVLayout(3, 33, 2, 128, "fp32"),
    KVLayout(5, 100, 1, 576, "bf16", latent=True),
]
_no_gpu = missing_package("cuda")
needs_gpu = pytest.mark.skipif(_no_gpu is not None, reason=str(_no_gpu))


def _gpu_count() -> int:
    import torch

    return int(torch.cuda.device_count())


# -- runs everywhere -----------------------------------------------------------------------


def test_arena_reuses_freed_space_and_coalesces() -> None:
    arena = Arena(4 * ARENA_ALIGN)
    a = arena.allocate(ARENA_ALIGN, 1)
    b = arena.allocate(ARENA_ALIGN + 1, 1)  # rounds up to two pages
    assert (a, b) == (0, ARENA_ALIGN)
    arena.free(a, ARENA_ALIGN)
    arena.free(b, ARENA_ALIGN + 1)
    assert arena.allocate(4 * ARENA_ALIGN, 1) == 0  # the whole arena, coalesced again


def test_arena_refuses_oversize_and_times_out_when_full() -> None:
    arena = Arena(2 * ARENA_ALIGN)
    with pytest.raises(FrameRejected, match="exceeds the sink's arena"):
        arena.allocate(3 * ARENA_ALIGN, 1)
    held = arena.allocate(2 * ARENA_ALIGN, 1)
    with pytest.raises(ResourceExhausted, match="release"):
        arena.allocate(1, 0.05)
    threading.Timer(0.05, arena.free, (held, 2 * ARENA_ALIGN)).start()
    assert arena.allocate(1, 10) == 0  # woken by the free


@pytest.mark.parametrize(
    "address", ["tcp://127.0.0.1:5", "cuda://127.0.0.1", "cuda://127.0.0.1:port"]
)
def test_bad_arena_addresses_are_refused(address: str) -> None:
    with pytest.raises(TransportError, match="address"):
        parse_arena_address(address, "cuda")


def test_arena_addresses_parse() -> None:
    assert parse_arena_address("cuda://[::1]:4000", "cuda") == ("::1", 4000)


def test_ipc_handle_decoder_refuses_anything_but_a_cuda_tensor_rebuild() -> None:
    pytest.importorskip("torch")
    import os

    from topkv.transport.arena.cuda import decode_ipc_handle

    evil = pickle.dumps((os.system, ("echo pwned",)))
    with pytest.raises(FrameRejected, match="not allowed"):
        decode_ipc_handle(evil)
    with pytest.raises(FrameRejected, match="malformed"):
        decode_ipc_handle(b"not a pickle")


def test_ipc_handle_decoder_admits_what_reduce_tensor_pickles() -> None:
    torch = pytest.importorskip("torch")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from topkv.transport.arena.cuda import decode_ipc_handle

    # The argument shapes of reduce_tensor's CUDA branch (handles are opaque bytes).
    args = (torch.Tensor, torch.Size([8]), (1,), 0, torch.storage.TypedStorage, torch.uint8)
    args += (0, b"handle", 8, 0, False, b"refcount", 0, b"event", True)
    rebuild, decoded = decode_ipc_handle(pickle.dumps((rebuild_cuda_tensor, args)))
    assert rebuild is rebuild_cuda_tensor
    assert decoded == args


def test_flat_bytes_views_host_tensors_without_copying() -> None:
    torch = pytest.importorskip("torch")
    from topkv.transport.arena.cuda import flat_bytes

    tensor = torch.arange(6, dtype=torch.float16).reshape(2, 3)
    flat = flat_bytes(tensor)
    assert flat.dtype == torch.uint8 and flat.numel() == 12
    assert flat.data_ptr() == tensor.data_ptr()
    with pytest.raises(FrameRejected, match="contiguous"):
        flat_bytes(tensor.t())


def test_cuda_transport_is_unavailable_without_a_gpu() -> None:
    if _no_gpu is None:
        pytest.skip("a GPU is present")
    from topkv.transport.arena.factory import make_sink
    from topkv.transport.errors import TransportUnavailable

    with pytest.raises(TransportUnavailable, match="cuda"):
        make_sink("cuda", SECRET)


# -- GPU cases -----------------------------------------------------------------------------


@needs_gpu
@pytest.mark.timeout(180)
@pytest.mark.parametrize("from_device", [None, 0], ids=["host-to-gpu", "gpu-to-gpu"])
def test_moves_kv_bit_exactly_between_processes(from_device: int | None) -> None:
    sink_device = 1 if _gpu_count() > 1 else 0  # a peer copy across GPUs when there are two
    options = {"device": sink_device, "capacity_bytes": 64 << 20}
    sink, address = spawn_sink(None, "cuda", SECRET, first=20, count=len(LAYOUTS), options=options)
    try:
        for index, layout in enumerate(LAYOUTS):
            seed = 20 + index
            sender = spawn_sender(
                None, "cuda", address, SECRET, seed, layout, from_device=from_device
            )
            try:
                sent = sender.record(60)
                got = sink.record(60)
            finally:
                sender.stop()
            assert sent["ok"] is True, sent
            assert got["sha256"] == expected_digest(layout.total_bytes, seed), got
    finally:
        sink.stop()


@needs_gpu
@pytest.mark.timeout(120)
def test_corruption_on_the_gpu_path_is_caught() -> None:
    sink, address = spawn_sink(None, "cuda", SECRET, first=5, options={"capacity_bytes": 1 << 24})
    sender = spawn_sender(
        None, "cuda", address, SECRET, 5, LAYOUTS[0], mode="corrupt", from_device=0
    )
    try:
        got = sink.record(60)
        sent = sender.record(60)
    finally:
        sender.stop()
        sink.stop()
    assert (got["error"], sent["error"]) == ("ChecksumMismatch", "ChecksumMismatch")


@needs_gpu
@pytest.mark.timeout(120)
def test_sender_killed_mid_transfer_fails_the_receiver_fast() -> None:
    sink, address = spawn_sink(None, "cuda", SECRET, first=9, options={"capacity_bytes": 1 << 24})
    sender = spawn_sender(None, "cuda", address, SECRET, 9, LAYOUTS[0], mode="hang-after-2")
    try:
        sender.line("SENT2", 60)
        sink.line("LAYER 9 1", 60)
        sender.stop()
        got = sink.record(30)
    finally:
        sink.stop()
    assert (got["ok"], got["error"]) == (False, "PeerDied")


@needs_gpu
@pytest.mark.timeout(120)
def test_in_process_peer_copy_between_devices() -> None:
    import torch

    from topkv.transport.arena.cuda import CudaSink, CudaSource

    devices = (0, 1) if _gpu_count() > 1 else (0, 0)
    layout = LAYOUTS[0]
    sink = CudaSink(SECRET, device=devices[1], capacity_bytes=1 << 24)
    source = CudaSource(SECRET)
    try:
        generator = torch.Generator().manual_seed(3)
        data = torch.randint(0, 256, (layout.total_bytes,), dtype=torch.uint8, generator=generator)
        on_gpu = data.to(f"cuda:{devices[0]}")
        size = layout.tensor_bytes
        out = source.open(TransferDescriptor(1, "m", layout), sink.address)
        for layer in range(layout.num_layers):
            out.send_layer(
                layer,
                [on_gpu[(2 * layer + t) * size : (2 * layer + t + 1) * size] for t in range(2)],
            )
        assert out.finish().result(30).checksum_verified
        kv = sink.receive(1).result(30)
        assert torch.equal(torch.cat([t.cpu() for layer in kv.layers for t in layer]), data)
        assert kv_digest(kv.layers) == kv_digest([(data.numpy(),)])
        kv.release()
    finally:
        source.close()
        sink.close()
