"""TopKVConnector end to end: two real vLLM CPU instances behind the front door.

One prefill and one decode instance of TopKV's tiny seeded Llama (float32, 4 layers) register
with ``topkv router`` (in this process), and the official ``openai`` client talks to it.
The reference for every request is the prefill instance itself computing the whole request
without any transfer. Skips when vLLM is not installed (``make test`` installs it into
``.venv-vllm`` and runs this file there).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from router_thread import RouterThread  # noqa: E402

from topkv.integrations.vllm.launch import VllmInstance  # noqa: E402
from topkv.integrations.vllm.model import VOCAB_SIZE, write_tiny_llama  # noqa: E402
from topkv.integrations.vllm.params import shm_socket_path  # noqa: E402
from topkv.integrations.vllm.stack import StackFiles, start_pd_instances, wait_up  # noqa: E402
from topkv.packaged import packaged_file  # noqa: E402
from topkv.service.cluster import Supervisor  # noqa: E402
from topkv.traces import read_azure_csv  # noqa: E402

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 8
MAX_MODEL_LEN = 1024
#: float32 KV of the tiny Llama: 4 layers x (K + V) x 2 kv heads x 64 dims x 4 bytes
BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 4


def _prompt(length: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE - 2) for _ in range(length)]


def _post(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read())  # type: ignore[no-any-return]


@dataclass
class Stack:
    router: RouterThread
    prefill: VllmInstance
    decode: VllmInstance
    shm_dir: Path
    client: Any
    supervisor: Supervisor

    def reference(self, prompt: list[int]) -> list[int]:
        """The prefill instance computing the whole request alone (no transfer)."""
        answer = _post(
            self.prefill.url + "/v1/completions",
            {"model": "tiny-llama", "prompt": prompt, "max_tokens": MAX_TOKENS,
             "temperature": 0, "ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        return list(answer["choices"][0]["token_ids"])

    def metric(self, name: str, labels: str = "") -> float:
        with urllib.request.urlopen(self.router.url + "/metrics", timeout=10) as answer:
            for line in answer.read().decode().splitlines():
                if line.startswith(name + labels + " ") or line.startswith(name + " "):
                    return float(line.split()[-1])
        return 0.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("vllm")
    model = write_tiny_llama(root / "model")
    files = StackFiles.create(root)
    router = RouterThread(files.admin_token, files.worker_token, str(root))
    supervisor = Supervisor(root / "logs", grace_s=20)
    try:
        instances = start_pd_instances(
            supervisor, model, files, router.url, max_model_len=MAX_MODEL_LEN, load_timeout_s=20
        )
        wait_up(instances, router.server.registry, timeout_s=420)
        client = openai.OpenAI(
            base_url=router.url + "/v1", api_key=files.admin_token, max_retries=0
        )
        yield Stack(router, instances[0], instances[1], root, client, supervisor)
    finally:
        supervisor.stop_all()
        router.close()


def _token_ids(choice: Any) -> list[int]:
    return list((choice.model_extra or {})["token_ids"])


def test_twenty_trace_requests_are_token_identical_and_every_byte_verified(stack: Stack) -> None:
    trace = read_azure_csv(packaged_file("azure_2023_conv_first4000.csv"))  # type: ignore[arg-type]
    lengths = [min(r.input_tokens, MAX_MODEL_LEN - MAX_TOKENS - 16) for r in trace.requests[:20]]
    prompts = [_prompt(n, seed) for seed, n in enumerate(lengths)]
    expected = [stack.reference(p) for p in prompts]
    verified_before = stack.metric("topkv_router_kv_bytes_total", '{kind="verified"}')
    for prompt, want in zip(prompts, expected, strict=True):
        answer = stack.client.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        assert _token_ids(answer.choices[0]) == want
        topkv = (answer.model_extra or {})["kv_transfer_params"]["topkv"]
        assert topkv["verified"] and not topkv["recomputed"]
        assert topkv["kv_bytes"] == len(prompt) * BYTES_PER_TOKEN
        assert topkv["medium"] == "shm"  # one host: the policy's pcie path, over shm
    verified = stack.metric("topkv_router_kv_bytes_total", '{kind="verified"}') - verified_before
    assert verified == sum(lengths) * BYTES_PER_TOKEN
    assert stack.metric("topkv_router_kv_recomputed_total") == 0


def test_chat_streamed_and_not_and_models(stack: Stack) -> None:
    models = stack.client.models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]
    messages = [{"role": "user", "content": "Move the KV cache, layer by layer. " * 6}]
    whole = stack.client.chat.completions.create(
        model="tiny-llama", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    text = whole.choices[0].message.content
    assert text
    pieces = stack.client.chat.completions.create(
        model="tiny-llama", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert streamed == text


def _direct(stack: Stack, prompt: list[int], transfer: int, medium: str, **topkv: str) -> Any:
    """Prefill then decode, called directly with the connector's kv_transfer_params."""
    decode = stack.router.server.registry.get("decode0")
    assert decode is not None
    destination = (
        "shm://" + shm_socket_path(str(stack.shm_dir), "decode0")
        if medium == "shm"
        else decode.address
    )
    _post(
        stack.prefill.url + "/v1/completions",
        {"model": "tiny-llama", "prompt": prompt, "max_tokens": 1, "temperature": 0,
         "kv_transfer_params": {"do_remote_decode": True, "topkv": {
             "transfer_id": transfer, "destination": destination, **topkv}}},
    )  # fmt: skip
    return _post(
        stack.decode.url + "/v1/completions",
        {"model": "tiny-llama", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
         "ignore_eos": True, "return_token_ids": True,
         "kv_transfer_params": {"do_remote_prefill": True,
                                "topkv": {"transfer_id": transfer, "medium": medium}}},
    )  # fmt: skip


def test_tcp_the_medium_across_hosts_is_token_identical_too(stack: Stack) -> None:
    prompt = _prompt(450, seed=2000)
    answer = _direct(stack, prompt, 990002, "tcp")
    assert answer["choices"][0]["token_ids"] == stack.reference(prompt)
    topkv = answer["kv_transfer_params"]["topkv"]
    assert topkv["verified"] and topkv["medium"] == "tcp"
    assert topkv["kv_bytes"] == 450 * BYTES_PER_TOKEN


def test_a_corrupted_layer_frame_is_caught_and_the_request_still_completes(stack: Stack) -> None:
    prompt = _prompt(300, seed=1000)
    want = stack.reference(prompt)
    answer = _direct(stack, prompt, 990001, "shm", fault="corrupt")
    assert answer["choices"][0]["token_ids"] == want  # vLLM recomputed the rejected blocks
    topkv = answer["kv_transfer_params"]["topkv"]
    assert topkv == {
        "transfer_id": 990001, "medium": "shm", "kv_bytes": 0,
        "verified": False, "recomputed": True,
    }  # fmt: skip
    log = stack.decode.log_tail(5000)
    assert "load of" in log and ("ChecksumMismatch" in log or "CRC" in log)


def test_killing_the_decode_instance_fails_cleanly_then_503(stack: Stack) -> None:
    """Runs last in this module: it takes the decode instance down."""
    stack.supervisor.kill(stack.decode.managed)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as failed:
        stack.client.completions.create(model="tiny-llama", prompt=_prompt(64, 7), max_tokens=4)
    assert failed.value.status_code in (502, 503)
    assert time.monotonic() - started < 30
    with pytest.raises(openai.APIStatusError) as refused:
        stack.client.completions.create(model="tiny-llama", prompt=_prompt(64, 8), max_tokens=4)
    assert refused.value.status_code == 503
    assert "no decode instance is registered" in str(refused.value)
