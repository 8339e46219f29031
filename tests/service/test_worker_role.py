"""``POST /v1/role``: a real worker changes pools and re-registers with its new role, in the
memory registry, in a real etcd and through the orchestrator's HTTP registration; a worker
holding KV not yet acknowledged is refused (409) and stays where it is; the endpoint takes
the admin token only."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from topkv.harness.inprocess_cluster import InProcessCluster, WorkerSpec
from topkv.relay.executor import AttemptFailed, AttemptPlan
from topkv.relay.registry.memory import MemoryRegistry, WorkerRegistry, open_registry
from topkv.relay.workers import RegistryEvent
from topkv.service.http.auth import auth_headers
from topkv.service.messages import LayoutModel, PrefillRequest
from topkv.service.orchestrator.executor import RemoteExecutor
from topkv.service.worker.registrar import DirectRegistrar
from topkv.service.worker.service import WorkerConfig, WorkerService
from topkv.transport.base import KVLayout

LAYOUT = KVLayout(num_layers=2, seq_len=16, kv_heads=1, head_dim=16)


async def _role_of(url: str, token: str | None) -> tuple[int, dict[str, object]]:
    async with (
        aiohttp.ClientSession(headers=auth_headers(token)) as session,
        session.get(f"{url}/v1/role") as response,
    ):
        return response.status, await response.json()


def test_decode_worker_turns_prefill_and_back_in_the_memory_registry() -> None:
    async def main() -> None:
        registry = MemoryRegistry()
        events: list[RegistryEvent] = []
        registry.watch(events.append)
        async with InProcessCluster(registry) as cluster:
            executor = RemoteExecutor(token=cluster.admin_token)
            try:
                await cluster.start([WorkerSpec("decode", "n0", 0, worker_id="d0")])
                info = cluster.info("d0")
                seconds = await executor.set_role(
                    info, "prefill", chunk_tokens=512, reserved_slots=2
                )
                assert 0 <= seconds < 5
                now = registry.get("d0")
                assert now is not None and now.role == "prefill"
                assert now.control_url == info.control_url  # same worker, other pool
                assert [e.kind for e in events] == ["join", "update"]
                status, body = await _role_of(info.control_url, cluster.admin_token)
                assert status == 200
                assert body["role"] == "prefill" and body["native"] == "decode"
                assert body["chunked_prefill"] == {"chunk_tokens": 512, "reserved_slots": 2}
                # the converted worker prefills (one runtime: any worker can)
                await executor.prefill(
                    now, 1, PrefillRequest(model_id="m", layout=LayoutModel.of(LAYOUT))
                )
                assert cluster.held("d0") == [1]
                # holding KV not yet acknowledged: never converted (409), role unchanged
                with pytest.raises(AttemptFailed, match=r"409.*not yet acknowledged"):
                    await executor.set_role(now, "decode", chunk_tokens=512, reserved_slots=2)
                assert (registry.get("d0") or info).role == "prefill"
                await executor.release_source(now, 1)
                await executor.set_role(now, "decode", chunk_tokens=512, reserved_slots=2)
                back = registry.get("d0")
                assert back is not None and back.role == "decode"
                status, body = await _role_of(info.control_url, cluster.admin_token)
                assert body["role"] == "decode" and body["chunked_prefill"] is None
                # the same role again changes nothing
                await executor.set_role(back, "decode", chunk_tokens=512, reserved_slots=2)
                assert [e.kind for e in events] == ["join", "update", "update"]
            finally:
                await executor.close()

    asyncio.run(main())


def test_decode_sequences_beyond_the_reserve_refuse_the_conversion() -> None:
    async def main() -> None:
        registry = MemoryRegistry()
        async with InProcessCluster(registry) as cluster:
            executor = RemoteExecutor(token=cluster.admin_token)
            try:
                await cluster.start(
                    [
                        WorkerSpec("prefill", "n0", 0, worker_id="p0"),
                        WorkerSpec("decode", "n0", 1, worker_id="d0"),
                    ]
                )
                # d0 decodes one sequence: real KV moved to it and verified
                p0, d0 = cluster.info("p0"), cluster.info("d0")
                body = PrefillRequest(model_id="m", layout=LayoutModel.of(LAYOUT))
                await executor.prefill(p0, 5, body)
                await executor.transfer(AttemptPlan(5, "m", LAYOUT, p0, d0, "tcp", 1, 10.0))
                assert cluster.held("d0") == [5]
                with pytest.raises(AttemptFailed, match=r"409.*1 decode sequences"):
                    await executor.set_role(d0, "prefill", chunk_tokens=512, reserved_slots=0)
                assert (registry.get("d0") or d0).role == "decode"
                # within the reserve it is kept and the worker converts
                await executor.set_role(d0, "prefill", chunk_tokens=512, reserved_slots=1)
                assert (registry.get("d0") or d0).role == "prefill"
                assert cluster.held("d0") == [5]
            finally:
                await executor.close()

    asyncio.run(main())


async def _announce(url: str, token: str | None, request_id: int, keep: bool) -> None:
    """``POST /v1/receive``: the worker expects a copy of request ``request_id``'s KV."""
    body = {
        "request_id": request_id,
        "model_id": "m",
        "layout": LayoutModel.of(LAYOUT).model_dump(),
        "medium": "tcp",
        "keep": keep,
    }
    async with (
        aiohttp.ClientSession(headers=auth_headers(token)) as session,
        session.post(f"{url}/v1/receive", json=body) as response,
    ):
        assert response.status == 200, await response.text()


def test_a_drained_copy_landing_does_not_hold_a_conversion_a_kept_one_does() -> None:
    """A measurement copy (``keep`` false: verified and released on arrival, whatever the
    worker's role) holds no request's KV: it does not refuse the conversion. A request's KV
    announced (``keep`` true) does (409), until it is dropped."""

    async def main() -> None:
        registry = MemoryRegistry()
        async with InProcessCluster(registry) as cluster:
            executor = RemoteExecutor(token=cluster.admin_token)
            try:
                await cluster.start([WorkerSpec("decode", "n0", 0, worker_id="d0")])
                info = cluster.info("d0")
                url, token = info.control_url, cluster.admin_token
                await _announce(url, token, 7, keep=True)
                with pytest.raises(AttemptFailed, match=r"409.*1 receive\(s\) pending"):
                    await executor.set_role(info, "prefill", chunk_tokens=512, reserved_slots=0)
                assert (registry.get("d0") or info).role == "decode"
                async with (
                    aiohttp.ClientSession(headers=auth_headers(token)) as session,
                    session.delete(f"{url}/v1/kv/7") as response,
                ):
                    assert response.status == 200, await response.text()
                await _announce(url, token, 1 << 40, keep=False)  # a baseline copy's id
                await executor.set_role(info, "prefill", chunk_tokens=512, reserved_slots=0)
                assert (registry.get("d0") or info).role == "prefill"
            finally:
                await executor.close()

    asyncio.run(main())


def test_role_endpoint_needs_the_admin_token() -> None:
    async def main() -> None:
        async with InProcessCluster(MemoryRegistry()) as cluster:
            await cluster.start([WorkerSpec("decode", "n0", 0, worker_id="d0")])
            url = cluster.info("d0").control_url
            status, _ = await _role_of(url, None)
            assert status == 401
            async with (
                aiohttp.ClientSession(headers=auth_headers("tkv_wrong")) as session,
                session.post(f"{url}/v1/role", json={"role": "prefill"}) as response,
            ):
                assert response.status == 401
            async with (
                aiohttp.ClientSession(headers=auth_headers(cluster.admin_token)) as session,
                session.post(f"{url}/v1/role", json={"role": "both"}) as response,
            ):
                assert response.status == 400
                assert "role" in (await response.json())["error"]["detail"]
            assert (cluster.registry.get("d0") or cluster.info("d0")).role == "decode"

    asyncio.run(main())


@pytest.mark.etcd
def test_conversion_re_registers_in_etcd_keeping_the_lease(etcd_url: str) -> None:
    async def main() -> None:
        watcher: WorkerRegistry = open_registry(etcd_url + "/adp-role")
        seen: list[RegistryEvent] = []
        cancel = watcher.watch(seen.append)
        config = WorkerConfig(
            role="decode",
            node="n0",
            secret=b"etcd-role-secret-0123456789abcdef",
            worker_id="d-etcd",
            media=("tcp",),
            ttl_s=3.0,
            auth=None,
        )
        worker = WorkerService(config, DirectRegistrar(open_registry(etcd_url + "/adp-role")))
        executor = RemoteExecutor()
        try:
            info = await worker.start()
            await executor.set_role(info, "prefill", chunk_tokens=512, reserved_slots=0)
            found = await asyncio.to_thread(watcher.get, "d-etcd")
            assert found is not None and found.role == "prefill"
            # the lease is the same one: heartbeats keep the new record alive past its TTL
            await asyncio.sleep(4.0)
            found = await asyncio.to_thread(watcher.get, "d-etcd")
            assert found is not None and found.role == "prefill"
            deadline = asyncio.get_running_loop().time() + 5
            while not any(e.kind == "update" and e.info and e.info.role == "prefill" for e in seen):
                assert asyncio.get_running_loop().time() < deadline, seen
                await asyncio.sleep(0.05)
            assert not any(e.kind == "leave" for e in seen)
        finally:
            await executor.close()
            await worker.stop()
            cancel()
            watcher.close()

    asyncio.run(main())
