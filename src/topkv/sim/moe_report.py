"""``topkv sim --moe-router``: which routers run, their JSON documents and their table."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.table import Table

from topkv.errors import ConfigError
from topkv.policy.moe.router import STRATEGIES
from topkv.sim.moe import BASELINE, MoESimOptions, run_moe_routers
from topkv.sim.runner import SimConfig
from topkv.traces import Workload


def moe_router_names(value: str | None, stragglers: int) -> list[str]:
    """The strategies ``--moe-router`` names (``all``: the four); [] without the flag."""
    if stragglers < 0:
        raise ConfigError(f"--stragglers {stragglers} must be >= 0")
    if value is None:
        if stragglers:
            raise ConfigError("--stragglers needs --moe-router")
        return []
    if value == "all":
        return list(STRATEGIES)
    if value not in STRATEGIES:
        raise ConfigError(f"--moe-router {value!r}: use {', '.join(STRATEGIES)} or all")
    return [value]


def moe_documents(
    config: SimConfig,
    workload: Workload,
    policy: str,
    routers: Sequence[str],
    options: MoESimOptions,
    progress: Callable[[str], Callable[[int], None] | None],
) -> dict[str, object]:
    """``moe_routers`` (each named router) and ``moe_baseline`` (EPLB-style static
    placement with plain least-loaded routing), under the transport policy ``policy``
    (``all``: the cost policy, the default)."""
    transport = "cost" if policy == "all" else policy
    named = run_moe_routers(config, workload, transport, routers, options, progress)
    baseline = run_moe_routers(config, workload, transport, [BASELINE], options, progress)
    return {
        "moe_routers": named,
        "moe_baseline": baseline,
        "moe_stragglers": options.stragglers,
        "moe_transport_policy": transport,
    }


def moe_table(docs: dict[str, object]) -> Table:
    """The routers side by side (figures are simulated)."""
    table = Table(title="MoE routers (simulated)")
    columns = ("router", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "goodput", "dispatch")
    for col in columns:
        table.add_column(col, justify="left" if col == "router" else "right")
    for key in ("moe_routers", "moe_baseline"):
        entries = docs.get(key)
        assert isinstance(entries, dict)
        for name, e in entries.items():
            dispatch = e["dispatch_bytes"]
            table.add_row(
                name,
                *(_ms(e[k]) for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")),
                f"{e['goodput_rps']:.2f} rps",
                " ".join(f"{k}:{v / 1e9:.1f}GB" for k, v in dispatch.items()),
            )
    return table


def _ms(value: object) -> str:
    return f"{value:.1f} ms" if isinstance(value, float) else "-"
