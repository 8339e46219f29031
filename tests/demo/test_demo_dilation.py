"""The demo's time dilation, derived from its stand-in deployment (issue #19)."""

from __future__ import annotations

from pathlib import Path

import pytest

from topkv.demo.emulation import DemoLinks, StandIn, derived_factor, resolve_dilation
from topkv.demo.errors import DemoError
from topkv.harness.stand_in import DEFAULT_STAND_IN, Deployment, StandInError

#: The demo topology's paths: NVLink 450 GB/s in a node, RDMA 25 GB/s across nodes.
LINKS = DemoLinks("nvlink", 450e9, "rdma", 25e9)
#: Issue #19's figures: Llama-3-70B on a DGX-H100 (TP 4) makes 1.342 GB of KV for a 4K
#: prompt in 303 ms; the demo's model 4.67 MB in 172 ms.
STAND_IN = StandIn(
    "Llama-3-70B", "4x-dgx-h100", 4, 1.342e9 / 0.303, 25e9, "nvlink", 450e9
)  # fmt: skip
DEMO_RATE = 4.67e6 / 0.172


def test_derived_dilation_equates_link_to_compute_per_gpu() -> None:
    # per GPU: 4.43 GB/s / 4 = 1.107 GB/s of KV against a 25 GB/s NIC (ratio 0.0443);
    # the demo's 27.2 MB/s against 25 GB/s needs 40.8x to reach the same ratio
    factor = derived_factor(STAND_IN, DEMO_RATE, LINKS)
    assert factor == pytest.approx((1.342e9 / 0.303 / 4) / DEMO_RATE, rel=1e-12)
    assert factor == pytest.approx(40.8, abs=0.05)
    dilation = resolve_dilation(None, STAND_IN, DEMO_RATE, LINKS)
    assert dilation.derived and not dilation.clamped
    assert dilation.factor == 40.8  # three significant digits
    ratios = dilation.link_to_compute()
    assert ratios["cross_node"]["demo"] == pytest.approx(ratios["cross_node"]["stand_in"], rel=2e-3)
    assert ratios["cross_node"]["stand_in"] == pytest.approx(0.0443, abs=1e-4)
    assert ratios["same_node"]["demo_mode"] == ratios["same_node"]["stand_in_mode"] == "nvlink"
    note = dilation.note()
    assert "40.8x derived for Llama-3-70B on 4x-dgx-h100 (TP 4)" in note
    assert "is not the demo" not in note and "no counterpart" not in note


def test_given_dilation_overrides_with_a_note() -> None:
    dilation = resolve_dilation(3000.0, STAND_IN, DEMO_RATE, LINKS)
    assert dilation.factor == 3000.0 and not dilation.derived
    assert dilation.derived_factor == pytest.approx(40.8, abs=0.05)
    assert "--dilation 3000x overrides the 40.8x derived" in dilation.note()
    assert "no longer represents any deployment" in dilation.note()
    # link time over compute time is now 74x the stand-in's on the cross-node path
    ratios = dilation.link_to_compute()["cross_node"]
    assert ratios["demo"] / ratios["stand_in"] == pytest.approx(3000 / 40.76, rel=1e-2)


def test_a_stand_in_slower_than_the_host_is_clamped_to_1x() -> None:
    dilation = resolve_dilation(None, STAND_IN, DEMO_RATE * 100, LINKS)
    assert dilation.factor == 1.0 and dilation.clamped
    assert "below 1x" in dilation.note()


def test_other_same_node_paths_are_named() -> None:
    pcie = StandIn("M", "C", 1, 1e9, 25e9, "pcie", 31.5e9)
    assert "is not the demo's emulated nvlink" in resolve_dilation(None, pcie, 1e6, LINKS).note()
    apart = StandIn("M", "C", 8, 1e9, 6.25e9)
    dilation = resolve_dilation(None, apart, 1e6, LINKS)
    assert "no counterpart" in dilation.note()
    assert dilation.link_to_compute()["same_node"]["stand_in"] is None


@pytest.mark.parametrize(
    "kwargs",
    [{"tp": 0}, {"kv_bytes_per_prefill_s": 0.0}, {"cross_node_bytes_per_s": float("nan")}],
)
def test_a_stand_in_without_rates_is_refused(kwargs: dict[str, float]) -> None:
    fields = {"model": "M", "cluster": "C", "tp": 1, "kv_bytes_per_prefill_s": 1e9,
              "cross_node_bytes_per_s": 25e9} | kwargs  # fmt: skip
    with pytest.raises(DemoError):
        StandIn(**fields)  # type: ignore[arg-type]


def test_no_rate_no_dilation() -> None:
    with pytest.raises(DemoError, match="KV production rate"):
        derived_factor(STAND_IN, 0.0, LINKS)
    with pytest.raises(DemoError, match="no --dilation"):
        resolve_dilation(None, None, DEMO_RATE, LINKS)


def test_default_stand_in_from_the_simulators_compute_model() -> None:
    deployment = Deployment.parse(DEFAULT_STAND_IN)
    assert deployment.tp == 4
    stand_in = deployment.stand_in([4096])
    compute = deployment.compute
    assert stand_in.kv_bytes_per_prefill_s == compute.kv_bytes(4096) / compute.prefill_s([4096])
    # issue #19: 1.34 GB of KV in 303 ms
    assert stand_in.kv_bytes_per_prefill_s == pytest.approx(4.43e9, rel=0.01)
    assert stand_in.cross_node_bytes_per_s == 25e9  # each GPU's own rail NIC
    assert (stand_in.same_node_mode, stand_in.same_node_bytes_per_s) == ("nvlink", 450e9)
    shaped = deployment.simulated_cluster()
    assert len(shaped.prefill) == len(shaped.decode) == 2
    nodes = {inst.gpus[0].node for inst in shaped.prefill}
    assert len(nodes) == 2  # one prefill instance per node, as the demo's workers
    assert stand_in.as_json() == {
        "model": "Llama-3-70B",
        "cluster": "4x-dgx-h100",
        "kv_bytes_per_prefill_s": round(stand_in.kv_bytes_per_prefill_s),
    }


def test_pcie_only_stand_in_shares_nics_and_pairs_across_nodes() -> None:
    stand_in = Deployment.parse("Llama-3-70B@8x-l40s-pcie").stand_in([512, 1024])
    assert stand_in.tp == 8
    # 8 GPUs share 2 NICs of 25 GB/s: 6.25 GB/s per shard; TP 8 fills a node
    assert stand_in.cross_node_bytes_per_s == 6.25e9
    assert stand_in.same_node_bytes_per_s is None


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("@4x-dgx-h100", "expected MODEL"),
        ("No-Such-Model", "unknown model"),
        ("Llama-3-70B@no-such-cluster", "unknown cluster"),
        ("Llama-3.1-405B", "tensor parallelism"),
    ],
)
def test_bad_stand_ins_are_named(text: str, match: str) -> None:
    with pytest.raises(StandInError, match=match):
        Deployment.parse(text)


def test_one_nic_per_node_is_contention_the_dilation_carries() -> None:
    one_nic = Path(__file__).parent / "clusters" / "4x-dgx-h100-1nic.yaml"
    lengths = [380, 1024]
    shared = Deployment.parse(f"Llama-3-70B@{one_nic}").stand_in(lengths)
    own = Deployment.parse(DEFAULT_STAND_IN).stand_in(lengths)
    # the 4 shards of an instance share one 25 GB/s NIC: 6.25 GB/s each
    assert shared.cross_node_bytes_per_s == 6.25e9
    assert shared.kv_bytes_per_prefill_s == own.kv_bytes_per_prefill_s
    assert derived_factor(shared, DEMO_RATE, LINKS) == pytest.approx(
        4 * derived_factor(own, DEMO_RATE, LINKS)
    )
    # NVLink is as fast as ever, its ratio dilated 4x too far: said so
    assert "ratio is 4x the stand-in's" in resolve_dilation(None, shared, DEMO_RATE, LINKS).note()
