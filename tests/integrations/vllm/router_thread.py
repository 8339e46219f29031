"""The front door in a thread of the test process (its own event loop), for the tests."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

from topkv.integrations.vllm.frontdoor.router import RouterServer
from topkv.service.http.auth import Credentials, ServerAuth


class RouterThread:
    """``registry_url``: read the instances from that orchestrator (with the admin token)
    instead of the embedded registry; ``client``: a client token the inference endpoints
    accept too; ``protect_metrics``: /metrics needs an admin token."""

    def __init__(
        self,
        admin: str,
        worker: str,
        shm_dir: str,
        registry_url: str = "",
        *,
        client: str | None = None,
        protect_metrics: bool = False,
    ) -> None:
        clients = [client] if client is not None else []
        credentials = Credentials.of(admin=[admin], worker=[worker], client=clients)
        auth = ServerAuth(credentials, protect_metrics=protect_metrics)
        self.loop = asyncio.new_event_loop()
        self.server = RouterServer(
            auth, shm_dir, registry_url=registry_url, registry_token=admin if registry_url else None
        )
        started: Future[str] = Future()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        self.url = started.result(30)

    def _run(self, started: Future[str]) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            started.set_result(self.loop.run_until_complete(self.server.serve()))
        except BaseException as exc:
            started.set_exception(exc)
            return
        self.loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
