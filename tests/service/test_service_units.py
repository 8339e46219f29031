"""Service pieces without processes: request parsing, media, error mapping, the schema."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from topkv.errors import ConfigError
from topkv.kv.errors import UnknownModelError
from topkv.relay.executor import AttemptFailed, AttemptPlan
from topkv.relay.transfers import FailureKind
from topkv.relay.workers import WorkerInfo
from topkv.service.messages import MAX_KV_BYTES, LayoutModel
from topkv.service.orchestrator.api import OrchestratorService, OrchestratorServiceConfig
from topkv.service.orchestrator.executor import RemoteExecutor, _worker_error
from topkv.service.orchestrator.models import SubmitRequest
from topkv.service.orchestrator.openapi import openapi_document
from topkv.service.worker.send import paced_source
from topkv.transport.base import KVLayout, TransportMode
from topkv.transport.emulated import LinkModel
from topkv.transport.tcp import TcpSource


def test_prompt_tokens_of_a_catalog_model_give_its_layout() -> None:
    gqa = SubmitRequest(model="Llama-3-70B", prompt_tokens=4096).resolved_layout()
    assert (gqa.num_layers, gqa.kv_heads, gqa.head_dim, gqa.latent) == (80, 8, 128, False)
    assert gqa.to_layout().total_bytes == 1_342_177_280  # SPEC: 1.34 GB at 4K tokens
    mla = SubmitRequest(model="DeepSeek-V3", prompt_tokens=4096).resolved_layout()
    assert mla.latent and mla.kv_heads == 1 and mla.head_dim == 576
    assert mla.to_layout().total_bytes == 61 * 4096 * 576 * 2


def test_submit_needs_exactly_one_shape_and_a_known_uniform_model() -> None:
    layout = {"num_layers": 1, "seq_len": 1, "kv_heads": 1, "head_dim": 1}
    with pytest.raises(ValidationError, match="exactly one"):
        SubmitRequest(model="m")
    with pytest.raises(ValidationError, match="exactly one"):
        SubmitRequest.model_validate({"model": "m", "prompt_tokens": 4, "layout": layout})
    with pytest.raises(UnknownModelError):
        SubmitRequest(model="no-such-model", prompt_tokens=4).resolved_layout()
    with pytest.raises(ConfigError, match="explicit 'layout'"):
        SubmitRequest(model="gpt-oss-120b", prompt_tokens=4).resolved_layout()


@given(
    st.dictionaries(
        st.sampled_from(["num_layers", "seq_len", "kv_heads", "head_dim", "dtype", "latent", "x"]),
        st.one_of(st.integers(-5, 2**40), st.text(max_size=5), st.booleans(), st.none()),
    )
)
def test_layout_parsing_accepts_bounded_layouts_and_rejects_the_rest_cleanly(
    raw: dict[str, object],
) -> None:
    try:
        parsed = LayoutModel.model_validate(raw)
    except ValidationError:
        return
    layout = parsed.to_layout()
    assert 0 < layout.total_bytes <= MAX_KV_BYTES
    assert LayoutModel.of(layout) == parsed


def _worker(name: str, host: str) -> WorkerInfo:
    role = "prefill" if name.startswith("p") else "decode"
    return WorkerInfo(worker_id=name, role=role, node=host, host_id=host)


def _plan(path_class: str, src_host: str, dst_host: str) -> AttemptPlan:
    return AttemptPlan(
        request_id=1,
        model_id="m",
        layout=KVLayout(1, 1, 1, 1),
        source=_worker("p0", src_host),
        destination=_worker("d0", dst_host),
        path_class=path_class,
        attempt=1,
        timeout_s=1.0,
    )


def test_media_follow_the_hosts() -> None:
    executor = RemoteExecutor()
    assert executor.medium_for(_plan("pcie", "a", "a")) == "shm"
    assert executor.medium_for(_plan("tcp", "a", "b")) == "tcp"
    assert executor.medium_for(_plan("rdma", "a", "b")) == "emulated-rdma"
    with pytest.raises(AttemptFailed) as cross:
        executor.medium_for(_plan("pcie", "a", "b"))
    assert cross.value.kind == FailureKind.TRANSPORT
    with pytest.raises(AttemptFailed) as unknown:
        executor.medium_for(_plan("carrier-pigeon", "a", "a"))
    assert unknown.value.kind == FailureKind.TRANSPORT


def test_a_paced_source_wraps_the_worker_medium_in_one_modelled_link() -> None:
    medium = TcpSource(b"secret")
    paced = paced_source(medium, "rdma", 25.0, 1e-5, dilation=10.0)
    assert paced.inner is medium and paced.name == "emulated-rdma"
    assert paced.link == LinkModel(TransportMode.RDMA, 25.0, 1e-5) and paced.dilation == 10.0
    assert paced_source(medium, TransportMode.TCP, 1.0, 5e-5).dilation == 1.0


def test_worker_errors_map_to_failure_kinds() -> None:
    w = _worker("d0", "a")

    def kind(status: int, body: object, not_found: FailureKind = FailureKind.SOURCE_LOST) -> str:
        return _worker_error(w, "/p", status, body, "", not_found).kind.value

    def err(k: str) -> dict[str, object]:
        return {"error": {"kind": k, "detail": "x"}}

    assert kind(502, err("checksum")) == "checksum"
    assert kind(504, err("timeout")) == "timeout"
    assert kind(409, err("capacity")) == "no_destination"
    assert kind(404, err("not_found")) == "source_lost"
    assert kind(404, err("not_found"), FailureKind.TRANSPORT) == "transport"
    assert kind(502, "not json") == "transport"
    assert kind(500, err("weird")) == "internal"


def test_every_route_is_in_the_openapi_document() -> None:
    service = OrchestratorService(OrchestratorServiceConfig(auth=None))
    doc = openapi_document()
    for route in service.app().router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        if route.method == "HEAD":
            continue
        assert path in doc["paths"], path
        assert route.method.lower() in doc["paths"][path], (route.method, path)
    for path_item in doc["paths"].values():
        for operation in path_item.values():
            if isinstance(operation, dict):
                for response in operation["responses"].values():
                    for media in response.get("content", {}).values():
                        ref = media["schema"].get("$ref")
                        if ref:
                            assert ref.rsplit("/", 1)[1] in doc["components"]["schemas"]
