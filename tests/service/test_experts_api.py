"""``GET /v1/experts`` on a live orchestrator: filled by workers' registrations, filtered,
admin only; a hostile report is refused with the field named."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from topkv.service.http.auth import Credentials, ServerAuth, auth_headers, new_token
from topkv.service.orchestrator.api import OrchestratorServiceConfig, serve_orchestrator


def _worker(wid: str, node: str, experts: range, compute_s: float = 1e-3) -> dict[str, Any]:
    stats = [
        {"layer": layer, "expert": e, "rate": 5.0, "compute_s": compute_s, "queue_depth": 1}
        for layer in (0, 1)
        for e in experts
    ]
    report = {"sequence": 1, "experts_per_token": 2, "moe_layers": 2, "hidden_size": 64}
    return {
        "worker": {
            "worker_id": wid,
            "role": "decode",
            "node": node,
            "gpus": [0],
            "nvlink_domain": f"{node}/nvl",
            "experts": {**report, "stats": stats},
        },
        "ttl_s": 30,
    }


def test_experts_endpoint() -> None:
    admin, worker = new_token(), new_token()
    auth = ServerAuth(Credentials.of(admin=[admin], worker=[worker]))

    async def main() -> None:
        stop = asyncio.Event()
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(
            serve_orchestrator(OrchestratorServiceConfig(auth=auth), "127.0.0.1", 0, stop, ready)
        )
        base = await asyncio.wait_for(ready, 30)

        async def call(method: str, path: str, token: str | None, body: Any = None) -> Any:
            async with http.request(
                method, base + path, json=body, headers=auth_headers(token)
            ) as answer:
                return answer.status, await answer.json()

        try:
            async with aiohttp.ClientSession() as http:
                for wid, node, experts, slow in (
                    ("w-a", "n0", range(0, 4), 1e-3),
                    ("w-b", "n1", range(2, 6), 9e-3),
                ):
                    status, _ = await call(
                        "POST", "/v1/workers", worker, _worker(wid, node, experts, slow)
                    )
                    assert status in (200, 201)
                status, doc = await call("GET", "/v1/experts", admin)
                assert status == 200 and len(doc["experts"]) == 16
                assert doc["workers"] == ["w-a", "w-b"]
                status, doc = await call("GET", "/v1/experts?expert=3", admin)
                assert {e["worker"] for e in doc["experts"]} == {"w-a", "w-b"}
                # Expert 3 on w-b is 9x the other replica's: w-b is flagged.
                assert doc["stragglers"] == ["w-b"]
                flagged = {e["worker"]: e["straggler"] for e in doc["experts"]}
                assert flagged == {"w-a": False, "w-b": True}
                status, doc = await call("GET", "/v1/experts?domain=n1/nvl", admin)
                assert {e["worker"] for e in doc["experts"]} == {"w-b"}
                status, doc = await call("GET", "/v1/experts?worker=w-a&expert=0", admin)
                assert [(e["layer"], e["expert"]) for e in doc["experts"]] == [(0, 0), (1, 0)]
                # Authenticated: no token 401, a worker token 403.
                assert (await call("GET", "/v1/experts", None))[0] == 401
                assert (await call("GET", "/v1/experts", worker))[0] == 403
                # Bad filters are named.
                status, doc = await call("GET", "/v1/experts?expert=-1", admin)
                assert status == 400 and "expert" in doc["error"]["detail"]
                status, doc = await call("GET", "/v1/experts?expert=%D9%A3", admin)  # Arabic 3
                assert status == 400
                # A hostile report is refused, naming the field; nothing of it is kept.
                hostile = _worker("w-c", "n2", range(0, 1))
                hostile["worker"]["experts"]["stats"][0]["queue_depth"] = 10**12
                status, doc = await call("POST", "/v1/workers", worker, hostile)
                assert status == 400 and "queue_depth" in doc["error"]["detail"]
                hostile["worker"]["experts"]["stats"][0].update(queue_depth=0, rate=-2.0)
                status, doc = await call("POST", "/v1/workers", worker, hostile)
                assert status == 400 and "rate" in doc["error"]["detail"]
                status, doc = await call("GET", "/v1/experts?worker=w-c", admin)
                assert doc["experts"] == []
        finally:
            stop.set()
            await task

    asyncio.run(main())
