"""``topkv router``: the OpenAI-compatible front door over vLLM instances running
TopKVConnector (``docs/vllm.md``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer

from topkv.cli.auth_options import insecure_option, orchestrator_auth, token_file_option
from topkv.cli.services import _logging, _until_signalled


def router_command(
    host: str = typer.Option("127.0.0.1", help="address to listen on"),
    port: int = typer.Option(8000, help="HTTP port (0 picks a free one)"),
    shm_dir: Path = typer.Option(
        Path("/tmp"), help="the decode instances' shm_dir (where their shm sinks listen)"
    ),
    token_file: Path | None = token_file_option(
        "the admin token: what OpenAI clients send as their api_key (default: $TOPKV_TOKEN_FILE)"
    ),
    worker_token_file: Path | None = typer.Option(
        None, help="worker tokens the vLLM instances register with, one per line"
    ),
    protect_metrics: bool = typer.Option(False, help="/metrics needs an admin token"),
    log_level: str = typer.Option("warning", help="debug | info | warning | error"),
    insecure_no_auth: bool = insecure_option(),
) -> None:
    """Serve /v1/completions, /v1/chat/completions, /v1/models and /metrics over the
    registered vLLM prefill and decode instances; Ctrl-C stops it."""
    from topkv.integrations.vllm.router import RouterServer

    _logging(log_level)
    auth = orchestrator_auth(
        token_file, worker_token_file, insecure=insecure_no_auth, protect_metrics=protect_metrics
    )

    async def main(stop: asyncio.Event) -> None:
        server = RouterServer(auth, str(shm_dir))
        url = await server.serve(host, port)
        typer.echo(f"topkv router on {url} (OpenAI API at {url}/v1)", err=True)
        try:
            await stop.wait()
        finally:
            await server.close()

    asyncio.run(_until_signalled(main))


def register(app: typer.Typer) -> None:
    app.command("router")(router_command)
