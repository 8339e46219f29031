"""Orchestrator and workers as real processes: transfers delivered, verified and counted."""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from typing import Any

import pytest

from topkv.service.cluster.local import LocalCluster, SmokeLayout, run_smoke
from topkv.service.kvstore import synthetic_kv
from topkv.service.orchestrator.client import ApiError, OrchestratorClient, http_json
from topkv.service.orchestrator.models import TopologyView, TransferList, TransferView, WorkerList
from topkv.transport.base import KVLayout

ClusterFactory = Callable[..., LocalCluster]

LAYOUT = {"num_layers": 3, "seq_len": 64, "kv_heads": 4, "head_dim": 64, "dtype": "fp16"}


def metric(text: str, name: str, **labels: str) -> float:
    """One sample's value from a Prometheus text exposition (0 when absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        match = re.fullmatch(r"([a-zA-Z_:]+)(\{(.*)\})? (\S+)", line)
        if match is None or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(3) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(4))
    return 0.0


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_transfers_delivered_verified_and_counted(make_cluster: ClusterFactory) -> None:
    cluster = make_cluster(prefill=1, decode=2)
    client = cluster.client()
    before = client.metrics()
    assert metric(before, "topkv_transfers_total", mode="pcie", outcome="delivered") == 0

    accepted = client.submit(request_id=7, model="m", layout=LAYOUT)
    assert TransferView.model_validate(accepted).state in ("queued", "planned", "running")
    record = TransferView.model_validate(client.wait_done(7, 30))
    assert record.state == "delivered"
    assert record.transport == "pcie" and record.medium == "shm" and not record.emulated
    assert record.decode_check is not None and record.decode_check.matches_source
    # The digest the decode worker computed from its bytes is the one any process
    # computes for this request's deterministic KV.
    layout = KVLayout(3, 64, 4, 64, "fp16")
    assert record.decode_check.digest == synthetic_kv(7, "m", layout).digest
    assert record.source_digest == record.decode_check.digest

    report = run_smoke(client, 6, SmokeLayout(layers=2, tokens=32), first_id=100)
    assert report["delivered"] == report["verified"] == 6
    assert {r["destination"] for r in report["results"]} <= {
        w["worker"]["worker_id"] for w in client.workers() if w["worker"]["role"] == "decode"
    }

    after = client.metrics()
    delivered = metric(after, "topkv_transfers_total", mode="pcie", outcome="delivered")
    assert delivered == 7
    size_small = 2 * 32 * 8 * 128 * 2 * 2
    expected_bytes = layout.total_bytes + 6 * size_small
    assert metric(after, "topkv_transfer_bytes_total", mode="pcie") == expected_bytes
    assert metric(after, "topkv_transfer_seconds_count", mode="pcie") == 7
    assert metric(after, "topkv_handoff_seconds_count") == 7
    assert metric(after, "topkv_decode_checks_total", result="match") == 7
    assert metric(after, "topkv_transfers_in_flight") == 0

    listing = TransferList.model_validate(client.get("/v1/transfers?state=delivered&limit=3"))
    assert len(listing.transfers) == 3 and listing.counts["delivered"] == 7
    workers = WorkerList.model_validate(client.get("/v1/workers"))
    assert sorted(w.worker.role for w in workers.workers) == ["decode", "decode", "prefill"]
    assert all(w.slots_used == 0 for w in workers.workers)  # decode stand-in freed them
    topology = TopologyView.model_validate(client.get("/v1/topology"))
    assert topology.source == "registrations" and len(topology.pairs) == 2
    assert all(
        p.same_host and "pcie" in {c.transport for c in p.candidates} for p in topology.pairs
    )


def test_health_readiness_openapi_and_errors(make_cluster: ClusterFactory) -> None:
    cluster = make_cluster(prefill=1, decode=1)
    client = cluster.client()
    assert client.get("/healthz") == {"ok": True, "detail": ""}
    ready = client.get("/readyz")
    assert ready["ready"] and ready["prefill_workers"] == 1 and ready["decode_workers"] == 1

    doc = client.get("/openapi.json")
    assert doc["openapi"].startswith("3.")
    for path in (
        "/v1/requests",
        "/v1/requests/{request_id}",
        "/v1/transfers",
        "/v1/workers",
        "/v1/topology",
        "/healthz",
        "/readyz",
        "/metrics",
        "/openapi.json",
    ):
        assert path in doc["paths"], path
    assert "SubmitRequest" in doc["components"]["schemas"]

    with pytest.raises(ApiError) as bad:
        client.submit(model="m")  # neither layout nor prompt_tokens
    assert bad.value.status == 400 and "layout" in bad.value.body["error"]["detail"]
    with pytest.raises(ApiError) as unknown:
        client.request(424242)
    assert unknown.value.status == 404
    with pytest.raises(ApiError) as no_source:
        client.submit(model="m", layout=LAYOUT, source="nobody")
    assert no_source.value.status == 409
    with pytest.raises(ApiError) as unknown_model:
        client.submit(model="no-such-model", prompt_tokens=16)
    assert unknown_model.value.status == 400
    with pytest.raises(ApiError) as huge:
        client.submit(model="m", layout={**LAYOUT, "num_layers": 1024, "seq_len": 10_000_000})
    assert huge.value.status == 400

    # A catalog model and a prompt length give the layout (Llama-3-70B: 80 layers, 8 KV heads).
    rec = client.submit(request_id=3, model="llama-3-70b", prompt_tokens=4)
    assert rec["layers"] == 80 and rec["size_bytes"] == 2 * 80 * 8 * 128 * 4 * 2
    assert client.wait_done(3, 30)["state"] == "delivered"


def test_killed_decode_worker_leaves_and_next_request_goes_elsewhere(
    make_cluster: ClusterFactory,
) -> None:
    cluster = make_cluster(prefill=1, decode=2, ttl_s=1.0)
    client = cluster.client()
    _kill_one_decoder_and_check(cluster, client)


def test_etcd_registry_cluster(make_cluster: ClusterFactory, etcd_url: str) -> None:
    cluster = make_cluster(prefill=1, decode=2, registry=etcd_url, ttl_s=2.0)
    client = cluster.client()
    assert client.get("/v1/workers")["registry"] == etcd_url
    with pytest.raises(ApiError) as refused:
        client.post("/v1/workers", {"worker": {"worker_id": "x", "role": "decode", "node": "n"}})
    assert refused.value.status == 409
    report = run_smoke(client, 3, SmokeLayout(layers=2, tokens=16))
    assert report["delivered"] == report["verified"] == 3
    metrics = client.metrics()
    assert metric(metrics, "topkv_transfers_total", mode="pcie", outcome="delivered") == 3
    _kill_one_decoder_and_check(cluster, client, first_id=50)


def _kill_one_decoder_and_check(
    cluster: LocalCluster, client: OrchestratorClient, first_id: int = 10
) -> None:
    decoders = {n: p for n, p in cluster.workers.items() if n.startswith("decode")}
    victim_name, victim = sorted(decoders.items())[0]
    victim_id = victim.ready["worker_id"]
    survivor_id = next(p.ready["worker_id"] for n, p in decoders.items() if n != victim_name)
    cluster.supervisor.kill(victim)  # SIGKILL: no deregistration, the lease must expire

    def gone() -> bool:
        return victim_id not in {w["worker"]["worker_id"] for w in client.workers()}

    wait_for(gone, 15, f"{victim_id} to leave the registry")
    for n in range(3):
        client.submit(request_id=first_id + n, model="m", layout=LAYOUT)
        record = client.wait_done(first_id + n, 30)
        assert record["state"] == "delivered", record
        assert record["destination"] == survivor_id
        assert record["decode_check"]["matches_source"]


def test_worker_control_api_rejects_bad_input(make_cluster: ClusterFactory) -> None:
    cluster = make_cluster(prefill=1, decode=1)
    prefill = next(p for n, p in cluster.workers.items() if n.startswith("prefill"))
    base = prefill.ready["control_url"]
    with pytest.raises(ApiError) as anonymous:  # the control API needs the admin token
        http_json("GET", f"{base}/v1/kv/5")
    assert anonymous.value.status == 401
    api = functools.partial(http_json, token=cluster.admin_token())
    with pytest.raises(ApiError) as missing:
        api("GET", f"{base}/v1/kv/5")
    assert missing.value.status == 404
    with pytest.raises(ApiError) as bad_id:
        api("GET", f"{base}/v1/kv/minus-one")
    assert bad_id.value.status == 400
    with pytest.raises(ApiError) as bad_medium:
        api(
            "POST",
            f"{base}/v1/receive",
            {"request_id": 1, "model_id": "m", "layout": LAYOUT, "medium": "carrier-pigeon"},
        )
    assert bad_medium.value.status == 400
    with pytest.raises(ApiError) as send_unknown:
        api(
            "POST",
            f"{base}/v1/send",
            {"request_id": 9, "destination": "tcp://127.0.0.1:1", "medium": "tcp", "timeout_s": 1},
        )
    assert send_unknown.value.status == 404
    held = api("POST", f"{base}/v1/kv/5/prefill", {"model_id": "m", "layout": LAYOUT})
    assert held["digest"] == synthetic_kv(5, "m", KVLayout(3, 64, 4, 64)).digest
    # Sending to a port nobody listens on fails as a transport error, not a crash.
    with pytest.raises(ApiError) as refused:
        api(
            "POST",
            f"{base}/v1/send",
            {"request_id": 5, "destination": "tcp://127.0.0.1:1", "medium": "tcp", "timeout_s": 5},
        )
    assert refused.value.status == 502 and refused.value.body["error"]["kind"] == "transport"
    assert api("DELETE", f"{base}/v1/kv/5") == {"request_id": 5, "released": True}
    assert api("GET", f"{base}/v1/info")["held"] == 0


def test_dead_destination_still_registered_is_rerouted(make_cluster: ClusterFactory) -> None:
    # A long lease: the registry still lists the killed worker when the next request comes,
    # so the attempt itself must discover the death and reroute.
    cluster = make_cluster(prefill=1, decode=2, ttl_s=60.0)
    client = cluster.client()
    client.submit(request_id=1, model="m", layout=LAYOUT)
    first = client.wait_done(1, 30)
    favourite = first["destination"]  # ties break by worker id: routing picks it again
    victim = next(p for p in cluster.workers.values() if p.ready["worker_id"] == favourite)
    cluster.supervisor.kill(victim)
    assert favourite in {w["worker"]["worker_id"] for w in client.workers()}

    client.submit(request_id=2, model="m", layout=LAYOUT)
    second = client.wait_done(2, 60)
    assert second["state"] == "delivered", second
    assert second["destination"] != favourite
    assert second["reroutes"] == 1
    assert second["attempts"][0]["destination"] == favourite
    assert second["attempts"][0]["error"] == "destination_died"
    assert second["decode_check"]["matches_source"]
    assert metric(client.metrics(), "topkv_transfer_reroutes_total") == 1
    # The source released its KV after the verified delivery: nothing stranded there.
    prefill = next(p for n, p in cluster.workers.items() if n.startswith("prefill"))
    info = http_json("GET", f"{prefill.ready['control_url']}/v1/info", token=cluster.admin_token())
    assert info["held"] == 0
