"""``topkv sim`` end to end on trace slices, cluster builders, event cores."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import pytest
from typer.testing import CliRunner

from topkv.cli.main import _typer_app
from topkv.kv.catalog import get_model
from topkv.sim.cluster import (
    BUILTIN_CLUSTERS,
    SimCluster,
    load_cluster_spec,
    spec_from_topology,
)
from topkv.sim.errors import ClusterSpecError
from topkv.sim.runner import SimConfig, run_policy
from topkv.traces import synthetic

TRACES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
POLICY_KEYS = {
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "goodput_rps",
    "transfer_ms_p50",
    "bytes_by_transport",
    "rejected",
    # issue #15 (Adaptive Decoder Pool), present with the ADP off too
    "ttft_p90_ms",
    "conversions",
    "prefill_workers_max",
    "prefill_workers_min",
}


def _slice(src: Path, dst: Path, lines: int) -> Path:
    with src.open(encoding="utf-8") as handle:
        dst.write_text("".join(islice(handle, lines)), encoding="utf-8")
    return dst


@pytest.mark.parametrize(
    ("trace", "cluster"),
    [
        ("azure_2023/AzureLLMInferenceTrace_conv.csv", "4x-dgx-h100"),
        ("azure_2023/AzureLLMInferenceTrace_code.csv", "8x-l40s-pcie"),
        ("mooncake/conversation_trace.jsonl", "2x-gb200-nvl72"),
    ],
)
def test_cli_json_keys(tmp_path: Path, trace: str, cluster: str) -> None:
    path = _slice(TRACES / trace, tmp_path / Path(trace).name, 120)
    model = "Llama-3-8B" if "l40s" in cluster else "Llama-3-70B"
    result = CliRunner().invoke(
        _typer_app,
        ["sim", "--trace", str(path), "--cluster", cluster, "--model", model, "--json"],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(doc) == {
        "requests",
        "rejected",
        "sim_seconds",
        "wall_seconds",
        "speed_x_realtime",
        "policies",
    }
    assert doc["requests"] == 119 if "azure" in trace else 120
    assert doc["rejected"] == 0
    assert set(doc["policies"]) == {"uniform-rdma", "paper", "cost"}
    for summary in doc["policies"].values():
        assert set(summary) == POLICY_KEYS
        assert summary["ttft_p50_ms"] > 0
    assert set(doc["policies"]["uniform-rdma"]["bytes_by_transport"]) == {"rdma"}


def test_cli_servegen_report_and_pipelining(tmp_path: Path) -> None:
    folder = tmp_path / "sg"
    folder.mkdir()
    _slice(TRACES / "servegen/m-large/chunk-0-trace.csv", folder / "chunk-0-trace.csv", 6)
    report = tmp_path / "report"
    result = CliRunner().invoke(
        _typer_app,
        [
            "sim",
            "--trace",
            str(folder),
            "--policy",
            "paper",
            "--pipelining",
            "both",
            "--rate-scale",
            "0.5",
            "--limit",
            "200",
            "--report",
            str(report),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(doc["policies"]) == {"paper"}
    assert set(doc["policies_without_pipelining"]) == {"paper"}
    for name in ("ttft_cdf.png", "link_utilization.png", "index.html", "summary.json"):
        assert (report / name).stat().st_size > 0
    assert (report / "ttft_cdf.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_bad_input_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.0,x,1\n")
    result = CliRunner().invoke(_typer_app, ["sim", "--trace", str(bad)])
    assert result.exit_code != 0
    assert isinstance(result.exception, Exception)
    assert "bad.csv:2" in str(result.exception)


def test_cluster_file_that_cannot_run_the_model_names_the_file_before_simulating(
    tmp_path: Path,
) -> None:
    odd = tmp_path / "odd.yaml"
    odd.write_text("node_groups:\n  - count: 1\n    gpu: H100\n    gpus_per_node: 7\n")
    result = CliRunner().invoke(_typer_app, ["sim", "--cluster", str(odd), "--limit", "5"])
    assert isinstance(result.exception, ClusterSpecError)
    message = str(result.exception)
    assert message.startswith(f"{odd}: tensor parallelism 4 does not divide 7 GPUs per node")
    assert "requests" not in result.output  # failed before any progress bar or simulation


def test_builtin_clusters_shape() -> None:
    assert set(BUILTIN_CLUSTERS) == {"4x-dgx-h100", "2x-gb200-nvl72", "8x-l40s-pcie"}
    dgx = SimCluster.build(load_cluster_spec("4x-dgx-h100"), tp=4)
    assert len(dgx.gpus) == 32 and len(dgx.prefill) == len(dgx.decode) == 4
    gb = SimCluster.build(load_cluster_spec("2x-gb200-nvl72"), tp=4)
    assert len(gb.gpus) == 144
    a, b = gb.gpus[0], gb.gpus[4 * 17]  # same rack, different trays
    assert gb.pair_view(a, b).transports[0] == "nvswitch"
    c = gb.gpus[72]  # other rack
    assert "nvswitch" not in gb.pair_view(a, c).transports
    l40 = SimCluster.build(load_cluster_spec("8x-l40s-pcie"), tp=2)
    view = l40.pair_view(l40.gpus[0], l40.gpus[1])
    assert view.transports == ("pcie", "rdma", "tcp")


def test_cluster_yaml(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("node_groups:\n  - {count: 2, gpu: H200, gpus_per_node: 8, nics_per_node: 4}\n")
    spec = load_cluster_spec(str(path))
    assert spec.name == "c" and spec.node_groups[0].gpu == "H200"
    path.write_text("node_groups:\n  - {count: 2, gpu: TPU, gpus_per_node: 8}\n")
    with pytest.raises(ClusterSpecError, match="unknown gpu"):
        load_cluster_spec(str(path))
    with pytest.raises(ClusterSpecError, match="unknown cluster"):
        load_cluster_spec("9x-imaginary")


def test_topology_adapter() -> None:
    from topkv.topology.model import GPU, NIC, Cluster, Node, NVLinkDomain

    node = Node(
        name="n0",
        gpus=[GPU(index=i, name="NVIDIA H100 80GB HBM3", nvlink_domain="n0/nvl") for i in range(8)],
        nics=[NIC(name=f"mlx5_{i}", rate_gbps=400.0, state="ACTIVE") for i in range(8)],
        nvlink_domains=[NVLinkDomain(id="n0/nvl", kind="NVL8", members=[])],
    )
    spec = spec_from_topology(Cluster.replicate(node, 2))
    assert len(spec.node_groups) == 2
    group = spec.node_groups[0]
    assert (group.gpu, group.nvlink, group.nics_per_node, group.nic_gb_s) == (
        "H100",
        "node",
        8,
        50.0,
    )


def test_heap_and_simpy_cores_agree() -> None:
    workload = synthetic(300, rate_rps=20.0, input_tokens=2048, output_tokens=64, seed=4)
    base = dict(model=get_model("Llama-3-70B"), cluster=load_cluster_spec("4x-dgx-h100"))
    heap = run_policy(SimConfig(**base, event_core="heap"), workload, "cost")  # type: ignore[arg-type]
    simpy = run_policy(SimConfig(**base, event_core="simpy"), workload, "cost")  # type: ignore[arg-type]
    assert heap.completed == simpy.completed == 300
    # completion order of simultaneous events may differ; the distributions may not
    assert sorted(heap.ttft_s.tolist()) == pytest.approx(sorted(simpy.ttft_s.tolist()), rel=1e-6)


def test_policies_differ_where_topology_matters() -> None:
    # A loaded 4x DGX H100: uniform RDMA puts every cache on the NICs, the topology-aware
    # policies keep same-node pairs on NVLink; with pipelining off the exposed transfer shows.
    workload = synthetic(400, rate_rps=30.0, input_tokens=4096, output_tokens=32, seed=5)
    config = SimConfig(
        model=get_model("Llama-3-70B"), cluster=load_cluster_spec("4x-dgx-h100"), pipelining=False
    )
    uniform = run_policy(config, workload, "uniform-rdma")
    paper = run_policy(config, workload, "paper")
    assert set(uniform.bytes_by_transport) == {"rdma"}
    assert paper.bytes_by_transport.get("nvlink", 0) > 0
    assert paper.pct(paper.exposed_transfer_s, 50) < uniform.pct(uniform.exposed_transfer_s, 50) / 5
