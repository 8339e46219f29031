"""TopKVConnector end to end: real vLLM CPU instances, a real orchestrator, the front door.

One prefill and two decode instances of TopKV's tiny seeded Llama (float32, 4 layers)
register with a ``topkv orchestrator`` process; the front door (``topkv router``'s server,
in this process) reads them from it, and the official ``openai`` client talks to it.
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

from topkv.integrations.vllm.connector.params import shm_socket_path  # noqa: E402
from topkv.integrations.vllm.frontdoor.remote_registry import OrchestratorRegistry  # noqa: E402
from topkv.integrations.vllm.stack.instances import (  # noqa: E402
    StackFiles,
    start_orchestrator,
    start_pd_instances,
    wait_up,
)
from topkv.integrations.vllm.stack.launch import VllmInstance  # noqa: E402
from topkv.integrations.vllm.stack.model import VOCAB_SIZE, write_tiny_llama  # noqa: E402
from topkv.packaged import packaged_file  # noqa: E402
from topkv.service.cluster.local import Supervisor  # noqa: E402
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
    decodes: dict[str, VllmInstance]
    shm_dir: Path
    client: Any
    supervisor: Supervisor
    orchestrator_url: str
    admin_token: str
    client_token: str

    def reference(self, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        """The prefill instance computing the whole request alone (no transfer)."""
        answer = _post(
            self.prefill.url + "/v1/completions",
            {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens,
             "temperature": 0, "ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        return list(answer["choices"][0]["token_ids"])

    def stream(
        self, prompt: list[int], max_tokens: int, on_token: Any = None
    ) -> tuple[dict[str, str], list[int], list[dict[str, Any]], float]:
        """A raw streamed completion through the front door: (headers, token ids, chunks,
        the longest gap between two chunks in seconds); ``on_token(count, headers)`` after
        each chunk with tokens."""
        body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                "stream": True}  # fmt: skip
        request = urllib.request.Request(
            self.router.url + "/v1/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json", "Authorization": f"Bearer {self.client_token}"},
        )  # fmt: skip
        ids: list[int] = []
        chunks: list[dict[str, Any]] = []
        gap, last = 0.0, time.monotonic()
        with urllib.request.urlopen(request, timeout=120) as answer:
            headers = dict(answer.headers)
            for raw in answer:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                now = time.monotonic()
                gap, last = max(gap, now - last), now
                chunk = json.loads(line[len("data:") :])
                chunks.append(chunk)
                for choice in chunk.get("choices") or []:
                    ids += choice.get("token_ids") or []
                    if on_token is not None and choice.get("token_ids"):
                        on_token(len(ids), headers)
                        # the gap is what the client waits for the stream, not for its own
                        # callback (a kill waits until the kernel reaped the process)
                        last = time.monotonic()
        return headers, ids, chunks, gap

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
    supervisor = Supervisor(root / "logs", grace_s=20)
    router: RouterThread | None = None
    try:
        _, registry = start_orchestrator(supervisor, files)
        router = RouterThread(
            files.admin_token, files.worker_token, str(root), registry, client=files.client_token
        )
        instances = start_pd_instances(
            supervisor, model, files, registry, decode=2, max_model_len=MAX_MODEL_LEN,
            load_timeout_s=20,
        )  # fmt: skip
        wait_up(instances, router.server.registry, timeout_s=600)
        client = openai.OpenAI(
            base_url=router.url + "/v1", api_key=files.client_token, max_retries=0
        )
        decodes = {i.name: i for i in instances[1:]}
        yield Stack(
            router, instances[0], decodes["decode0"], decodes, root, client, supervisor,
            registry, files.admin_token, files.client_token,
        )  # fmt: skip
    finally:
        supervisor.stop_all()
        if router is not None:
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


def test_the_instances_are_the_orchestrators_workers(stack: Stack) -> None:
    """They registered with the orchestrator process; the front door reads them from it."""
    roles = _orchestrator_workers(stack)
    assert roles == {"prefill0": "prefill", "decode0": "decode", "decode1": "decode"}
    assert isinstance(stack.router.server.registry, OrchestratorRegistry)
    # registrations go to the orchestrator, not to the front door
    status = _status(stack.router.url + "/v1/workers", {"worker": {}}, stack.admin_token)
    assert status == 409


def _status(url: str, body: object, token: str) -> int:
    request = urllib.request.Request(
        url, json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_streamed_answer_reports_the_decodes_verification(stack: Stack) -> None:
    prompt = _prompt(333, seed=3000)
    pieces = stack.client.completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    chunks = list(pieces)
    ids = [i for c in chunks for ch in c.choices for i in (ch.model_extra or {})["token_ids"]]
    assert ids == stack.reference(prompt)
    last = chunks[-1].model_extra or {}
    topkv = last["kv_transfer_params"]["topkv"]
    assert topkv["verified"] is True and topkv["recomputed"] is False
    assert topkv["kv_bytes"] == 333 * BYTES_PER_TOKEN
    assert stack.metric("topkv_router_kv_bytes_total", '{kind="verified"}') > 0


def test_a_repeated_prefix_goes_where_it_is_held(stack: Stack) -> None:
    prefix = _prompt(320, seed=4000)
    first, _, _, _ = stack.stream(prefix + _prompt(40, 4001), 2)
    prompt = prefix + _prompt(40, 4002)
    second, ids, chunks, _ = stack.stream(prompt, MAX_TOKENS)
    assert first["X-TopKV-Prefix-Blocks"] == "0,0"
    assert first["X-TopKV-KV-Bytes-Sent"] == str(360 * BYTES_PER_TOKEN)
    # the 10 whole blocks of the shared prefix: both instances served them a moment ago
    assert second["X-TopKV-Prefix-Blocks"] == "10,10"
    assert second["X-TopKV-Decode"] == first["X-TopKV-Decode"]
    # the decode holds the prefix: only the 40 other tokens' KV travels, and it is exact
    assert second["X-TopKV-KV-Bytes-Sent"] == str(40 * BYTES_PER_TOKEN)
    topkv = chunks[-1]["kv_transfer_params"]["topkv"]
    assert topkv["verified"] and topkv["kv_bytes"] == 40 * BYTES_PER_TOKEN
    assert ids == stack.reference(prompt)


def _direct(stack: Stack, prompt: list[int], transfer: int, medium: str, **topkv: str) -> Any:
    """Prefill then decode, called directly with the connector's kv_transfer_params."""
    decode = stack.router.server.registry.get("decode0")
    assert decode is not None, "decode0 is not registered"
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


@pytest.mark.parametrize("medium", ["nixl", "mooncake"])
def test_an_engine_medium_forced_per_request_is_token_identical_and_verified(
    stack: Stack, medium: str
) -> None:
    """``X-TopKV-Medium: nixl`` (or mooncake): the KV moves by that engine (NIXL: UCX
    writes into the decode's registered arena; Mooncake: its Transfer Engine's), and the
    decode loads it from its sink of that medium, verified."""
    from topkv.service.worker.media import why_unavailable

    reason = why_unavailable(medium)
    if reason is not None:
        pytest.skip(f"{medium} is not importable here: {reason}")
    decode = stack.router.server.registry.get("decode0")
    assert decode is not None and medium in decode.capabilities.media
    assert any(a.startswith(f"{medium}://") for a in decode.sink_addresses)
    before = stack.metric("topkv_router_transfers_total", f'{{medium="{medium}"}}')
    lengths = (97, 410, 800)
    base = 6000 if medium == "nixl" else 7000  # fresh prompts: nothing cached anywhere
    for seed, length in enumerate(lengths):
        prompt = _prompt(length, seed=base + seed)
        answer = stack.client.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
            extra_headers={"X-TopKV-Medium": medium},
        )  # fmt: skip
        assert _token_ids(answer.choices[0]) == stack.reference(prompt)
        topkv = (answer.model_extra or {})["kv_transfer_params"]["topkv"]
        assert topkv["medium"] == medium
        assert topkv["verified"] is True and topkv["recomputed"] is False
        assert topkv["kv_bytes"] == length * BYTES_PER_TOKEN
    after = stack.metric("topkv_router_transfers_total", f'{{medium="{medium}"}}')
    assert after - before == 3
    # without the header the policy's same-host choice stands: shm
    prompt = _prompt(200, seed=base + 100)
    plain = stack.client.completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert (plain.model_extra or {})["kv_transfer_params"]["topkv"]["medium"] == "shm"


def test_an_unknown_forced_medium_is_refused(stack: Stack) -> None:
    request = urllib.request.Request(
        stack.router.url + "/v1/completions",
        json.dumps({"model": "tiny-llama", "prompt": [1, 2, 3], "max_tokens": 1}).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {stack.client_token}",
         "X-TopKV-Medium": "carrier-pigeon"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 400
    assert b"carrier-pigeon" in refused.value.read()


def test_a_decode_killed_mid_stream_fails_over_token_identical(stack: Stack) -> None:
    prompt, new_tokens = _prompt(300, seed=5000), 120
    want = stack.reference(prompt, new_tokens)
    killed: list[tuple[str, float]] = []

    def kill_at_ten(count: int, headers: dict[str, str]) -> None:
        if count >= 10 and not killed:
            name = headers["X-TopKV-Decode"]
            stack.supervisor.kill(stack.decodes[name].managed)
            killed.append((name, time.monotonic()))

    _headers, ids, chunks, gap = stack.stream(prompt, new_tokens, kill_at_ten)
    assert killed, "the stream ended before 10 tokens"
    assert ids == want  # one uninterrupted stream, greedy: token-identical
    assert len({c["id"] for c in chunks}) == 1
    topkv = chunks[-1]["kv_transfer_params"]["topkv"]
    (failover,) = topkv["failovers"]
    assert failover["failed"] == killed[0][0] and failover["to"] != killed[0][0]
    assert failover["after_tokens"] >= 10
    assert topkv["verified"] is True  # the first instance's load, reported before it died
    assert gap < 30, f"the stream stalled {gap:.1f} s"
    print(f"failover: {failover}, longest gap at the client {gap * 1000:.0f} ms")
    assert stack.metric("topkv_router_stream_failovers_total") >= 1
    # the killed API server's engine process noticed, deregistered and ended: no stale
    # registration comes back to the orchestrator
    time.sleep(5)
    assert killed[0][0] not in _orchestrator_workers(stack)


def _orchestrator_workers(stack: Stack) -> dict[str, str]:
    request = urllib.request.Request(
        stack.orchestrator_url + "/v1/workers",
        headers={"Authorization": f"Bearer {stack.admin_token}"},
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        listed = json.loads(answer.read())["workers"]
    return {w["worker"]["worker_id"]: w["worker"]["role"] for w in listed}


def test_killing_the_last_decode_mid_stream_fails_cleanly_then_503(stack: Stack) -> None:
    """Runs last in this module: it takes the remaining decode instance down."""
    killed: list[float] = []
    pieces = stack.client.completions.create(
        model="tiny-llama", prompt=_prompt(200, 6000), max_tokens=200, temperature=0,
        stream=True, extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    count = 0
    with pytest.raises(openai.APIError, match="no other decode instance"):
        for chunk in pieces:
            count += len((chunk.choices[0].model_extra or {}).get("token_ids") or [])
            if count >= 3 and not killed:
                name = next(n for n, i in stack.decodes.items() if i.managed.alive())
                stack.supervisor.kill(stack.decodes[name].managed)
                killed.append(time.monotonic())
    assert killed and time.monotonic() - killed[0] < 30
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as refused:
        stack.client.completions.create(model="tiny-llama", prompt=_prompt(64, 8), max_tokens=4)
    assert refused.value.status_code == 503
    assert "no decode instance is registered" in str(refused.value)
    assert time.monotonic() - started < 30
