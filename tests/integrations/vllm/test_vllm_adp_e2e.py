"""The front door's ADP end to end: real vLLM CPU instances move between the pools.

One prefill instance (``kv_producer``) and two ``kv_both`` instances (registered as decode)
of TopKV's tiny seeded Llama register with a ``topkv orchestrator`` process; the front door
(in this process, ``--adp on`` with short windows) reads them from it. A burst of requests
makes a rush: one ``kv_both`` instance moves to prefill (the orchestrator's ``GET
/v1/workers`` shows it), serves prefills, and moves back once the burst is over. Every answer
is token-identical to the prefill instance computing the request alone, and the moves show in
the front door's ``/metrics``. Skips when vLLM is not installed.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

pytest.importorskip("vllm")

from topkv.integrations.vllm.frontdoor.adp import AdpOptions
from topkv.integrations.vllm.frontdoor.router import RouterServer
from topkv.integrations.vllm.stack.instances import (
    StackFiles,
    start_orchestrator,
    start_pd_instances,
    wait_up,
)
from topkv.integrations.vllm.stack.model import VOCAB_SIZE, write_tiny_llama
from topkv.policy.adp.pool import ADPConfig
from topkv.service.cluster.local import Supervisor

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 6
BOTH = ("both0", "both1")
#: Short windows so a burst of seconds is a rush and its end shows within seconds.
CONFIG = ADPConfig(
    velocity_window_s=1.0, baseline_window_s=30.0, queue_window_s=2.0, queue_growth_per_s=1.0,
    ttft_target_s=1.0, ttft_window_s=3.0, hold_s=2.0, convert_interval_s=0.5,
)  # fmt: skip


class AdpRouterThread:
    """The front door with the ADP on, in a thread of the test process."""

    def __init__(self, files: StackFiles, registry_url: str) -> None:
        auth = files.front_door_auth()
        options = AdpOptions(frozenset(BOTH), CONFIG, files.worker_token, tick_s=0.1)
        self.loop = asyncio.new_event_loop()
        self.server = RouterServer(
            auth, str(files.run_dir), registry_url=registry_url,
            registry_token=files.admin_token, adp=options,
        )  # fmt: skip
        started: Future[str] = Future()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        self.url = started.result(30)

    def _run(self, started: Future[str]) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            started.set_result(self.loop.run_until_complete(self.server.serve()))
        except BaseException as exc:
            started.set_exception(exc)
            return
        self.loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)


def _call(
    url: str, body: dict[str, Any] | None = None, token: str = "", timeout: float = 120
) -> tuple[dict[str, str], Any]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, headers)
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return dict(answer.headers), json.loads(answer.read())


def _metric(url: str, line: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
        for text in answer.read().decode().splitlines():
            if text.startswith(line + " "):
                return float(text.split()[-1])
    return 0.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, ...]]:
    root = tmp_path_factory.mktemp("vllm-adp")
    model = write_tiny_llama(root / "model")
    files = StackFiles.create(root)
    supervisor = Supervisor(root / "logs", grace_s=20)
    router: AdpRouterThread | None = None
    try:
        _, registry = start_orchestrator(supervisor, files)
        router = AdpRouterThread(files, registry)
        instances = start_pd_instances(
            supervisor, model, files, registry, prefill=1, decode=0, both=2,
            max_model_len=1024, load_timeout_s=20,
        )  # fmt: skip
        wait_up(instances, router.server.registry, timeout_s=600)
        yield router, instances[0], registry, files
    finally:
        supervisor.stop_all()
        if router is not None:
            router.close()


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE - 2) for _ in range(rng.randrange(64, 256))]


def test_a_burst_moves_a_kv_both_instance_to_prefill_and_back(stack: tuple[Any, ...]) -> None:
    router, prefill, registry, files = stack
    token = files.admin_token
    prompts = [_prompt(seed) for seed in range(12)]
    body = {"model": "tiny-llama", "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip

    def reference(prompt: list[int]) -> list[int]:
        _, answer = _call(prefill.url + "/v1/completions", {**body, "prompt": prompt})
        return list(answer["choices"][0]["token_ids"])

    expected = [reference(p) for p in prompts]

    def through(index: int) -> tuple[str, bool]:
        prompt = prompts[index % len(prompts)]
        headers, answer = _call(router.url + "/v1/completions", {**body, "prompt": prompt}, token)
        same = list(answer["choices"][0]["token_ids"]) == expected[index % len(prompts)]
        return headers["X-TopKV-Prefill"], same

    for i in range(3):  # warm the path; then let any warm-up rush end
        assert through(i)[1]
        time.sleep(0.3)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        _, state = _call(router.url + "/v1/adp", token=token)
        if not state["in_rush"] and not state["stages"]:
            break
        time.sleep(0.2)
    moved_before = len(state["conversions"])

    roles_seen: dict[str, set[str]] = {wid: set() for wid in BOTH}
    watching = threading.Event()

    def watch() -> None:  # what the orchestrator's registry says, every 50 ms
        while not watching.is_set():
            _, listed = _call(registry + "/v1/workers", token=token, timeout=5)
            for view in listed["workers"]:
                worker = view["worker"]
                if worker["worker_id"] in roles_seen:
                    roles_seen[worker["worker_id"]].add(worker["role"])
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    results: list[tuple[str, bool]] = []
    started = time.monotonic()
    with ThreadPoolExecutor(6) as pool:
        index = 0
        pending = {pool.submit(through, i) for i in range(index, index + 6)}
        index += 6
        while pending:
            done = {f for f in pending if f.done()}
            if not done:
                time.sleep(0.01)
                continue
            pending -= done
            results += [f.result() for f in done]
            served_by_both = any(p in BOTH for p, _ in results)
            if time.monotonic() - started < 40 and not (served_by_both and len(results) >= 24):
                pending |= {pool.submit(through, i) for i in range(index, index + len(done))}
                index += len(done)
    burst_s = time.monotonic() - started
    # the burst is over: the rush ends and the moved instance returns to decode
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        _, state = _call(router.url + "/v1/adp", token=token)
        if not state["in_rush"] and not state["stages"]:
            break
        time.sleep(0.2)
    time.sleep(0.3)
    watching.set()
    watcher.join(10)

    assert all(same for _, same in results), "an answer differs from the plain instance's"
    moves = state["conversions"][moved_before:]
    print(f"\nburst: {len(results)} requests in {burst_s:.1f} s; moves: {moves}")
    assert not state["in_rush"] and not state["stages"], state
    to_prefill = [m for m in moves if m["to"] == "prefill" and m["duration_ms"] is not None]
    back = [m for m in moves if m["to"] == "decode" and m["duration_ms"] is not None]
    assert to_prefill and back, moves
    moved = to_prefill[0]["worker"]
    assert moved in BOTH and back[-1]["worker"] == moved
    assert any(p == moved for p, _ in results), "the moved instance never prefilled"
    assert roles_seen[moved] == {"decode", "prefill"}, roles_seen  # the registry showed it
    assert all(m["duration_ms"] < 5000 for m in to_prefill + back)
    # the front door's /metrics: the moves and their times, the pools back as they were
    url = router.url
    assert _metric(url, 'topkv_conversions_total{from="decode",to="prefill"}') >= 1
    assert _metric(url, 'topkv_conversions_total{from="prefill",to="decode"}') >= 1
    assert _metric(url, 'topkv_conversion_seconds_count{to="prefill"}') >= 1
    assert _metric(url, 'topkv_conversion_seconds_count{to="decode"}') >= 1
    assert _metric(url, "topkv_adp_rush") == 0
    assert _metric(url, 'topkv_adp_pool_workers{pool="prefill"}') == 1
    assert _metric(url, 'topkv_adp_pool_workers{pool="decode"}') == 2
    _, listed = _call(registry + "/v1/workers", token=token)
    roles = {v["worker"]["worker_id"]: v["worker"]["role"] for v in listed["workers"]}
    assert roles == {"prefill0": "prefill", "both0": "decode", "both1": "decode"}
