"""Fencing: every control call a leader makes carries its election epoch, and a server
refuses an epoch lower than the highest it has seen.

The orchestrator's executor sends ``X-TopKV-Epoch: N`` (:func:`epoch_headers`) once it
leads with epoch N (``relay.leader``). A worker remembers the highest epoch any call
brought (:class:`EpochFence`) and answers a lower one 409 ``fenced``, so once the new
leader has driven a worker, a deposed leader's late sends, receives, prefills and deletes
there are refused. A call without the header (no leader election) is never fenced.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler

from topkv.service.http.util import error_response

EPOCH_HEADER = "X-TopKV-Epoch"
_MAX_DIGITS = 19  # an int64


def epoch_headers(epoch: int | None) -> dict[str, str]:
    return {} if epoch is None else {EPOCH_HEADER: str(epoch)}


class EpochFence:
    """The highest epoch seen by one server, and what it refused."""

    def __init__(self) -> None:
        self.highest = 0
        self.refused = 0

    def admit(self, epoch: int) -> bool:
        """True (and remember ``epoch``) unless it is lower than one already seen."""
        if epoch < self.highest:
            self.refused += 1
            return False
        self.highest = epoch
        return True

    @web.middleware
    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        text = request.headers.get(EPOCH_HEADER)
        if text is None:
            return await handler(request)
        if not (text.isascii() and text.isdigit() and len(text) <= _MAX_DIGITS):
            return error_response(
                400, "bad_request", f"{EPOCH_HEADER} must be a non-negative integer, got {text!r}"
            )
        epoch = int(text)
        if not self.admit(epoch):
            return error_response(
                409,
                "fenced",
                f"epoch {epoch} is older than epoch {self.highest} this server has seen: the "
                "caller is no longer the leader (its late actions are refused)",
            )
        return await handler(request)
