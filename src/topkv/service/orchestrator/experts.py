"""``GET /v1/experts``: the orchestrator's expert registry, filtered (admin token).

Query parameters, each optional: ``expert`` (an expert id, ASCII digits), ``domain`` (an
NVLink domain) and ``worker`` (a worker id). The answer lists each matching fresh replica
with its statistics, load factor and straggler flag (:meth:`ExpertRegistry.describe`).
"""

from __future__ import annotations

from aiohttp import web

from topkv.jsonout import dumps
from topkv.policy.clock import Clock
from topkv.relay.liveview import LiveWorkerView
from topkv.relay.moe.experts import ExpertRegistry
from topkv.relay.workers import MAX_EXPERT_ID
from topkv.service.http.auth import Access, Route
from topkv.service.http.util import count_param, error_response

#: Longest ``domain`` or ``worker`` filter accepted (the registry's own bounds are lower).
_MAX_FILTER = 256


class ExpertsApi:
    """The expert registry's endpoint over an orchestrator's live worker view."""

    def __init__(self, view: LiveWorkerView, clock: Clock) -> None:
        self._view = view
        self._clock = clock

    def routes(self) -> list[Route]:
        return [Route("GET", "/v1/experts", self.list_experts, Access.ADMIN)]

    async def list_experts(self, request: web.Request) -> web.Response:
        expert = (
            count_param(request, "expert", 0, MAX_EXPERT_ID) if "expert" in request.query else None
        )
        filters: dict[str, str | None] = {}
        for name in ("domain", "worker"):
            text = request.query.get(name)
            if text is not None and not 0 < len(text) <= _MAX_FILTER:
                return error_response(
                    400, "bad_request", f"{name} must be 1 to {_MAX_FILTER} characters"
                )
            filters[name] = text
        registry = ExpertRegistry.of(self._view, self._clock)
        doc = registry.describe(expert=expert, domain=filters["domain"], worker=filters["worker"])
        return web.json_response(doc, dumps=dumps)
