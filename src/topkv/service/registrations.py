"""The worker registration endpoints over an embedded registry (:class:`Registrations`):
``POST /v1/workers``, ``PUT /v1/workers/{id}/heartbeat``, ``DELETE /v1/workers/{id}``.

Served by ``topkv orchestrator`` (embedded registry) and by the chaos supervisor; both
hold every worker's registration handle here."""

from __future__ import annotations

from aiohttp import web

from topkv.errors import TopKVError
from topkv.relay.registry import Registration, WorkerRegistry
from topkv.service.api_models import HeartbeatAck, WorkerView
from topkv.service.httputil import error_response, model_response, read_model
from topkv.service.messages import RegisterRequest


class Registrations:
    """The registration of every worker that registered over HTTP, by worker id."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry
        self.by_worker: dict[str, Registration] = {}

    async def register(self, request: web.Request) -> web.Response:
        """Register (201) or re-register (200) the worker in the body."""
        body = await read_model(request, RegisterRequest)
        old = self.by_worker.pop(body.worker.worker_id, None)
        self.by_worker[body.worker.worker_id] = self.registry.register(body.worker, body.ttl_s)
        answer = WorkerView(worker=body.worker, slots_used=0)
        return model_response(answer, status=200 if old is not None else 201)

    async def heartbeat(self, request: web.Request) -> web.Response:
        """Renew the worker's lease; 404 when it is not (or no longer) registered."""
        worker_id = request.match_info["worker_id"]
        registration = self.by_worker.get(worker_id)
        if registration is None:
            return not_registered(worker_id)
        try:
            registration.heartbeat()
        except TopKVError as exc:
            self.by_worker.pop(worker_id, None)
            return error_response(404, "not_found", str(exc))
        return model_response(HeartbeatAck(worker_id=worker_id, ok=True))

    def forget(self, worker_id: str) -> bool:
        """Deregister ``worker_id`` now (False: it held no registration here)."""
        registration = self.by_worker.pop(worker_id, None)
        if registration is None:
            return False
        registration.deregister()
        return True

    async def deregister(self, request: web.Request) -> web.Response:
        """Deregister the worker (204); 404 when it is not registered."""
        worker_id = request.match_info["worker_id"]
        if not self.forget(worker_id):
            return not_registered(worker_id)
        return web.Response(status=204)


def not_registered(worker_id: str) -> web.Response:
    return error_response(404, "not_found", f"worker {worker_id!r} is not registered")
