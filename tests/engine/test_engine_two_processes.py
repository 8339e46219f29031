"""Prefill in one spawned process, decode in another, K/V streamed layer by layer over a pipe."""

from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch

from topkv.engine import (
    DecodeRunner,
    DemoModelConfig,
    PrefillRunner,
    arrays_from_bytes,
    build_demo_model,
    kv_model_spec,
    layer_to_numpy,
    prompt_token_ids,
    reference_generate,
    state_dict_digest,
)

pytestmark = pytest.mark.model

SEED = 23
NEW_TOKENS = 8
PROMPTS = [(5, 1), (120, 2)]  # (length, prompt seed)
RECV_TIMEOUT_S = 120


def _recv(conn: Connection) -> object:
    if not conn.poll(RECV_TIMEOUT_S):
        raise TimeoutError("peer process sent nothing")
    return conn.recv()


def _recv_bytes(conn: Connection) -> bytes:
    if not conn.poll(RECV_TIMEOUT_S):
        raise TimeoutError("peer process sent nothing")
    return conn.recv_bytes()


def prefill_worker(seed: int, layer_out: Connection, report: Connection) -> None:
    """Worker A: for each prompt, prefill and send every layer's K, V bytes as it completes."""
    torch.set_num_threads(1)  # two workers and the test share the CPU cores
    loaded = build_demo_model(DemoModelConfig(), seed)
    report.send(state_dict_digest(loaded))
    for length, prompt_seed in PROMPTS:
        ids = prompt_token_ids(length, prompt_seed, loaded.config.vocab_size)

        def on_layer(index: int, k: torch.Tensor, v: torch.Tensor) -> None:
            k_np, v_np = layer_to_numpy(k, v)
            layer_out.send(index)
            layer_out.send_bytes(k_np.data.cast("B"))  # zero-copy send of the array's buffer
            layer_out.send_bytes(v_np.data.cast("B"))

        result = PrefillRunner(loaded).run(ids, on_layer)
        layer_out.send(("first_token", result.first_token))
    layer_out.close()


def decode_worker(seed: int, layer_in: Connection, report: Connection) -> None:
    """Worker B: rebuild each request's cache from the received layers and decode."""
    torch.set_num_threads(1)
    loaded = build_demo_model(DemoModelConfig(), seed)
    report.send(state_dict_digest(loaded))
    spec = kv_model_spec(loaded)
    for length, _ in PROMPTS:
        layers = []
        for expected_index in range(spec["layers"]):
            index = _recv(layer_in)
            if index != expected_index:
                raise AssertionError(f"layer {index} arrived, expected {expected_index}")
            k, v = _recv_bytes(layer_in), _recv_bytes(layer_in)
            layers.append(arrays_from_bytes(spec, length, k, v))
        message = _recv(layer_in)
        assert isinstance(message, tuple) and message[0] == "first_token"
        first_token = int(message[1])
        report.send(DecodeRunner(loaded).generate(layers, first_token, length, NEW_TOKENS))


def test_prefill_and_decode_in_separate_processes_match_reference() -> None:
    ctx = multiprocessing.get_context("spawn")
    layer_in, layer_out = ctx.Pipe(duplex=False)
    prefill_report_in, prefill_report_out = ctx.Pipe(duplex=False)
    decode_report_in, decode_report_out = ctx.Pipe(duplex=False)
    prefill = ctx.Process(target=prefill_worker, args=(SEED, layer_out, prefill_report_out))
    decode = ctx.Process(target=decode_worker, args=(SEED, layer_in, decode_report_out))
    prefill.start()
    decode.start()
    try:
        loaded = build_demo_model(DemoModelConfig(), SEED)
        digest = state_dict_digest(loaded)
        assert _recv(prefill_report_in) == digest  # same seed -> same weights in another process
        assert _recv(decode_report_in) == digest
        for length, prompt_seed in PROMPTS:
            ids = prompt_token_ids(length, prompt_seed, loaded.config.vocab_size)
            assert _recv(decode_report_in) == reference_generate(loaded, ids, NEW_TOKENS)
        prefill.join(RECV_TIMEOUT_S)
        decode.join(RECV_TIMEOUT_S)
        assert prefill.exitcode == 0 and decode.exitcode == 0
    finally:
        for process in (prefill, decode):
            if process.is_alive():
                process.terminate()
                process.join(10)
