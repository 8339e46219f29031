"""``topkv bench transfer``: move a KV cache between two real processes and report GB/s."""

from __future__ import annotations

import typer

from topkv.errors import ConfigError
from topkv.jsonout import dumps

_UNITS = {
    "": 1,
    "B": 1,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
}


def parse_size(text: str) -> int:
    """``256MiB`` / ``1GiB`` / ``1000000`` -> bytes."""
    stripped = text.strip().upper()
    number = stripped.rstrip("KMGIB")
    unit = stripped[len(number) :]
    if not number or unit not in _UNITS:
        raise ConfigError(f"bad size {text!r}: use e.g. 256MiB, 1GiB or a byte count")
    try:
        value = float(number)
    except ValueError:
        raise ConfigError(f"bad size {text!r}: use e.g. 256MiB, 1GiB or a byte count") from None
    return int(value * _UNITS[unit])


def register(app: typer.Typer) -> None:
    bench = typer.Typer(help="Benchmarks that move real bytes.", no_args_is_help=True)
    app.add_typer(bench, name="bench")

    @bench.command("transfer")
    def transfer(
        transport: str = typer.Option(
            "tcp",
            help="shm | tcp | emulated-<mode> (e.g. emulated-rdma) | nixl | mooncake | cuda",
        ),
        size: str = typer.Option("256MiB", help="KV bytes per transfer (e.g. 256MiB)"),
        repeat: int = typer.Option(5, min=1, help="timed repeats (median is reported)"),
        streams: int = typer.Option(1, min=1, help="parallel TCP streams per transfer"),
        crc_overhead: bool = typer.Option(
            False, "--crc-overhead", help="also run without CRC and report the overhead"
        ),
        as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    ) -> None:
        """Send a KV cache from this process to a spawned receiver; compare to the limit."""
        from topkv.harness.arena_bench import run_arena_benchmark
        from topkv.harness.transfer_bench import (
            BenchConfig,
            crc_overhead_report,
            run_transfer_benchmark,
        )
        from topkv.transport.arena.factory import ARENA_TRANSPORTS

        if transport in ARENA_TRANSPORTS:
            report = run_arena_benchmark(transport, parse_size(size), repeat)
        else:
            config = BenchConfig(transport, parse_size(size), repeat, streams=streams)
            report = crc_overhead_report(config) if crc_overhead else run_transfer_benchmark(config)
        if as_json:
            typer.echo(dumps(report))
            return
        for key, value in report.items():
            typer.echo(f"{key:>18}: {value}")
