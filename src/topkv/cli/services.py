"""``topkv orchestrator``, ``topkv worker``, ``topkv cluster up`` and ``topkv status``."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from topkv.cli.console import stdout_console
from topkv.cli.options.auth import (
    client_token,
    insecure_option,
    orchestrator_auth,
    token_file_option,
    worker_auth,
)
from topkv.cli.options.leader import (
    advertise_url_option,
    leader_elect_config,
    leader_elect_option,
    lease_seconds_option,
)
from topkv.cli.options.security import (
    ETCD_FLAGS,
    apply_etcd_env,
    check_etcd_env,
    client_tls,
    etcd_flags,
    server_tls,
    tls_ca_option,
    tls_cert_option,
    tls_key_option,
    with_etcd_flags,
)
from topkv.cli.options.tiers import (
    device_kv_capacity_option,
    device_tier_option,
    kv_cxl_bytes_option,
    kv_cxl_dilation_option,
    kv_cxl_option,
    kv_device_bytes_option,
    kv_disk_bytes_option,
    kv_host_bytes_option,
    kv_tier_dir_option,
    tier_config,
)
from topkv.errors import ConfigError
from topkv.jsonout import dumps
from topkv.policy.adp.pool import ADPConfig
from topkv.relay.orchestrator_config import OrchestratorConfig, RetryPolicy
from topkv.relay.workers import WorkerCapabilities
from topkv.service.errors import ServiceError
from topkv.service.http.auth import CONTROL_TOKEN_FILE_ENV, TOKEN_FILE_ENV
from topkv.service.orchestrator.client import OrchestratorClient

if TYPE_CHECKING:
    from topkv.service.compute.engines import EngineSpec

DEFAULT_PORT = 8470
ORCHESTRATOR_ENV = "TOPKV_ORCHESTRATOR"
ENGINE_HELP = (
    "synthetic (deterministic KV of any layout) | hf (a transformers model: --model-path "
    "DIR or --demo-model SEED; needs the model extra)"
)
MEDIA_HELP = (
    "media to offer, from tcp,shm,nixl,mooncake,cuda (default: every one installed here; "
    "nixl/mooncake: scripts/install-peers.sh)"
)


def _engine_spec(
    engine: str, model_path: Path | None, demo_model: int | None, torch_threads: int
) -> EngineSpec:
    from topkv.service.compute.engines import EngineSpec

    if engine not in ("synthetic", "hf"):
        raise ConfigError(f"--engine must be synthetic or hf, not {engine!r}")
    return EngineSpec(
        kind="hf" if engine == "hf" else "synthetic",
        model_path=model_path,
        demo_seed=demo_model,
        torch_threads=torch_threads,
    )


def _logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )


async def _until_signalled(main: object) -> None:
    """Run ``main(stop)`` until SIGINT/SIGTERM sets ``stop``."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await main(stop)  # type: ignore[operator]


def _adp_config(value: str) -> ADPConfig | None:
    if value not in ("on", "off"):
        raise ConfigError(f"--adp must be on or off, not {value!r}")
    return ADPConfig() if value == "on" else None


@with_etcd_flags
def orchestrator_command(
    host: str = typer.Option("127.0.0.1", help="address to listen on"),
    port: int = typer.Option(DEFAULT_PORT, help="HTTP port (0 picks a free one)"),
    registry: str = typer.Option("memory", help="memory | etcd://HOST:PORT"),
    topology: Path | None = typer.Option(None, help="topology JSON from `topkv discover --json`"),
    max_in_flight: int = typer.Option(100, help="concurrent transfers"),
    queue_size: int = typer.Option(1000, help="bounded submission queue"),
    attempt_timeout: float = typer.Option(30.0, help="seconds per transfer attempt"),
    retries: int = typer.Option(2, help="retries of one path after checksum failure/timeout"),
    backoff: float = typer.Option(0.1, help="first retry backoff in seconds (doubles)"),
    ready_file: Path | None = typer.Option(None, help="write {url, pid} here once serving"),
    log_level: str = typer.Option("warning", help="debug | info | warning | error"),
    token_file: Path | None = token_file_option(
        f"the admin token: accepted with admin scope and sent to the workers (default: "
        f"${TOKEN_FILE_ENV})"
    ),
    worker_token_file: Path | None = typer.Option(
        None, help="worker tokens accepted with worker scope, one per line"
    ),
    protect_metrics: bool = typer.Option(False, help="/metrics needs an admin token"),
    max_body_bytes: int = typer.Option(
        1 << 20, min=1024, help="largest request body read (413 beyond it)"
    ),
    insecure_no_auth: bool = insecure_option(),
    tls_cert: Path | None = tls_cert_option(),
    tls_key: Path | None = tls_key_option(),
    tls_ca: Path | None = tls_ca_option(
        "the CA that https:// workers' certificates are verified with (default: the system's)"
    ),
    etcd: Mapping[str, str] = ETCD_FLAGS,
    leader_elect: str | None = leader_elect_option(),
    lease_seconds: float = lease_seconds_option(),
    advertise_url: str | None = advertise_url_option(),
    adp: str = typer.Option(
        "off",
        help="on: the live Adaptive Decoder Pool converts decode workers in a rush "
        "(docs/adp.md; GET /v1/adp)",
    ),
) -> None:
    """Run the orchestrator: HTTP API, registry, relay, /metrics."""
    from topkv.service.http.util import write_ready_file
    from topkv.service.orchestrator.api import OrchestratorServiceConfig, serve_orchestrator

    _logging(log_level)
    apply_etcd_env(registry, etcd)
    auth = orchestrator_auth(
        token_file,
        worker_token_file,
        insecure=insecure_no_auth,
        protect_metrics=protect_metrics,
    )
    config = OrchestratorServiceConfig(
        auth=auth,
        max_body_bytes=max_body_bytes,
        registry=registry,
        topology_file=topology,
        tls=server_tls(tls_cert, tls_key, tls_ca),
        relay=OrchestratorConfig(
            max_in_flight=max_in_flight,
            queue_size=queue_size,
            attempt_timeout_s=attempt_timeout,
            retry=RetryPolicy(max_retries=retries, backoff_s=backoff),
        ),
        leader_elect=leader_elect_config(leader_elect, lease_seconds, advertise_url),
        adp=_adp_config(adp),
    )

    async def main(stop: asyncio.Event) -> None:
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def announce() -> None:
            url = await ready
            if ready_file is not None:
                write_ready_file(ready_file, {"url": url, "pid": os.getpid()})
            typer.echo(f"topkv orchestrator on {url} (registry {registry})", err=True)

        announcer = asyncio.create_task(announce())
        try:
            await serve_orchestrator(config, host, port, stop, ready)
        finally:
            announcer.cancel()

    asyncio.run(_until_signalled(main))


@with_etcd_flags
def worker_command(
    role: str = typer.Option(..., help="prefill | decode"),
    node: str = typer.Option("", help="node name (default: this host's name)"),
    gpu: list[int] = typer.Option([0], help="GPU index (repeat for several)"),
    orchestrator: str = typer.Option("", help="orchestrator URL (embedded registry)"),
    registry: str = typer.Option("", help="etcd://HOST:PORT to register in etcd directly"),
    host: str = typer.Option("127.0.0.1", help="address the endpoints listen on"),
    advertise_host: str = typer.Option("", help="address peers use (default: --host)"),
    port: int = typer.Option(0, help="control API port (0 picks a free one)"),
    worker_id: str = typer.Option("", help="default: ROLE-NODE-gpuI"),
    host_id: str = typer.Option("", help="OS host identity; equal ids may use shm"),
    capacity: int = typer.Option(8, help="KV caches held at once"),
    device_kv_capacity: int = device_kv_capacity_option(),
    kv_host_bytes: str = kv_host_bytes_option(),
    kv_cxl_bytes: str = kv_cxl_bytes_option(),
    kv_cxl: str = kv_cxl_option(),
    kv_cxl_dilation: float = kv_cxl_dilation_option(),
    kv_disk_bytes: str = kv_disk_bytes_option(),
    kv_tier_dir: Path | None = kv_tier_dir_option(),
    device_tier: str = device_tier_option(),
    kv_device_bytes: str = kv_device_bytes_option(),
    ttl: float = typer.Option(10.0, help="registry lease seconds (heartbeat every ttl/3)"),
    nvlink_domain: str = typer.Option("", help="NVLink domain id, if any"),
    nvlink: bool = typer.Option(False, help="advertise NVLink"),
    rdma: bool = typer.Option(False, help="advertise RDMA"),
    shm: bool = typer.Option(True, help="serve a shared-memory sink"),
    secret_file: Path | None = typer.Option(
        None, help="transport secret file (else $TOPKV_SECRET)"
    ),
    ready_file: Path | None = typer.Option(None, help="write endpoints here once registered"),
    log_level: str = typer.Option("warning", help="debug | info | warning | error"),
    faults: str = typer.Option(
        "",
        help="fault injection for chaos tests, e.g. corrupt_rate=0.05,seed=3,slow_gbps=1.0 "
        "(default: $TOPKV_FAULTS, else none)",
    ),
    engine: str = typer.Option("synthetic", help=ENGINE_HELP),
    model_path: Path | None = typer.Option(None, help="--engine hf: a local HF model directory"),
    demo_model: int | None = typer.Option(None, help="--engine hf: the seeded demo model"),
    demo_moe_experts: int = typer.Option(
        0,
        help="--demo-model: N >= 2 makes it the Mixtral-style MoE demo with N experts (top-2); "
        "the worker then reports expert statistics (docs/moe.md)",
    ),
    torch_threads: int = typer.Option(0, help="--engine hf: torch threads (0: torch's default)"),
    compute_pace: float | None = typer.Option(
        None,
        help="--engine hf, --torch-threads 1: hold every engine turn until C x its CPU time "
        "passed, so the worker computes as its own device (emulation; docs/demo.md)",
        show_default=False,
    ),
    media: str = typer.Option("", help=MEDIA_HELP),
    token_file: Path | None = token_file_option(
        f"this worker's worker token, to register with the orchestrator (default: "
        f"${TOKEN_FILE_ENV})"
    ),
    control_token_file: Path | None = typer.Option(
        None,
        help="the token its control API accepts: the orchestrator's admin token or its "
        f"sha256: digest (default: ${CONTROL_TOKEN_FILE_ENV})",
    ),
    insecure_no_auth: bool = insecure_option(),
    tls_cert: Path | None = tls_cert_option(),
    tls_key: Path | None = tls_key_option(),
    tls_ca: Path | None = tls_ca_option(
        "the CA that an https:// --orchestrator's certificate is verified with (default: the "
        "system's)"
    ),
    etcd: Mapping[str, str] = ETCD_FLAGS,
) -> None:
    """Run a worker: an engine, transfer endpoints (every medium offered), KV buffers,
    control API, heartbeat."""
    from topkv.service.worker.media import parse_media, resolve_media
    from topkv.service.worker.service import SECRET_ENV, WorkerConfig, WorkerFaults, serve_worker

    _logging(log_level)
    if role not in ("prefill", "decode"):
        raise ConfigError(f"--role must be prefill or decode, not {role!r}")
    apply_etcd_env(registry, etcd)
    engine_spec = _engine_spec(engine, model_path, demo_model, torch_threads)
    if demo_moe_experts:
        engine_spec = dataclasses.replace(engine_spec, demo_experts=demo_moe_experts)
    if compute_pace is not None:
        engine_spec = dataclasses.replace(engine_spec, compute_pace=compute_pace)
    offered = parse_media(media)
    resolve_media(offered, shm=shm)  # exits 2 naming a medium this host lacks
    if secret_file is not None:
        try:
            secret = secret_file.read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read --secret-file {secret_file}: {exc.strerror}") from None
    else:
        secret = os.environ.get(SECRET_ENV, "").encode()
    if not secret:
        raise ConfigError(
            f"a worker needs the cluster's transport secret: set {SECRET_ENV} or give "
            "--secret-file (topkv cluster up does this for its workers)"
        )
    config = WorkerConfig(
        role="prefill" if role == "prefill" else "decode",
        node=node or socket.gethostname(),
        secret=secret,
        gpus=tuple(gpu),
        worker_id=worker_id,
        host_id=host_id,
        orchestrator_url=orchestrator,
        registry_url=registry,
        bind_host=host,
        advertise_host=advertise_host,
        control_port=port,
        capacity=capacity,
        ttl_s=ttl,
        nvlink_domain=nvlink_domain or None,
        capabilities=WorkerCapabilities(nvlink=nvlink, rdma=rdma, shm=shm),
        ready_file=ready_file,
        faults=WorkerFaults.parse(faults) if faults else WorkerFaults.from_env(),
        engine=engine_spec,
        media=offered,
        auth=worker_auth(
            token_file,
            control_token_file,
            insecure=insecure_no_auth,
            needs_token=not registry,
        ),
        tls=server_tls(tls_cert, tls_key, tls_ca),
        tiers=tier_config(
            device_kv_capacity,
            kv_host_bytes,
            kv_cxl_bytes,
            kv_cxl,
            kv_cxl_dilation,
            kv_disk_bytes,
            kv_tier_dir,
            device_tier,
            kv_device_bytes,
        ),
    )

    async def main(stop: asyncio.Event) -> None:
        await serve_worker(config, stop)

    asyncio.run(_until_signalled(main))


@with_etcd_flags
def cluster_up_command(
    prefill: int = typer.Option(1, help="prefill workers"),
    decode: int = typer.Option(1, help="decode workers"),
    registry: str = typer.Option("memory", help="memory | etcd://HOST:PORT"),
    topology: Path | None = typer.Option(None, help="topology JSON for the orchestrator"),
    host: str = typer.Option("127.0.0.1", help="orchestrator address"),
    port: int = typer.Option(DEFAULT_PORT, help="orchestrator port (0 picks a free one)"),
    ttl: float = typer.Option(5.0, help="worker lease seconds"),
    capacity: int = typer.Option(8, help="KV caches each worker holds at once"),
    smoke: int = typer.Option(0, help="submit K transfers, print the results and exit"),
    smoke_layers: int = typer.Option(4, help="smoke KV: layers"),
    smoke_tokens: int = typer.Option(256, help="smoke KV: tokens"),
    json_output: bool = typer.Option(False, "--json", help="machine-readable output"),
    run_dir: Path | None = typer.Option(None, help="logs and ready files (default: temp dir)"),
    media: str = typer.Option("", help="every worker's " + MEDIA_HELP),
    force_transport: str = typer.Option(
        "", help="--smoke: move every transfer over this medium (e.g. nixl, mooncake, tcp, shm)"
    ),
    engine: str = typer.Option("synthetic", help="every worker's engine: " + ENGINE_HELP),
    model_path: Path | None = typer.Option(None, help="--engine hf: a local HF model directory"),
    demo_model: int | None = typer.Option(None, help="--engine hf: the seeded demo model"),
    insecure_no_auth: bool = insecure_option(),
    tls: bool = typer.Option(
        False, "--tls", help="serve HTTPS everywhere, with a throwaway CA made in the run dir"
    ),
    etcd: Mapping[str, str] = ETCD_FLAGS,
) -> None:
    """Start an orchestrator and N + M workers as real processes (Ctrl-C stops them all).

    The run directory gets the cluster's tokens (mode 0600): ``token`` (admin scope) and
    ``worker-token`` (worker scope), written before the orchestrator starts."""
    from topkv.service.cluster.local import (
        ClusterConfig,
        LocalCluster,
        SmokeLayout,
        check_forced_medium,
        run_smoke,
        smoke_results,
    )
    from topkv.service.worker.media import parse_media, resolve_media

    offered = parse_media(media)
    if offered is not None:
        resolve_media(offered)  # exits 2 naming a medium this host lacks
    forced = force_transport or None
    if forced is not None:
        if not smoke:
            raise ConfigError("--force-transport applies to the --smoke run; add --smoke K")
        check_forced_medium(forced, offered)
    engine_spec = _engine_spec(engine, model_path, demo_model, 1 if engine == "hf" else 0)
    check_etcd_env(registry, etcd)
    console = stdout_console()
    cluster = LocalCluster(
        ClusterConfig(
            prefill=prefill,
            decode=decode,
            registry=registry,
            topology=topology,
            host=host,
            port=port,
            ttl_s=ttl,
            capacity=capacity,
            media=offered,
            engine=engine_spec,
            insecure=insecure_no_auth,
            etcd_args=tuple(etcd_flags(etcd)),
            tls=tls,
        ),
        run_dir,
    )
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        cluster.start()
        described = cluster.describe()
        if smoke:
            report = run_smoke(
                cluster.client(),
                smoke,
                SmokeLayout(layers=smoke_layers, tokens=smoke_tokens),
                medium=forced,
                model_id=cluster.served_model(),
            )
            if json_output:
                results = smoke_results(report)
                typer.echo(
                    dumps({"cluster": described, "smoke": report, "results": results}, indent=2)
                )
            else:
                _print_cluster(console, described)
                _print_smoke(console, report)
            ok = report["delivered"] == report["submitted"] == report["verified"]
            if forced is not None:
                ok = ok and all(r["medium"] == forced for r in report["results"])
            raise typer.Exit(0 if ok else 1)
        if json_output:
            typer.echo(dumps(described, indent=2))
        else:
            _print_cluster(console, described)
            console.print("Ctrl-C or SIGTERM stops every process.")
        try:
            while not stop.wait(0.5):
                dead = [n for n, p in cluster.workers.items() if not p.alive()]
                if cluster.orchestrator is not None and not cluster.orchestrator.alive():
                    raise ServiceError("the orchestrator exited; stopping the cluster")
                for name in dead:
                    console.print(f"[yellow]{name} exited[/yellow]")
                    cluster.workers.pop(name)
        except KeyboardInterrupt:
            pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        cluster.stop()


def _print_cluster(console: Console, described: dict[str, object]) -> None:
    orch = described["orchestrator"]
    assert isinstance(orch, dict)
    console.print(
        f"orchestrator [bold]{orch['url']}[/bold] (pid {orch['pid']}, registry {orch['registry']})"
    )
    table = Table(title="Workers", title_justify="left")
    for column in ("worker", "role", "pid", "control", "tcp", "shm"):
        table.add_column(column)
    workers = described["workers"]
    assert isinstance(workers, list)
    for w in workers:
        table.add_row(
            str(w["worker_id"]),
            str(w["role"]),
            str(w["pid"]),
            str(w["control_url"]),
            str(w["tcp"]),
            str(w["shm"]),
        )
    console.print(table)
    console.print(f"logs: {described['logs']}")


def _print_smoke(console: Console, report: dict[str, object]) -> None:
    table = Table(title="Smoke transfers", title_justify="left")
    for column in ("request", "state", "source -> destination", "path", "medium", "seconds"):
        table.add_column(column)
    table.add_column("verified")
    results = report["results"]
    assert isinstance(results, list)
    for r in results:
        seconds = r["transfer_seconds"]
        table.add_row(
            str(r["request_id"]),
            r["state"],
            f"{r['source']} -> {r['destination']}",
            str(r["transport"]),
            str(r["medium"]) + (" (emulated)" if r["emulated"] else ""),
            f"{seconds:.4f}" if seconds is not None else "-",
            "yes" if r["verified"] else f"no {r['reason']}",
        )
    console.print(table)
    console.print(
        f"submitted {report['submitted']}, delivered {report['delivered']}, "
        f"verified {report['verified']}, failed {report['failed']}"
    )


def status_command(
    orchestrator: str = typer.Option(
        "", help=f"orchestrator URL (default ${ORCHESTRATOR_ENV} or http://127.0.0.1:8470)"
    ),
    limit: int = typer.Option(50, help="transfers to list"),
    json_output: bool = typer.Option(False, "--json", help="machine-readable output"),
    token_file: Path | None = token_file_option(
        f"the admin token (default: ${TOKEN_FILE_ENV}; `topkv cluster up` writes RUN_DIR/token)"
    ),
    tls_ca: Path | None = tls_ca_option(
        "the CA that an https:// orchestrator's certificate is verified with (default: the "
        "system's; `topkv cluster up --tls` writes RUN_DIR/tls/ca.crt)"
    ),
) -> None:
    """Show the orchestrator's workers and transfers."""
    from topkv.cli.status import render_status

    url = orchestrator or os.environ.get(ORCHESTRATOR_ENV, f"http://127.0.0.1:{DEFAULT_PORT}")
    client = OrchestratorClient(url, token=client_token(token_file), tls=client_tls(tls_ca))
    workers = client.workers()
    listing = client.transfers(limit)
    if json_output:
        typer.echo(dumps({"workers": workers, "transfers": listing}, indent=2))
        return
    stdout_console().print(render_status(workers, listing))


def register(app: typer.Typer) -> None:
    app.command("orchestrator")(orchestrator_command)
    app.command("worker")(worker_command)
    app.command("status")(status_command)
    cluster = typer.Typer(help="Run a local cluster of real processes.", no_args_is_help=True)
    cluster.command("up")(cluster_up_command)
    app.add_typer(cluster, name="cluster")


def main() -> None:
    """Entry point with only these commands (what ``topkv cluster up`` runs its children with:
    it skips importing every other command's dependencies)."""
    import sys

    from topkv.errors import TopKVError

    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True)
    register(app)
    try:
        app(standalone_mode=True)
    except TopKVError as exc:
        print(f"topkv: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
