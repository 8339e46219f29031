"""``topkv select``: every candidate path between two GPUs, its estimate, and the choice."""

from __future__ import annotations

import re
from decimal import Decimal
from pathlib import Path

import typer
from rich.table import Table

from topkv.cli.console import stdout_console
from topkv.errors import ConfigError, TopKVError
from topkv.inputs import read_text
from topkv.jsonout import dumps
from topkv.policy import Endpoint, LinkLoad, Selection, TransferRequest, policy_from_name
from topkv.policy.adapters import cluster_from_json, pair_view_from_cluster
from topkv.policy.view import NO_LOAD

_SIZE_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)", re.ASCII)
_UNITS: dict[str, int] = {"": 1, "b": 1}
for _power, _prefix in enumerate("kmgtpe", start=1):
    _UNITS[f"{_prefix}b"] = 1000**_power
    _UNITS[f"{_prefix}ib"] = 1024**_power


def parse_byte_size(text: str) -> int:
    """``1340000000``, ``1.34GB`` (decimal, powers of 1000), ``256MiB`` (binary) -> bytes.

    Exact (decimal arithmetic, no float rounding); a fractional byte count rounds down.
    """
    match = _SIZE_RE.fullmatch(text.strip().lower())
    if match is None or match.group(2) not in _UNITS:
        raise ConfigError(
            f"size {text!r} is not a byte count; use e.g. 1340000000, 1.34GB or 256MiB"
        )
    return int(Decimal(match.group(1)) * _UNITS[match.group(2)])


def parse_in_flight(specs: list[str]) -> LinkLoad:
    """``LINK=SIZE`` items (each one flow of SIZE bytes on LINK) -> a load snapshot."""
    load = NO_LOAD
    for spec in specs:
        link, sep, size = spec.rpartition("=")
        if not sep or not link:
            raise ConfigError(f"--in-flight {spec!r} is not LINK=SIZE (e.g. node0:mlx5_0=4GB)")
        load = load.with_flow([link], parse_byte_size(size))
    return load


def _read_topology(path: Path) -> str:
    return read_text(path, what="a topology file (topkv discover --json)")


def select_command(
    topology: Path = typer.Option(
        ..., "--topology", "-t", help="Topology JSON (topkv discover --json)."
    ),
    src: str = typer.Option(..., "--src", help="Source GPU as NODE:GPU."),
    dst: str = typer.Option(..., "--dst", help="Destination GPU as NODE:GPU."),
    size: str = typer.Option(
        ..., "--bytes", "-b", help="Bytes to move: 1340000000, 1.34GB, 256MiB."
    ),
    policy: str = typer.Option(
        "cost", "--policy", "-p", help="cost, paper or uniform-<transport>."
    ),
    chunks: int = typer.Option(1, "--chunks", min=1, help="Pieces the transfer is sent in."),
    override: str | None = typer.Option(None, "--override", help="Force a transport."),
    in_flight: list[str] = typer.Option(
        [], "--in-flight", help="LINK=SIZE already in flight on a shared link (repeatable)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Show every candidate path with its estimated time, and the policy's choice."""
    request = TransferRequest(parse_byte_size(size), chunks, override)
    selector = policy_from_name(policy)
    load = parse_in_flight(in_flight)
    ends = Endpoint.parse(src), Endpoint.parse(dst)
    cluster = cluster_from_json(_read_topology(topology), str(topology))
    try:
        pair = pair_view_from_cluster(cluster, *ends)
    except TopKVError as exc:  # a GPU or path the file lacks: name the file
        raise ConfigError(f"{topology}: {exc}") from None
    selection = selector.select(pair, request, load)
    if as_json:
        out = {"src": str(pair.src), "dst": str(pair.dst), "bytes": request.nbytes}
        out |= {"chunks": chunks, **selection.to_dict()}
        typer.echo(dumps(out))
        return
    _print(selection, pair.src, pair.dst, request)


def _print(selection: Selection, src: Endpoint, dst: Endpoint, request: TransferRequest) -> None:
    table = Table(
        title=f"{src} -> {dst}: {request.nbytes:,} bytes in {request.chunks} chunk(s), "
        f"policy {selection.policy}",
        caption="estimate = chunks x setup + (bytes + bytes queued on the busiest link) / "
        "bandwidth; nominal figures unless measured",
    )
    for column in ("", "transport", "links", "GB/s", "source", "estimate", "how"):
        table.add_column(column)
    chosen = selection.chosen
    for c in selection.candidates:
        table.add_row(
            "*" if c is chosen else "",
            c.transport,
            ", ".join(c.links),
            f"{c.bandwidth_gbps:.4g}",
            c.source,
            f"{c.estimated_s * 1e3:.4g} ms",
            c.reason,
        )
    console = stdout_console()
    console.print(table)
    fallbacks = ", ".join(selection.fallbacks) or "none"
    console.print(f"choice: {selection.choice} ({selection.rationale}); fallbacks: {fallbacks}")


def register(app: typer.Typer) -> None:
    """Add ``select`` to the ``topkv`` app."""
    app.command("select")(select_command)
