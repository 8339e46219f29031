"""`topkv discover` / `topkv nic-map` end to end, and the command runners."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from topkv.cli.main import _typer_app
from topkv.jsonout import loads_strict
from topkv.topology.build import collect, discover_local
from topkv.topology.probes import (
    PROBES,
    FixtureRunner,
    KubectlExecRunner,
    LocalRunner,
    probe_nvml,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TOPO = FIXTURES / "nvidia-smi-topo"
RUNNER = CliRunner()


def _topkv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from topkv.cli.main import app; app()", *args],
        capture_output=True,
        text=True,
        check=False,
    )


def test_discover_json_keys_and_links() -> None:
    res = RUNNER.invoke(
        _typer_app,
        [
            "discover",
            "--json",
            "--nvidia-smi-topo",
            str(TOPO / "a100-sxm40g-8gpu-epyc7742-nps4-10nic-nv12.txt"),
            "--lscpu",
            str(FIXTURES / "numa" / "a100-sxm40g-8gpu-epyc7742-nps4-lscpu.txt"),
        ],
    )
    assert res.exit_code == 0, res.output
    (node,) = loads_strict(res.output)["nodes"]
    assert {"name", "gpus", "nics", "numa_nodes", "nvlink_domains", "links"} <= set(node)
    assert node["gpus"][0]["index"] == 0 and node["gpus"][0]["numa"] == 3
    assert [n["name"] for n in node["nics"]][:2] == ["mlx5_0", "mlx5_1"]
    assert len(node["numa_nodes"]) == 8
    gg = [lk for lk in node["links"] if lk["b"].startswith("GPU")]
    assert len(gg) == 28 and gg[0]["type"] == "NV12" and gg[0]["transport"] == "nvlink"
    assert len([lk for lk in node["links"] if lk["b"].startswith("mlx5")]) == 80


def test_discover_from_dir_with_rdma_merge(tmp_path: Path) -> None:
    shutil.copy(TOPO / "sglang-30401-h100-8gpu-nv18-8nic.txt", tmp_path / "nvidia-smi-topo.txt")
    shutil.copy(
        FIXTURES / "rdma" / "nccl-tests-128-cx6-hdr-ib-ibstat-partial.txt", tmp_path / "ibstat.txt"
    )
    res = RUNNER.invoke(_typer_app, ["discover", "--from", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    (node,) = loads_strict(res.output)["nodes"]
    mlx0 = node["nics"][0]
    assert mlx0["name"] == "mlx5_0" and mlx0["link_layer"] == "IB"
    assert mlx0["rate_gbps"] == 200.0 and mlx0["state"] == "ACTIVE"
    res = RUNNER.invoke(_typer_app, ["nic-map", "--format", "sglang", "--from", str(tmp_path)])
    assert res.exit_code == 0 and loads_strict(res.output)["1"] == "mlx5_1"


def test_discover_error_output_exits_2_with_one_line() -> None:
    proc = _topkv(
        "discover",
        "--nvidia-smi-topo",
        str(TOPO / "error-wsl-9134-nvidia-smi-failed-driver-not-loaded.txt"),
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no usable NVIDIA driver" in lines[0]


def test_empty_dir_is_a_clear_error(tmp_path: Path) -> None:
    proc = _topkv("discover", "--from", str(tmp_path))
    assert proc.returncode == 2 and "no known tool output files" in proc.stderr


def test_discover_this_machine_is_honest() -> None:
    res = RUNNER.invoke(_typer_app, ["discover", "--json", "--name", "here"])
    assert res.exit_code == 0, res.output
    (node,) = loads_strict(res.output)["nodes"]
    has_gpu = shutil.which("nvidia-smi") is not None
    if not has_gpu:
        assert node["gpus"] == [] and "no GPU found" in node["notes"]
    sysfs_nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    assert len(node["numa_nodes"]) == len(sysfs_nodes)
    if node["numa_nodes"]:
        assert sum(len(n["cpus"]) for n in node["numa_nodes"]) >= 1
    text = RUNNER.invoke(_typer_app, ["discover"])
    assert text.exit_code == 0 and "NUMA" in text.output


def test_local_runner_missing_binary_is_recorded() -> None:
    got = LocalRunner().run(["topkv-no-such-tool-xyz"])
    assert got.status == "not-found" and "not found" in got.source
    echo = LocalRunner().run(["echo", "hi"])
    assert echo.status == "ok" and echo.stdout == "hi\n"


def test_kubectl_runner_builds_exec_command() -> None:
    r = KubectlExecRunner(pod="worker-0", namespace="infer", container="engine")
    assert r.command(["nvidia-smi", "topo", "-m"]) == [
        "kubectl",
        "exec",
        "worker-0",
        "-n",
        "infer",
        "-c",
        "engine",
        "--",
        "nvidia-smi",
        "topo",
        "-m",
    ]
    got = KubectlExecRunner(pod="p", kubectl="kubectl-missing-xyz").run(["ibstat"])
    assert got.status == "not-found"


def test_fixture_runner_names(tmp_path: Path) -> None:
    (tmp_path / "nvlink-status.txt").write_text("x")
    (tmp_path / "nvlink-remote.txt").write_text("y")
    (tmp_path / "lscpu-host7.log").write_text("z")
    fr = FixtureRunner(tmp_path)
    assert fr.run(PROBES["nvlink"].argv).stdout == "x"
    assert fr.run(PROBES["nvlink-remote"].argv).stdout == "y"
    assert fr.run(PROBES["lscpu"].argv).stdout == "z"
    assert fr.run(PROBES["ibstat"].argv).status == "not-found"
    raw = collect(fr, kinds=list(PROBES))
    assert set(raw.texts) == {"nvlink", "nvlink-remote", "lscpu"}


def test_nvml_degrades_without_a_driver() -> None:
    snap, why = probe_nvml()
    if snap is None:
        assert why.startswith("NVML")
        node = discover_local(name="x", use_nvml=True)
        assert any(n.startswith("nvml:") for n in node.notes)
    else:  # a GPU host: NVML must agree on the GPU count with the node built from it
        assert len(discover_local(name="x").gpus) == len(snap.gpus)
