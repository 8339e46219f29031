"""Greedy tokens after a real per-layer KV stream equal the single-process run, per transport.

Prefill publishes each layer from inside its one forward pass and the layer goes straight
into the transport (shm, tcp, the transport package's emulated link, and the demo's paced
link over shm and over tcp); decode continues from the verified bytes that landed.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from topkv.engine import (
    DecodeRunner,
    DemoModelConfig,
    LoadedModel,
    PrefillRunner,
    arrays_from_bytes,
    build_demo_model,
    kv_model_spec,
    layer_to_numpy,
    prompt_token_ids,
    reference_generate,
)
from topkv.transport.base import (
    KVLayout,
    OutgoingTransfer,
    TransferDescriptor,
    TransferSink,
    TransferSource,
    TransportMode,
)
from topkv.transport.emulated import EmulatedSource, LinkModel
from topkv.transport.shm import ShmSink, ShmSource
from topkv.transport.tcp import TcpSink, TcpSource

CONFIG = DemoModelConfig(
    layers=4, hidden_size=128, heads=4, kv_heads=2, head_dim=32, intermediate_size=256
)
PROMPTS = ((23, 11), (64, 12), (131, 13))  # (length, seed)
NEW_TOKENS = 6

Pair = tuple[TransferSource, TransferSink]


def _shm(secret: bytes) -> Pair:
    return ShmSource(secret), ShmSink(secret)


def _tcp(secret: bytes) -> Pair:
    return TcpSource(secret), TcpSink(secret)


def _emulated_rdma(secret: bytes) -> Pair:
    return EmulatedSource(TcpSource(secret), LinkModel.default("rdma"), dilation=10.0), TcpSink(
        secret
    )


def _paced_nvlink_shm(secret: bytes) -> Pair:
    link = LinkModel(TransportMode.NVLINK, 450.0, 1e-6)
    return EmulatedSource(ShmSource(secret), link, dilation=2000.0), ShmSink(secret)


def _paced_rdma_tcp(secret: bytes) -> Pair:
    link = LinkModel(TransportMode.RDMA, 25.0, 5e-6)
    return EmulatedSource(TcpSource(secret), link, dilation=200.0), TcpSink(secret)


TRANSPORTS: dict[str, Callable[[bytes], Pair]] = {
    "shm": _shm,
    "tcp": _tcp,
    "emulated-rdma": _emulated_rdma,
    "paced-nvlink-over-shm": _paced_nvlink_shm,
    "paced-rdma-over-tcp": _paced_rdma_tcp,
}


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return build_demo_model(CONFIG, seed=5)


@pytest.fixture(scope="module")
def references(model: LoadedModel) -> dict[tuple[int, int], list[int]]:
    vocab = CONFIG.vocab_size
    return {
        (n, seed): reference_generate(model, prompt_token_ids(n, seed, vocab), NEW_TOKENS)
        for n, seed in PROMPTS
    }


@pytest.fixture(params=sorted(TRANSPORTS))
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[str, Pair]]:
    name = request.param
    source, sink = TRANSPORTS[name](secrets.token_bytes(16))
    try:
        yield name, (source, sink)
    finally:
        source.close()
        sink.close()


def test_streamed_kv_decodes_to_the_reference_tokens(
    model: LoadedModel,
    references: dict[tuple[int, int], list[int]],
    pair: tuple[str, Pair],
) -> None:
    name, (source, sink) = pair
    spec = kv_model_spec(model)
    prefill, decode = PrefillRunner(model), DecodeRunner(model)
    for rid, (length, seed) in enumerate(PROMPTS):
        layout = KVLayout(spec["layers"], length, spec["kv_heads"], spec["head_dim"], "fp32")
        out = source.open(TransferDescriptor(rid, spec["model_id"], layout), sink.address)
        received = sink.receive(rid)
        offered: list[float] = []
        held: list[Any] = []  # the source keeps its buffers until the transfer completes

        def on_layer(
            index: int,
            k: Any,
            v: Any,
            out: OutgoingTransfer = out,
            held: list[Any] = held,
            offered: list[float] = offered,
        ) -> None:
            arrays = layer_to_numpy(k, v)
            held.append(arrays)
            offered.append(time.perf_counter())
            out.send_layer(index, (arrays[0].data, arrays[1].data))

        result = prefill.run(prompt_token_ids(length, seed, CONFIG.vocab_size), on_layer)
        assert len(offered) == spec["layers"]  # every layer left during the forward pass
        assert all(t <= result.forward_end_s for t in offered)
        sent = out.finish().result(30)
        assert sent.checksum_verified and sent.size_bytes == layout.total_bytes
        kv = received.result(30)
        try:
            layers = [arrays_from_bytes(spec, length, k, v) for k, v in kv.layers]
            tokens = decode.generate(layers, result.first_token, length, NEW_TOKENS)
        finally:
            kv.release()
        assert tokens == references[(length, seed)], f"{name}: prompt {length} differs"
        assert len(set(tokens)) > 1  # a varied output, so identity is a real check
