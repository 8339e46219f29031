"""Probes: run the discovery tools (locally, in a pod, or from saved files) and NVML.

A probe never crashes on a missing tool: the result records ``status="not-found"`` and the
builder notes it. :data:`PROBES` is the table of tool kinds; each kind has one command line
and one canonical fixture file name (see docs/topology.md, "Fixture directories").
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

from topkv.inputs import InputFileError, read_text
from topkv.topology.detect.nvidia_smi import FabricInfo, NvlinkLink, normalise_bus_id

Status = Literal["ok", "not-found", "failed", "timeout"]

#: Largest saved tool output read (``lspci -vvv`` of a big server is a few MiB).
MAX_PROBE_BYTES = 64 << 20
#: Longest line (characters) of a saved tool output: tool lines are short, a jsonpath
#: label map is a few KiB; the parsers stay fast (linear) below this.
MAX_PROBE_LINE = 64 << 10


@dataclass(frozen=True)
class ProbeSpec:
    """One kind of tool output: the command that produces it and its fixture file names."""

    kind: str
    argv: tuple[str, ...]
    files: tuple[str, ...]
    local: bool = True  # run by plain local discovery


PROBES: dict[str, ProbeSpec] = {
    p.kind: p
    for p in [
        ProbeSpec("nvidia-smi-topo", ("nvidia-smi", "topo", "-m"), ("nvidia-smi-topo.txt",)),
        ProbeSpec("nvlink", ("nvidia-smi", "nvlink", "--status"), ("nvlink-status.txt",)),
        ProbeSpec("nvlink-remote", ("nvidia-smi", "nvlink", "-R"), ("nvlink-remote.txt",)),
        ProbeSpec("fabric", ("nvidia-smi", "-q"), ("nvidia-smi-q.txt", "fabric.txt")),
        ProbeSpec("lspci", ("lspci", "-tv"), ("lspci-tv.txt", "lspci-t.txt")),
        ProbeSpec("lspci-vvv", ("lspci", "-vvv"), ("lspci-vvv.txt",), local=False),
        ProbeSpec("ibstat", ("ibstat",), ("ibstat.txt",)),
        ProbeSpec("ibv-devinfo", ("ibv_devinfo",), ("ibv_devinfo.txt", "ibv-devinfo.txt")),
        ProbeSpec("ibstatus", ("ibstatus",), ("ibstatus.txt",)),
        ProbeSpec("ibdev2netdev", ("ibdev2netdev",), ("ibdev2netdev.txt",)),
        ProbeSpec("rdma-link", ("rdma", "link", "show"), ("rdma-link.txt",)),
        ProbeSpec("numactl", ("numactl", "-H"), ("numactl-H.txt", "numactl.txt")),
        ProbeSpec("lscpu", ("lscpu",), ("lscpu.txt",)),
        ProbeSpec("rocm-smi", ("rocm-smi", "--showtopo"), ("rocm-smi-showtopo.txt",)),
        ProbeSpec(
            "k8s-node",
            ("kubectl", "get", "node", "-o", "yaml"),
            ("k8s-node.yaml", "k8s-node.json", "k8s-node.txt"),
            local=False,
        ),
    ]
}


@dataclass(frozen=True)
class CommandResult:
    """What running (or looking up) one command produced."""

    argv: tuple[str, ...]
    status: Status
    stdout: str = ""
    stderr: str = ""
    returncode: int | None = None
    source: str = ""

    @property
    def text(self) -> str:
        """stdout, or stderr when the tool wrote its failure there (nvidia-smi does both)."""
        return self.stdout if self.stdout.strip() else self.stderr


class CommandRunner(Protocol):
    """Runs one discovery command and returns its output; never raises for a missing tool."""

    def run(self, argv: Sequence[str], timeout_s: float = 15.0) -> CommandResult: ...


class LocalRunner:
    """Runs commands on this machine with a timeout."""

    def run(self, argv: Sequence[str], timeout_s: float = 15.0) -> CommandResult:
        args = tuple(argv)
        if shutil.which(args[0]) is None:
            return CommandResult(args, "not-found", source=f"local: {args[0]} not found in PATH")
        try:
            proc = subprocess.run(
                args, capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired:
            return CommandResult(args, "timeout", source=f"local: timed out after {timeout_s}s")
        except OSError as exc:
            return CommandResult(args, "not-found", source=f"local: {exc}")
        status: Status = "ok" if proc.returncode == 0 else "failed"
        return CommandResult(
            args, status, proc.stdout, proc.stderr, proc.returncode, f"local: {' '.join(args)}"
        )


@dataclass
class KubectlExecRunner:
    """Runs commands inside a pod with ``kubectl exec POD [-n NS] [-c C] -- cmd``."""

    pod: str
    namespace: str | None = None
    container: str | None = None
    kubectl: str = "kubectl"
    inner: CommandRunner = field(default_factory=LocalRunner)

    def command(self, argv: Sequence[str]) -> list[str]:
        cmd = [self.kubectl, "exec", self.pod]
        if self.namespace:
            cmd += ["-n", self.namespace]
        if self.container:
            cmd += ["-c", self.container]
        return [*cmd, "--", *argv]

    def run(self, argv: Sequence[str], timeout_s: float = 15.0) -> CommandResult:
        got = self.inner.run(self.command(argv), timeout_s)
        # kubectl exec returns 126/127 when the tool is missing inside the container.
        status: Status = got.status
        if got.returncode in (126, 127) or "executable file not found" in got.stderr:
            status = "not-found"
        return CommandResult(
            tuple(argv), status, got.stdout, got.stderr, got.returncode, f"pod {self.pod}"
        )


class FixtureRunner:
    """Answers commands from a directory of saved outputs.

    The file for a command is the first of its kind's names in :data:`PROBES` that exists
    (``nvidia-smi-topo.txt`` for ``nvidia-smi topo -m`` ...), else any file whose name
    starts with the kind (``nvidia-smi-topo-node3.log``).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def file_for(self, kind: str) -> Path | None:
        spec = PROBES[kind]
        for name in spec.files:
            path = self.directory / name
            if path.is_file():
                return path
        candidates = sorted(p for p in self.directory.glob(f"{kind}*") if p.is_file())
        # "nvlink*" must not pick "nvlink-remote.txt"; longer kinds are checked first by name.
        longer = [k for k in PROBES if k != kind and k.startswith(kind)]
        candidates = [p for p in candidates if not any(p.name.startswith(k) for k in longer)]
        return candidates[0] if candidates else None

    def run(self, argv: Sequence[str], timeout_s: float = 15.0) -> CommandResult:
        args = tuple(argv)
        kind = next((k for k, s in PROBES.items() if s.argv == args), None)
        path = self.file_for(kind) if kind is not None else None
        if path is None or kind is None:
            return CommandResult(args, "not-found", source=f"no fixture in {self.directory}")
        return CommandResult(args, "ok", read_probe_output(path, kind), "", 0, str(path))


def read_probe_output(path: Path, kind: str) -> str:
    """A saved tool output: strict UTF-8 text without NUL bytes, not empty, at most
    :data:`MAX_PROBE_BYTES` in lines of at most :data:`MAX_PROBE_LINE` characters; raises
    :class:`topkv.inputs.InputFileError` naming the file."""
    what = f"the saved output of `{' '.join(PROBES[kind].argv)}`"
    text = read_text(path, what=what, limit=MAX_PROBE_BYTES)
    longest = max(map(len, text.splitlines()), default=0)
    if longest > MAX_PROBE_LINE:
        number = next(i for i, line in enumerate(text.splitlines(), 1) if len(line) == longest)
        raise InputFileError(
            path, f"line of {longest:,} characters, longer than any line of {what}", number
        )
    return text


# --------------------------------------------------------------------------- NVML


@dataclass
class NvmlGpu:
    """One GPU as NVML reports it."""

    index: int
    name: str
    bus_id: str
    uuid: str | None
    memory_mb: int | None
    numa: int | None
    nvlinks: list[NvlinkLink]
    nvlink_version: int | None
    fabric: FabricInfo | None


@dataclass
class NvmlSnapshot:
    """Everything topology needs from NVML; ``pcie`` maps (i, j) to PIX/PXB/PHB/NODE/SYS."""

    driver_version: str | None
    gpus: list[NvmlGpu]
    pcie: dict[tuple[int, int], str]


# nvmlGpuTopologyLevel_t -> nvidia-smi's path names
NVML_TOPOLOGY_LEVEL: dict[int, str] = {
    0: "PIX",
    10: "PIX",
    20: "PXB",
    30: "PHB",
    40: "NODE",
    50: "SYS",
}


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def probe_nvml() -> tuple[NvmlSnapshot | None, str]:
    """Read GPUs, NVLinks and fabric state through NVML; ``(None, reason)`` when unusable."""
    try:
        import pynvml
    except ImportError:
        return None, "NVML: nvidia-ml-py (pynvml) is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError subclasses per failure; all mean "no NVML here"
        return None, f"NVML: {exc}"
    try:
        return _read_nvml(pynvml), "NVML"
    except Exception as exc:
        return None, f"NVML: query failed: {exc}"
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


T = TypeVar("T")


def _optional(query: Callable[[], T]) -> T | None:
    """An NVML query that a driver, GPU or link may not support: None when it raises."""
    try:
        return query()
    except Exception:
        return None


def _fabric(nv: Any, handle: Any, bus_id: str) -> FabricInfo:
    info = nv.nvmlDeviceGetGpuFabricInfo(handle)
    uuid_hex = bytes(info.clusterUuid).hex()
    cluster = "-".join(uuid_hex[a:b] for a, b in ((0, 8), (8, 12), (12, 16), (16, 20), (20, 32)))
    return FabricInfo(
        bus_id=bus_id,
        state="Completed" if info.state == 3 else str(info.state),
        status="Success" if info.status == 0 else f"error {info.status}",
        clique_id=str(info.cliqueId),
        cluster_uuid=cluster,
    )


def _read_links(nv: Any, handle: Any) -> tuple[list[NvlinkLink], int | None]:
    """A GPU's NVLinks (up to the first one NVML cannot query) and their version."""
    links: list[NvlinkLink] = []
    version: int | None = None
    for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            active = nv.nvmlDeviceGetNvLinkState(handle, link) == nv.NVML_FEATURE_ENABLED
        except Exception:
            break
        remote = None
        if active:
            try:
                remote = normalise_bus_id(
                    _s(nv.nvmlDeviceGetNvLinkRemotePciInfo_v2(handle, link).busId)
                )
            except Exception:
                remote = None
            if version is None:
                try:
                    version = int(nv.nvmlDeviceGetNvLinkVersion(handle, link))
                except Exception:
                    version = None
        links.append(NvlinkLink(link=link, active=active, remote_bus_id=remote))
    return links, version


def _read_gpu(nv: Any, index: int, handle: Any) -> NvmlGpu:
    links, version = _read_links(nv, handle)
    bus_id = normalise_bus_id(_s(nv.nvmlDeviceGetPciInfo(handle).busId))
    return NvmlGpu(
        index=index,
        name=_s(nv.nvmlDeviceGetName(handle)),
        bus_id=bus_id,
        uuid=_optional(lambda: _s(nv.nvmlDeviceGetUUID(handle))),
        memory_mb=_optional(lambda: int(nv.nvmlDeviceGetMemoryInfo(handle).total) // 2**20),
        numa=_optional(lambda: int(nv.nvmlDeviceGetNumaNodeId(handle))),
        nvlinks=links,
        nvlink_version=version,
        fabric=_optional(lambda: _fabric(nv, handle, bus_id)),
    )


def _read_nvml(nv: Any) -> NvmlSnapshot:
    count = nv.nvmlDeviceGetCount()
    handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    gpus = [_read_gpu(nv, i, h) for i, h in enumerate(handles)]
    pcie: dict[tuple[int, int], str] = {}
    for i in range(count):
        for j in range(i + 1, count):
            try:
                level = int(nv.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j]))
            except Exception:
                continue
            pcie[(i, j)] = NVML_TOPOLOGY_LEVEL.get(level, "SYS")
    driver = _optional(lambda: _s(nv.nvmlSystemGetDriverVersion()))
    return NvmlSnapshot(driver_version=driver, gpus=gpus, pcie=pcie)
