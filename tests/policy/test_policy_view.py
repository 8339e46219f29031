"""Snapshot values: endpoints, requests, link load, pair views from facts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from topkv.policy import (
    NO_LOAD,
    Endpoint,
    LinkLoad,
    PathCandidate,
    PolicyInputError,
    TransferRequest,
    pair_view_from_facts,
)

node_names = st.text(
    alphabet=st.characters(codec="ascii", categories=("L", "N"), include_characters="-._:/"),
    min_size=1,
    max_size=30,
).filter(lambda s: s == s.strip())


@given(node=node_names, gpu=st.integers(min_value=0, max_value=10_000))
def test_endpoint_text_round_trips(node: str, gpu: int) -> None:
    endpoint = Endpoint(node, gpu)
    assert Endpoint.parse(str(endpoint)) == endpoint


@given(st.text(max_size=40))
def test_endpoint_parse_accepts_or_refuses_cleanly(text: str) -> None:
    try:
        endpoint = Endpoint.parse(text)
    except PolicyInputError:
        return
    assert endpoint.gpu >= 0 and endpoint.node


@pytest.mark.parametrize("text", ["node0", ":3", "node0:", "node0:-1", "node0:x", "node0:\u0661"])
def test_bad_endpoints_say_what_is_expected(text: str) -> None:
    with pytest.raises(PolicyInputError, match="endpoint"):
        Endpoint.parse(text)


def test_request_and_candidate_validation() -> None:
    with pytest.raises(PolicyInputError, match="negative"):
        TransferRequest(-1)
    with pytest.raises(PolicyInputError, match="chunk"):
        TransferRequest(10, chunks=0)
    with pytest.raises(PolicyInputError, match="override"):
        TransferRequest(10, manual_override=" ")
    with pytest.raises(PolicyInputError, match="bandwidth"):
        PathCandidate("tcp", 0.0, 1e-4)
    with pytest.raises(PolicyInputError, match="setup"):
        PathCandidate("tcp", 10.0, -1.0)


def test_link_load_is_an_immutable_snapshot() -> None:
    load = NO_LOAD.with_flow(["a", "b", "a"], 100).with_flow(["a"], 50)
    assert (load.bytes_on("a"), load.flows_on("a")) == (150, 2)
    assert (load.bytes_on("b"), load.flows_on("b")) == (100, 1)
    assert NO_LOAD.bytes_on("a") == 0
    after = load.without_flow(["a", "b"], 100)
    assert (after.bytes_on("a"), after.flows_on("a"), after.flows_on("b")) == (50, 1, 0)
    with pytest.raises(TypeError):
        load.bytes_in_flight["a"] = 1  # type: ignore[index]
    with pytest.raises(PolicyInputError, match="negative"):
        LinkLoad({"a": -1})


def test_pair_from_facts_lists_paths_per_fact() -> None:
    a, b = Endpoint("n0", 0), Endpoint("n0", 1)
    same = pair_view_from_facts(a, b, same_nvlink_domain=True, rdma_available=True)
    assert same.same_node
    assert same.transports == ("nvlink", "pcie", "rdma", "tcp")
    # NIC loopback: one NIC, then both GPUs' PCIe ports
    assert same.paths_for("rdma")[0].links == ("n0:nic0", "n0/GPU0:pcie", "n0/GPU1:pcie")
    assert same.paths_for("nvlink")[0].links == ("n0/GPU0:nvlink", "n0/GPU1:nvlink")
    remote = pair_view_from_facts(
        a,
        Endpoint("n1", 0),
        same_nvlink_domain=False,
        rdma_available=True,
        src_nics=("mlx5_0", "mlx5_1"),
        dst_nics=("mlx5_0",),
    )
    assert remote.transports == ("rdma", "tcp")
    assert [p.links[:2] for p in remote.paths_for("rdma")] == [
        ("n0:mlx5_0", "n1:mlx5_0"),
        ("n0:mlx5_1", "n1:mlx5_0"),
    ]
    with pytest.raises(PolicyInputError, match="nvlink_transport"):
        pair_view_from_facts(
            a, b, same_nvlink_domain=True, rdma_available=False, nvlink_transport="pcie"
        )
