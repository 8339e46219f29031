"""``topkv router`` (the OpenAI-compatible front door over vLLM instances running
TopKVConnector), ``topkv vllm up`` (a local stack: a ``topkv orchestrator``, the front door
and N prefill + M decode vLLM instances) and ``topkv vllm model`` (TopKV's tiny Llama).
See ``docs/vllm.md``."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from topkv.cli.options.auth import (
    client_token,
    front_door_auth,
    insecure_option,
    token_file_option,
)
from topkv.cli.services import _adp_config, _logging, _until_signalled
from topkv.errors import ConfigError
from topkv.service.http.auth import CLIENT_TOKEN_FILE_ENV, read_token_lines

if TYPE_CHECKING:
    from topkv.integrations.vllm.frontdoor.adp import AdpOptions


def router_command(
    host: str = typer.Option("127.0.0.1", help="address to listen on"),
    port: int = typer.Option(8000, help="HTTP port (0 picks a free one)"),
    shm_dir: Path = typer.Option(
        Path("/tmp"), help="the decode instances' shm_dir (where their shm sinks listen)"
    ),
    token_file: Path | None = token_file_option(
        "the admin token: the operators' (every endpoint, /v1/adp included) "
        "(default: $TOPKV_TOKEN_FILE)"
    ),
    worker_token_file: Path | None = typer.Option(
        None, help="worker tokens the vLLM instances register with, one per line"
    ),
    client_token_file: Path | None = typer.Option(
        None,
        help="client tokens (or sha256: digests), one per line: what OpenAI applications "
        "send as their api_key; they may call only /v1/completions, /v1/chat/completions "
        "and /v1/models (`topkv token new FILE --scope client`; default: "
        f"${CLIENT_TOKEN_FILE_ENV})",
    ),
    protect_metrics: bool = typer.Option(False, help="/metrics needs an admin token"),
    log_level: str = typer.Option("warning", help="debug | info | warning | error"),
    insecure_no_auth: bool = insecure_option(),
    registry: str = typer.Option(
        "",
        help="read the instances from this `topkv orchestrator` (http://HOST:PORT) or etcd "
        "registry (etcd://HOST:PORT; TOPKV_ETCD_* credentials), where they register, "
        "instead of the embedded registry",
    ),
    registry_token_file: Path | None = typer.Option(
        None, help="--registry: the orchestrator's admin token (default: --token-file's)"
    ),
    affinity: bool = typer.Option(
        True, help="prefer the instances that last served the request's prefix"
    ),
    adp: str = typer.Option(
        "off",
        help="on: the Adaptive Decoder Pool moves the --kv-both instances between the "
        "prefill and decode pools in a rush (docs/vllm.md; GET /v1/adp)",
    ),
    kv_both: list[str] = typer.Option(
        [], help="--adp on: the id of an instance started kv_both (repeat for each)"
    ),
    adp_worker_token_file: Path | None = typer.Option(
        None,
        help="--adp on with --registry: the worker token the instances registered with "
        "(their records are rewritten with it; default: --worker-token-file's first)",
    ),
    adp_ttft_target_s: float = typer.Option(2.0, help="--adp on: the TTFT target (s)"),
) -> None:
    """Serve /v1/completions, /v1/chat/completions, /v1/models and /metrics over the
    registered vLLM prefill and decode instances; Ctrl-C stops it."""
    from topkv.integrations.vllm.frontdoor.router import RouterServer

    _logging(log_level)
    auth = front_door_auth(
        token_file, worker_token_file, client_token_file,
        insecure=insecure_no_auth, protect_metrics=protect_metrics,
    )  # fmt: skip
    if registry and not registry.startswith(("http://", "https://", "etcd://", "etcds://")):
        raise ConfigError(
            f"--registry {registry!r}: give the orchestrator's http://HOST:PORT or etcd://HOST:PORT"
        )
    registry_token = client_token(registry_token_file or token_file) if registry else None
    worker_file = adp_worker_token_file or worker_token_file
    worker_token = read_token_lines(worker_file)[0] if worker_file else None
    adp_options = _adp_options(adp, kv_both, worker_token, adp_ttft_target_s)

    async def main(stop: asyncio.Event) -> None:
        server = RouterServer(
            auth, str(shm_dir), registry_url=registry, registry_token=registry_token,
            affinity=affinity, adp=adp_options,
        )  # fmt: skip
        url = await server.serve(host, port)
        typer.echo(f"topkv router on {url} (OpenAI API at {url}/v1)", err=True)
        try:
            await stop.wait()
        finally:
            await server.close()

    asyncio.run(_until_signalled(main))


def _adp_options(
    value: str, kv_both: list[str], worker_token: str | None, ttft_target_s: float = 2.0
) -> AdpOptions | None:
    """``--adp``: None (off) or the front door's ADP over the ``kv_both`` instances."""
    from dataclasses import replace

    from topkv.integrations.vllm.frontdoor.adp import AdpOptions

    config = _adp_config(value)
    if config is None:
        return None
    if not kv_both:
        raise ConfigError(
            "--adp on needs at least one kv_both instance (--kv-both ID, or vllm up --both 2); "
            "the policy never moves the last decode instance, so one kv_both instance moves "
            "only beside a kv_consumer"
        )
    return AdpOptions(
        frozenset(kv_both), replace(config, ttft_target_s=ttft_target_s), worker_token
    )


def _vllm_python() -> str:
    """The interpreter that has vLLM: ``.venv-vllm`` (scripts/install-vllm.sh) when present."""
    local = Path(".venv-vllm/bin/python")
    return str(local.absolute()) if local.exists() else sys.executable


def vllm_up_command(
    model: Path = typer.Option(..., help="model directory (`topkv vllm model DIR` writes one)"),
    prefill: int = typer.Option(1, min=1, help="prefill instances"),
    decode: int = typer.Option(1, min=0, help="decode instances"),
    both: int = typer.Option(
        0, min=0, help="instances started kv_both (both0..): decode, moved to prefill by --adp"
    ),
    port: int = typer.Option(8000, help="the front door's port (0 picks a free one)"),
    run_dir: Path = typer.Option(Path("topkv-vllm-run"), help="tokens, secret, logs"),
    python: str = typer.Option("", help="interpreter with vLLM (default: .venv-vllm's)"),
    orchestrator_port: int = typer.Option(0, help="the orchestrator's port (0: a free one)"),
    affinity: bool = typer.Option(
        True, help="prefer the instances that last served the request's prefix"
    ),
    adp: str = typer.Option(
        "off",
        help="on: the Adaptive Decoder Pool moves the --both instances between the pools",
    ),
) -> None:
    """Start a topkv orchestrator (the registry), the front door and N prefill + M decode
    (+ K kv_both) vLLM instances with TopKVConnector; print the URL; Ctrl-C stops them all."""
    from topkv.integrations.vllm.frontdoor.router import RouterServer
    from topkv.integrations.vllm.stack.instances import (
        StackFiles,
        start_orchestrator,
        start_pd_instances,
        wait_up,
    )
    from topkv.service.cluster.local import Supervisor

    if not (model / "config.json").is_file():
        raise ConfigError(f"{model}: no config.json (`topkv vllm model {model}` writes one)")
    if decode + both < 1:
        raise ConfigError("--decode or --both: at least one instance must decode")
    _logging("warning")
    files = StackFiles.create(run_dir)
    adp_options = _adp_options(adp, [f"both{i}" for i in range(both)], files.worker_token)
    auth = files.front_door_auth()

    async def main(stop: asyncio.Event) -> None:
        with Supervisor(run_dir / "logs", grace_s=20) as supervisor:
            _, registry = await asyncio.to_thread(
                start_orchestrator, supervisor, files, orchestrator_port
            )
            server = RouterServer(
                auth, str(run_dir), registry_url=registry, registry_token=files.admin_token,
                affinity=affinity, adp=adp_options,
            )  # fmt: skip
            url = await server.serve("127.0.0.1", port)
            instances = start_pd_instances(
                supervisor, model.absolute(), files, registry,
                prefill=prefill, decode=decode, both=both, python=python or _vllm_python(),
            )  # fmt: skip
            waiting = asyncio.create_task(asyncio.to_thread(wait_up, instances, server.registry))
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait({waiting, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if waiting.done():
                waiting.result()  # raises what went wrong
                typer.echo(
                    f"topkv vllm: {url}/v1 ({prefill} prefill, {decode} decode, {both} kv_both; "
                    f"adp {adp}; orchestrator {registry}; {files.api_key_note()}; "
                    f"logs in {run_dir / 'logs'}); Ctrl-C stops",
                    err=True,
                )
                await stopped
            await server.close()

    asyncio.run(_until_signalled(main))


def vllm_model_command(
    directory: Path = typer.Argument(..., help="where to write it"),
    seed: int = typer.Option(0, help="weights seed"),
    layers: int = typer.Option(4, min=1, help="decoder layers"),
) -> None:
    """Write TopKV's tiny Llama (seeded random weights, byte-level tokenizer) for vLLM."""
    from topkv.integrations.vllm.stack.model import write_tiny_llama

    typer.echo(write_tiny_llama(directory, seed=seed, layers=layers))


def register(app: typer.Typer) -> None:
    app.command("router")(router_command)
    vllm = typer.Typer(help="vLLM with TopKVConnector (docs/vllm.md)", no_args_is_help=True)
    vllm.command("up")(vllm_up_command)
    vllm.command("model")(vllm_model_command)
    app.add_typer(vllm, name="vllm")
