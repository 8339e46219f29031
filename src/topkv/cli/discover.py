"""``topkv discover`` (topology of this machine or of saved tool outputs) and ``topkv nic-map``."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from topkv.cli.console import stdout_console
from topkv.errors import ConfigError
from topkv.jsonout import dumps
from topkv.topology.build import discover_from_dir, discover_from_files, discover_local
from topkv.topology.model import Cluster, Node
from topkv.topology.nicmap import FORMATS, render
from topkv.topology.paths import nearest_nics

# CLI flag -> output kind (keys of topkv.topology.probes.PROBES)
FILE_FLAGS: dict[str, str] = {
    "nvidia_smi_topo": "nvidia-smi-topo",
    "nvlink": "nvlink",
    "nvlink_remote": "nvlink-remote",
    "fabric": "fabric",
    "lspci": "lspci",
    "lspci_vvv": "lspci-vvv",
    "ibstat": "ibstat",
    "ibv_devinfo": "ibv-devinfo",
    "ibstatus": "ibstatus",
    "ibdev2netdev": "ibdev2netdev",
    "rdma_link": "rdma-link",
    "numactl": "numactl",
    "lscpu": "lscpu",
    "rocm_smi": "rocm-smi",
    "k8s_node": "k8s-node",
}


def _file_opt(kind: str) -> Any:
    return typer.Option(None, f"--{kind}", help=f"Saved output of the {kind} probe.")


def _with_probe_file_options(command: Callable[..., None]) -> Callable[..., None]:
    """Give a typer command one ``--<kind>`` Path option per probe kind in :data:`FILE_FLAGS`.

    The command declares ``files: dict[str, Path | None] | None = None`` in place of the
    fifteen options and receives them there, keyed like :data:`FILE_FLAGS`; typer sees
    the options in the wrapper's signature (in :data:`FILE_FLAGS` order, after the
    command's own).
    """
    own = inspect.signature(command, eval_str=True)
    file_options = [
        inspect.Parameter(
            key, inspect.Parameter.KEYWORD_ONLY, default=_file_opt(kind), annotation=Path | None
        )
        for key, kind in FILE_FLAGS.items()
    ]

    @functools.wraps(command)
    def with_files(**options: Any) -> None:
        files = {key: options.pop(key) for key in FILE_FLAGS}
        command(**options, files=files)

    parameters = [p for p in own.parameters.values() if p.name != "files"]
    with_files.__signature__ = own.replace(  # type: ignore[attr-defined]
        parameters=[*parameters, *file_options]
    )
    return with_files


def _node_from_options(
    from_dir: Path | None, name: str | None, gpu_name: str | None, files: dict[str, Path | None]
) -> Node:
    given = {FILE_FLAGS[k]: v for k, v in files.items() if v is not None}
    if from_dir is not None and given:
        raise ConfigError("give either --from DIR or per-kind files, not both")
    if from_dir is not None:
        return discover_from_dir(from_dir, name=name, gpu_name=gpu_name)
    if given:
        return discover_from_files(given, name=name or "node0", gpu_name=gpu_name)
    return discover_local(name=name)


def _summary(node: Node) -> str:
    out = [
        f"node {node.name}: {len(node.gpus)} GPU(s), {len(node.nics)} NIC(s), "
        f"{len(node.numa_nodes)} NUMA node(s)"
    ]
    for n in node.numa_nodes:
        kind = f" cpuless ({n.candidate} candidate)" if n.cpuless else ""
        mem = f", {n.memory_mb} MB" if n.memory_mb is not None else ""
        out.append(f"  NUMA {n.id}: {len(n.cpus)} CPUs{mem}{kind}")
    for g in node.gpus:
        near = ", ".join(x.name for x in nearest_nics(node, g.index)) if node.nics else "-"
        out.append(
            f"  GPU{g.index} {g.name or '(model unknown)'} numa={g.numa} "
            f"domain={g.nvlink_domain or '-'} nearest NIC: {near}"
        )
    for nic in node.nics:
        out.append(
            f"  NIC {nic.name} netdev={nic.netdev or '-'} "
            f"{nic.link_layer or '-'} {nic.rate_gbps or '-'} Gb/s {nic.state or ''}".rstrip()
        )
    for d in node.nvlink_domains:
        out.append(f"  NVLink domain {d.id} ({d.kind}): {len(d.members)} GPUs")
    kinds: dict[str, int] = {}
    for lk in node.links:
        kinds[lk.type] = kinds.get(lk.type, 0) + 1
    if kinds:
        out.append("  links: " + ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items())))
    for note in node.notes:
        out.append(f"  note: {note}")
    return "\n".join(out)


def register(app: typer.Typer) -> None:
    @app.command("discover")
    @_with_probe_file_options
    def discover_command(
        from_dir: Path | None = typer.Option(
            None, "--from", help="Directory of saved tool outputs (see docs/topology.md)."
        ),
        name: str | None = typer.Option(None, "--name", help="Node name."),
        gpu_name: str | None = typer.Option(
            None, "--gpu-name", help="GPU model when the outputs do not name it (H100, B200)."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the topology as JSON."),
        files: dict[str, Path | None] | None = None,
    ) -> None:
        """Discover a node's topology: GPUs, NICs, NUMA, links and NVLink domains."""
        node = _node_from_options(from_dir, name, gpu_name, files or {})
        if as_json:
            typer.echo(dumps(Cluster(nodes=[node]).model_dump(mode="json"), indent=2))
        else:
            stdout_console(soft_wrap=True).print(_summary(node), markup=False, highlight=False)

    @app.command("nic-map")
    @_with_probe_file_options
    def nic_map_command(
        fmt: str = typer.Option(..., "--format", help="ucx | nccl | mooncake | sglang"),
        from_dir: Path | None = typer.Option(None, "--from", help="Directory of saved outputs."),
        name: str | None = typer.Option(None, "--name", help="Node name."),
        files: dict[str, Path | None] | None = None,
    ) -> None:
        """Print each GPU's nearest NIC(s) in UCX, NCCL, Mooncake or SGLang format."""
        if fmt not in FORMATS:
            raise ConfigError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
        node = _node_from_options(from_dir, name, None, files or {})
        typer.echo(render(node, fmt))
