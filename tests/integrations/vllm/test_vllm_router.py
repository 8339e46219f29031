"""The front door without vLLM: authentication, the 503 with no instance registered, and
the picker's choices (TopKV's routing policy over registered instances)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from router_thread import RouterThread

from topkv.integrations.vllm.frontdoor.picker import NoInstance, Picker, held_tokens, prompt_hashes
from topkv.integrations.vllm.frontdoor.remote_registry import OrchestratorRegistry
from topkv.integrations.vllm.stack.instances import StackFiles, start_orchestrator
from topkv.relay.registry.memory import MemoryRegistry
from topkv.relay.workers import WorkerCapabilities, WorkerInfo
from topkv.service.cluster.local import Supervisor

ADMIN, WORKER = "tkv_admin_for_router_tests", "tkv_worker_for_router_tests"


def _call(url: str, token: str | None, body: object = None) -> tuple[int, dict[str, object]]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> RouterThread:
    thread = RouterThread(ADMIN, WORKER, str(tmp_path_factory.mktemp("shm")))
    yield thread  # type: ignore[misc]
    thread.close()


def test_every_openai_endpoint_needs_the_admin_token(router: RouterThread) -> None:
    body = {"model": "m", "prompt": "hi"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert _call(router.url + path, None, body)[0] == 401
        assert _call(router.url + path, "tkv_wrong", body)[0] == 401
        assert _call(router.url + path, WORKER, body)[0] == 403
    assert _call(router.url + "/v1/models", None)[0] == 401


def test_no_instance_registered_is_a_clear_503(router: RouterThread) -> None:
    status, answer = _call(router.url + "/v1/completions", ADMIN, {"model": "m", "prompt": "x"})
    assert status == 503
    assert "no prefill instance is registered" in json.dumps(answer)
    status, _ = _call(router.url + "/v1/models", ADMIN)
    assert status == 503


def test_bad_body_is_400(router: RouterThread) -> None:
    assert _call(router.url + "/v1/completions", ADMIN, [1, 2])[0] == 400


def _worker(worker_id: str, role: str, host: str, address: str = "") -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        role=role,  # type: ignore[arg-type]
        node=host,
        host_id=host,
        capabilities=WorkerCapabilities(media=("shm", "tcp")),
        address=address,
        control_url=f"http://{worker_id}",
        capacity=2,
    )


def test_picker_prefers_shm_on_one_host_and_tcp_across() -> None:
    registry = MemoryRegistry()
    picker = Picker(registry, "/run/x")
    with pytest.raises(NoInstance, match="prefill"):
        picker.pick(1 << 20)
    registry.register(_worker("p0", "prefill", "hostA"))
    with pytest.raises(NoInstance, match="decode"):
        picker.pick(1 << 20)
    registry.register(_worker("far", "decode", "hostB", "tcp://10.0.0.2:7000"))
    registry.register(_worker("near", "decode", "hostA", "tcp://127.0.0.1:7001"))

    route = picker.pick(1 << 20)
    assert (route.decode.worker_id, route.medium) == ("near", "shm")
    assert route.destination == "shm:///run/x/topkv-vllm-near.sock"

    route = picker.pick(1 << 20, exclude={"near"})
    assert (route.decode.worker_id, route.medium, route.destination) == (
        "far",
        "tcp",
        "tcp://10.0.0.2:7000",
    )

    picker.in_flight.update(["near", "near"])  # its capacity (2) is taken
    assert picker.pick(1 << 20).decode.worker_id == "far"
    picker.in_flight.update(["far", "far"])
    with pytest.raises(NoInstance, match="full"):
        picker.pick(1 << 20)


def test_topkv_router_command_serves_until_interrupted(tmp_path: Path) -> None:
    topkv = str(Path(sys.executable).with_name("topkv"))
    refused = subprocess.run([topkv, "router", "--port", "0"], capture_output=True, text=True)
    assert refused.returncode == 2 and "admin token" in refused.stderr
    (tmp_path / "admin").write_text(ADMIN)
    (tmp_path / "admin").chmod(0o600)
    process = subprocess.Popen(
        [topkv, "router", "--port", "0", "--token-file", str(tmp_path / "admin")],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        line = process.stderr.readline()
        url = re.search(r"on (http://\S+)", line)
        assert url, line
        assert _call(url.group(1) + "/v1/completions", None, {"prompt": "x"})[0] == 401
        assert _call(url.group(1) + "/v1/completions", ADMIN, {"prompt": "x"})[0] == 503
        process.send_signal(signal.SIGINT)
        assert process.wait(20) == 0
    finally:
        process.kill()


def test_topkv_vllm_model_writes_a_loadable_model_and_up_refuses_a_bad_dir(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers")
    topkv = str(Path(sys.executable).with_name("topkv"))
    refused = subprocess.run(
        [topkv, "vllm", "up", "--model", str(tmp_path / "none"), "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and "no config.json" in refused.stderr
    written = subprocess.run(
        [topkv, "vllm", "model", str(tmp_path / "m"), "--layers", "2"],
        capture_output=True,
        text=True,
    )
    assert written.returncode == 0, written.stderr
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(tmp_path / "m")
    assert (config.num_hidden_layers, config.head_dim, config.vocab_size) == (2, 64, 258)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "m")
    ids = tokenizer("KV, layer by layer")["input_ids"]
    assert tokenizer.decode(ids) == "KV, layer by layer" and max(ids) < 258
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<s>user: hi\n<s>assistant: "


def test_picker_prefers_the_instances_that_hold_the_prefix() -> None:
    registry = MemoryRegistry()
    picker = Picker(registry, "/run/x")
    for name, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")):
        registry.register(_worker(name, role, "hostA", "tcp://127.0.0.1:7000"))
    prompt = prompt_hashes({"prompt": list(range(100))})
    assert len(prompt) == 3  # whole 32-token blocks
    cold = picker.pick(1 << 20, hashes=prompt)
    assert (cold.prefill.worker_id, cold.decode.worker_id, cold.affinity) == ("p0", "d0", (0, 0))
    picker.served("p1", prompt)
    picker.served("d1", prompt[:2])
    warm = picker.pick(1 << 20, hashes=prompt)
    assert (warm.prefill.worker_id, warm.decode.worker_id, warm.affinity) == ("p1", "d1", (3, 2))
    assert warm.medium == "shm"
    picker.in_flight.update(["p1"] * 3)  # 3 above the idle p0: past the load gap
    assert picker.pick(1 << 20, hashes=prompt).prefill.worker_id == "p0"
    picker.in_flight.update(["d1", "d1"])  # d1's capacity (2) is taken
    assert picker.pick(1 << 20, hashes=prompt).decode.worker_id == "d0"
    picker.forget("p1")
    picker.in_flight.clear()
    assert picker.pick(1 << 20, hashes=prompt).prefill.worker_id == "p0"
    off = Picker(registry, "/run/x", affinity=False)
    off.served("d1", prompt)
    assert off.pick(1 << 20, hashes=prompt).decode.worker_id == "d0"


def test_prompt_hashes_of_text_and_chat() -> None:
    text = prompt_hashes({"prompt": "x" * 300})
    assert len(text) == 2 and text == prompt_hashes({"prompt": ["x" * 300]})
    chat = prompt_hashes({"messages": [{"role": "user", "content": "y" * 300}]})
    assert len(chat) == 2 and chat != text
    assert prompt_hashes({"prompt": [[1, 2], [3]]}) == ()


def test_router_reads_its_instances_from_a_real_orchestrator(tmp_path: Path) -> None:
    """The registry is a `topkv orchestrator` process: instances register there; the front
    door refuses registrations, sees the orchestrator's workers, and names a dead registry."""
    files = StackFiles.create(tmp_path)
    with Supervisor(tmp_path / "logs", grace_s=10) as supervisor:
        orchestrator, url = start_orchestrator(supervisor, files)
        prefill = _worker("prefill0", "prefill", "hostA").model_dump(mode="json")
        body = {"worker": prefill, "ttl_s": 60}
        assert _call(url + "/v1/workers", files.worker_token, body)[0] == 201
        router = RouterThread(files.admin_token, files.worker_token, str(tmp_path), url)
        try:
            status, _ = _call(router.url + "/v1/workers", files.worker_token, body)
            assert status == 409  # instances register with the orchestrator
            assert [w.worker_id for w in router.server.registry.workers()] == ["prefill0"]
            status, answer = _call(
                router.url + "/v1/completions", files.admin_token, {"prompt": "x"}
            )
            assert status == 503 and "no decode instance is registered" in json.dumps(answer)
            supervisor.stop(orchestrator)
            deadline = time.monotonic() + 30
            while router.server.registry.workers() and time.monotonic() < deadline:
                time.sleep(0.2)
            status, answer = _call(
                router.url + "/v1/completions", files.admin_token, {"prompt": "x"}
            )
            assert status == 503
            assert f"the registry at {url} is unreachable" in json.dumps(answer)
        finally:
            router.close()


def test_a_wrong_registry_token_is_named(tmp_path: Path) -> None:
    files = StackFiles.create(tmp_path)
    with Supervisor(tmp_path / "logs", grace_s=10) as supervisor:
        _, url = start_orchestrator(supervisor, files)
        router = RouterThread(files.admin_token, files.worker_token, str(tmp_path), url)
        try:
            registry = router.server.registry
            assert isinstance(registry, OrchestratorRegistry)
            wrong = OrchestratorRegistry(url, "tkv_not_the_admin_token")
            asyncio.run_coroutine_threadsafe(wrong.refresh(), router.loop).result(10)
            assert (
                wrong.problem is not None
                and "refused the front door's token (401)" in wrong.problem
            )
            asyncio.run_coroutine_threadsafe(wrong.aclose(), router.loop).result(10)
        finally:
            router.close()


def test_router_reads_its_instances_from_a_real_etcd(tmp_path: Path) -> None:
    """``--registry etcd://``: the instances hold their own leases in etcd (as a connector
    with that registry_url does); the front door lists them from there."""
    from etcd_servers import start_etcd, stop_etcd
    from topkv.relay.registry.memory import open_registry

    etcd = start_etcd(tmp_path / "etcd", "router")
    url = f"etcd://127.0.0.1:{etcd.port}"
    registry = open_registry(url)
    router = None
    try:
        lease = registry.register(_worker("prefill0", "prefill", "hostA"), ttl_s=30)
        router = RouterThread(ADMIN, WORKER, str(tmp_path), url)
        assert [w.worker_id for w in router.server.registry.workers()] == ["prefill0"]
        status, answer = _call(router.url + "/v1/completions", ADMIN, {"prompt": "x"})
        assert status == 503 and "no decode instance is registered" in json.dumps(answer)
        lease.deregister()
        deadline = time.monotonic() + 10
        while router.server.registry.workers() and time.monotonic() < deadline:
            time.sleep(0.1)
        status, answer = _call(router.url + "/v1/completions", ADMIN, {"prompt": "x"})
        assert status == 503 and "no prefill instance is registered" in json.dumps(answer)
    finally:
        if router is not None:
            router.close()
        registry.close()
        stop_etcd(etcd)


def test_held_tokens_are_whole_blocks_short_of_the_last_token() -> None:
    assert held_tokens({"prompt": list(range(360))}, 10) == 320
    assert held_tokens({"prompt": list(range(320))}, 10) == 288  # vLLM computes the last one
    assert held_tokens({"prompt": list(range(360))}, 0) == 0
    assert held_tokens({"prompt": "text"}, 3) == 0  # its tokens are not known here
