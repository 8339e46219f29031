"""A :class:`~topkv.relay.executor.TransferExecutor` that drives worker processes over HTTP.

One attempt of a planned transfer, from the orchestrator's side::

    POST {destination}/v1/receive   {request_id, model_id, layout, medium} -> sink address
    POST {source}/v1/send           {request_id, destination: address, medium, timeout_s}
         the source streams its KV with topkv.transport; it answers once the destination
         acknowledged a verified copy (every layer's CRC-64 checked)
    POST {destination}/v1/kv/{id}/wait  -> the destination's digest of the bytes it holds

On any failure or cancellation the executor cancels the source's send and drops whatever
reached the destination (``DELETE {destination}/v1/kv/{id}``), so a failed attempt leaves
nothing behind. Errors map to :class:`~topkv.relay.transfers.FailureKind`: an unreachable
destination is ``destination_died``, an unreachable or empty source ``source_lost``, and a
transport error reported by a worker keeps the kind the worker classified.

Media: the selection policy picks a *path class*; :meth:`RemoteExecutor.medium_for` picks the
medium both workers offer (their registrations list them) through the one decision,
:func:`topkv.transport.media.medium_for`: an arena medium first where one serves the class
(``nixl`` for rdma, ``cuda`` for nvlink/nvswitch), else the default table
(:data:`~topkv.transport.media.DEFAULT_MEDIA`). A request submitted with a ``medium`` is
moved by that medium only (:meth:`RemoteExecutor.force_medium`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import aiohttp
from pydantic import BaseModel, ValidationError

from topkv.errors import ConfigError
from topkv.relay.executor import AttemptFailed, AttemptPlan, Delivery
from topkv.relay.transfers import FailureKind
from topkv.relay.workers import Role, WorkerInfo
from topkv.service.http.auth import auth_headers
from topkv.service.http.fencing import epoch_headers
from topkv.service.http.tls import ClientTLS, client_context, tls_failure
from topkv.service.messages import (
    DecodeRequest,
    DecodeResult,
    GenerateRequest,
    GenerateResult,
    KVSummary,
    LayoutModel,
    PacedLink,
    PrefillRequest,
    ReceiveReady,
    ReceiveRequest,
    RoleAnswer,
    RoleRequest,
    SendRequest,
    SendResult,
    WaitRequest,
)
from topkv.service.worker.media import check_medium, same_host
from topkv.transport import media as path_media
from topkv.transport.base import KVLayout
from topkv.transport.media import DEFAULT_MEDIA

M = TypeVar("M", bound=BaseModel)

#: Extra seconds an HTTP call may take beyond the attempt's own timeout.
_HTTP_MARGIN_S = 5.0

#: The largest answer read from a worker's control API (a longer one is a failed call).
_MAX_ANSWER_BYTES = 16 << 20

#: Requests remembered per table (forced media, prefill's first tokens, attempt reports).
_REMEMBERED = 65_536

#: ``pacing(plan, medium)``: the emulated path an attempt's send is paced to (None: none).
Pacing = Callable[[AttemptPlan, str], PacedLink | None]


@dataclass(frozen=True)
class MoveReport:
    """What both workers reported about one move of a KV: the sender's result (with its
    per-layer stamps) and the destination's summary (with the arrival stamps)."""

    sent: SendResult
    held: KVSummary


class RemoteExecutor:
    """Runs attempts by calling the control APIs of the source and destination workers."""

    def __init__(
        self,
        media: Mapping[str, str] | None = None,
        *,
        call_timeout_s: float = 10.0,
        max_connections: int = 512,
        pacing: Pacing | None = None,
        token: str | None = None,
        tls: ClientTLS | None = None,
        schedule: Literal["stream", "serial"] = "stream",
    ) -> None:
        """``pacing``: pace each attempt's send to an emulated path (an orchestrator whose
        topology is emulated on one host, e.g. ``topkv demo``); None sends at full speed.
        ``schedule``: how an attempt's source sends (``stream``: each layer as prefill
        publishes it, the pipelined transfer; ``serial``: the whole KV once prefill ended,
        as without pipelining).
        ``token``: the admin token the workers' control APIs accept (None: they run open).
        ``tls``: how ``https://`` workers are verified (None: the system's trust store)."""
        self.token = token
        self.tls = tls
        self.media = dict(DEFAULT_MEDIA if media is None else media)
        self.pacing = pacing
        self.schedule = schedule
        self.call_timeout_s = call_timeout_s
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._forced: OrderedDict[int, str] = OrderedDict()
        self._first_tokens: OrderedDict[int, int] = OrderedDict()
        self._reports: OrderedDict[int, MoveReport] = OrderedDict()
        #: The leader's election epoch sent on every call (service.fencing); None: no election.
        self.epoch: int | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self._max_connections, ssl=client_context(self.tls) or True
            )
            self._session = aiohttp.ClientSession(
                connector=connector, headers=auth_headers(self.token)
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def force_medium(self, request_id: int, medium: str | None) -> None:
        """Move ``request_id``'s KV over ``medium`` only (None: let the path class choose)."""
        self._forced.pop(request_id, None)
        if medium is not None:
            _remember(self._forced, request_id, medium)

    def medium_for(self, plan: AttemptPlan) -> str:
        """The medium serving ``plan.path_class`` between these two workers: the forced one,
        else an arena medium serving the class, else this executor's medium for the class
        (each judged by :func:`check_medium`); AttemptFailed (transport) when none can."""
        forced = self._forced.get(plan.request_id)
        own = forced if forced is not None else self.media.get(plan.path_class)
        if own is None:
            raise AttemptFailed(
                FailureKind.TRANSPORT, f"no medium here serves {plan.path_class!r} paths"
            )
        source, destination = plan.source, plan.destination
        choice = path_media.medium_for(
            plan.path_class,
            None,  # any registered medium: check_medium knows what each one rides on
            same_host(source, destination),
            lambda medium: check_medium(medium, source, destination),
            own=(own,),
            forced=forced,
        )
        if choice.medium is not None:
            return choice.medium
        # An arena medium that cannot join the two is passed over; the class's own cannot.
        problem = choice.why_refused(own)
        detail = f"forced medium {forced}: {problem}" if forced is not None else str(problem)
        raise AttemptFailed(FailureKind.TRANSPORT, detail)

    def first_token(self, request_id: int) -> int | None:
        """Prefill's first token of ``request_id``, as its source reported it (once)."""
        return self._first_tokens.pop(request_id, None)

    def delivered_report(self, request_id: int) -> MoveReport | None:
        """The workers' report of ``request_id``'s delivered attempt (once)."""
        return self._reports.pop(request_id, None)

    def _note(self, held: KVSummary) -> None:
        if held.first_token is not None:
            _remember(self._first_tokens, held.request_id, held.first_token)

    # -- HTTP --------------------------------------------------------------------------------

    async def _call(
        self,
        worker: WorkerInfo,
        method: str,
        path: str,
        body: str | None,
        timeout_s: float,
        unreachable: FailureKind,
        not_found: FailureKind | None = None,
        refusal: bool = False,
    ) -> Any:
        """One JSON call; worker errors become :class:`AttemptFailed` with their kind
        (with ``refusal``, a ``400`` becomes :class:`ConfigError`: the request was bad). An
        answer that is not HTTP, is cut short or is over :data:`_MAX_ANSWER_BYTES` is an
        unreachable worker; a body that is not JSON reads as None."""
        if not worker.control_url:
            raise AttemptFailed(unreachable, f"{worker.worker_id} registered no control URL")
        url = f"{worker.control_url.rstrip('/')}{path}"
        try:
            async with self._client().request(
                method,
                url,
                data=body,
                headers={"Content-Type": "application/json", **epoch_headers(self.epoch)},
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as response:
                text = await _answer_text(response, worker, path)
                status = response.status
        except (aiohttp.ClientError, ConnectionError) as exc:
            tls = tls_failure(url, exc, self.tls, user_url=False)
            why = f"{worker.worker_id}: {tls}" if tls else f"{worker.worker_id} unreachable: {exc}"
            raise AttemptFailed(unreachable, why) from exc
        except TimeoutError as exc:
            raise AttemptFailed(
                FailureKind.TIMEOUT, f"{worker.worker_id} did not answer {path} in {timeout_s} s"
            ) from exc
        try:
            payload = json.loads(text) if text else None
        except (ValueError, RecursionError):  # not JSON, or nested beyond reason
            payload = None
        if status < 300:
            return payload
        if refusal and status == 400:
            error = payload.get("error") if isinstance(payload, dict) else None
            detail = error.get("detail") if isinstance(error, dict) else text[:300]
            raise ConfigError(f"{worker.worker_id} refused {path}: {detail}")
        raise _worker_error(worker, path, status, payload, text, not_found or unreachable)

    async def source_summary(self, source: WorkerInfo, request_id: int) -> KVSummary:
        """The summary of the KV ``source`` holds for ``request_id``, answered once a running
        prefill made it whole (with prefill's stamps and first token)."""
        payload = await self._call(
            source,
            "GET",
            f"/v1/kv/{request_id}",
            None,
            self.call_timeout_s,
            FailureKind.SOURCE_LOST,
        )
        held = _parsed(source, f"/v1/kv/{request_id}", payload, KVSummary, FailureKind.SOURCE_LOST)
        self._note(held)
        return held

    async def source_digest(self, source: WorkerInfo, request_id: int, layout: KVLayout) -> int:
        held = await self.source_summary(source, request_id)
        if held.layout.to_layout() != layout:
            raise AttemptFailed(
                FailureKind.SOURCE_LOST,
                f"{source.worker_id} holds request {request_id} with another layout "
                f"({held.layout.model_dump()})",
            )
        if not held.complete:
            raise AttemptFailed(
                FailureKind.SOURCE_LOST, f"{source.worker_id}: request {request_id} is not whole"
            )
        return held.digest

    async def _engine_call(
        self,
        worker: WorkerInfo,
        path: str,
        body: BaseModel,
        answer: type[M],
        min_timeout_s: float,
        failure: FailureKind,
    ) -> M:
        """POST ``body`` to one of ``worker``'s engine endpoints (prefill, decode, generate:
        long calls; a 400 is the request's fault, a :class:`ConfigError`)."""
        payload = await self._call(
            worker,
            "POST",
            path,
            body.model_dump_json(),
            max(self.call_timeout_s, min_timeout_s),
            failure,
            refusal=True,
        )
        return _parsed(worker, path, payload, answer, failure)

    async def prefill(self, source: WorkerInfo, request_id: int, body: PrefillRequest) -> KVSummary:
        """Ask a prefill worker to produce request ``request_id``'s KV with its engine (with
        ``body.wait`` false the answer comes at once, while prefill runs)."""
        path = f"/v1/kv/{request_id}/prefill"
        held = await self._engine_call(source, path, body, KVSummary, 60.0, FailureKind.SOURCE_LOST)
        self._note(held)
        return held

    async def decode(
        self, worker: WorkerInfo, request_id: int, first_token: int | None, max_new_tokens: int
    ) -> DecodeResult:
        """Have ``worker`` generate ``max_new_tokens`` tokens from the KV it holds."""
        body = DecodeRequest(max_new_tokens=max_new_tokens, first_token=first_token)
        path = f"/v1/kv/{request_id}/decode"
        return await self._engine_call(
            worker, path, body, DecodeResult, 120.0, FailureKind.DESTINATION_DIED
        )

    async def generate(self, worker: WorkerInfo, body: GenerateRequest) -> GenerateResult:
        """Have ``worker`` generate from a prompt alone (the single-process reference)."""
        return await self._engine_call(
            worker, "/v1/generate", body, GenerateResult, 120.0, FailureKind.INTERNAL
        )

    async def set_role(
        self, worker: WorkerInfo, role: Role, *, chunk_tokens: int, reserved_slots: int
    ) -> float:
        """Move ``worker`` to the ``role`` pool (``POST /v1/role``, the ADP's conversion);
        returns the worker's own seconds. A worker that refuses (KV not acknowledged, more
        decode than the reserve) or is gone raises :class:`AttemptFailed`."""
        body = RoleRequest(role=role, chunk_tokens=chunk_tokens, reserved_slots=reserved_slots)
        answer = await self._engine_call(
            worker, "/v1/role", body, RoleAnswer, 30.0, FailureKind.DESTINATION_DIED
        )
        return answer.seconds

    async def held_digest(self, worker: WorkerInfo, request_id: int) -> int:
        """Digest of the KV ``worker`` holds for ``request_id`` (computed from its bytes)."""
        payload = await self._call(
            worker,
            "GET",
            f"/v1/kv/{request_id}",
            None,
            self.call_timeout_s,
            FailureKind.DESTINATION_DIED,
            not_found=FailureKind.TRANSPORT,
        )
        held = _parsed(
            worker, f"/v1/kv/{request_id}", payload, KVSummary, FailureKind.DESTINATION_DIED
        )
        if not held.complete:
            raise AttemptFailed(FailureKind.TRANSPORT, f"{worker.worker_id}: KV not whole")
        return held.digest

    async def probe(self, worker: WorkerInfo) -> bool:
        try:
            await self._call(
                worker, "GET", "/healthz", None, self.call_timeout_s, FailureKind.DESTINATION_DIED
            )
        except AttemptFailed:
            return False
        return True

    async def release_source(self, source: WorkerInfo, request_id: int) -> None:
        await self._drop(source, request_id)

    async def discard_destination(self, destination: WorkerInfo, request_id: int) -> None:
        await self._drop(destination, request_id)

    async def _drop(self, worker: WorkerInfo, request_id: int) -> None:
        # A dead worker's KV died with it: unreachable is fine here.
        with contextlib.suppress(AttemptFailed):
            await self._call(
                worker,
                "DELETE",
                f"/v1/kv/{request_id}",
                None,
                self.call_timeout_s,
                FailureKind.INTERNAL,
            )

    async def transfer(self, plan: AttemptPlan) -> Delivery:
        medium = self.medium_for(plan)
        link = self.pacing(plan, medium) if self.pacing is not None else None
        try:
            report = await self._move(
                plan.source,
                plan.destination,
                SendRequest(
                    request_id=plan.request_id,
                    destination="-",
                    medium=medium,
                    timeout_s=plan.timeout_s,
                    link=link,
                    schedule=self.schedule,
                ),
                plan.model_id,
                plan.layout,
                keep=True,
            )
        except BaseException:
            await asyncio.shield(self._abandon(plan))
            raise
        _remember(self._reports, plan.request_id, report)
        sent, held = report.sent, report.held
        return Delivery(
            request_id=plan.request_id,
            destination=plan.destination.worker_id,
            transport=plan.path_class,
            medium=medium,
            size_bytes=held.size_bytes,
            seconds=sent.seconds if sent.emulated else sent.wall_seconds,
            digest=held.digest,
            emulated=sent.emulated,
        )

    async def send_copy(
        self,
        source: WorkerInfo,
        destination: WorkerInfo,
        request_id: int,
        transfer_id: int,
        layout: KVLayout,
        *,
        model_id: str,
        medium: str,
        timeout_s: float,
        link: PacedLink | None = None,
        schedule: Literal["stream", "serial", "replay"] = "serial",
    ) -> MoveReport:
        """Send another copy of the KV ``source`` holds for ``request_id`` to
        ``destination``, as transfer ``transfer_id``, which drains it (verifies, stamps and
        releases it): a measurement of a path or schedule, outside any request's delivery."""
        send = SendRequest(
            request_id=request_id,
            destination="-",
            medium=medium,
            timeout_s=timeout_s,
            transfer_id=transfer_id,
            link=link,
            schedule=schedule,
        )
        try:
            return await self._move(source, destination, send, model_id, layout, keep=False)
        except BaseException:
            with contextlib.suppress(AttemptFailed):
                await self._call(
                    source,
                    "POST",
                    f"/v1/kv/{transfer_id}/cancel",
                    None,
                    self.call_timeout_s,
                    FailureKind.INTERNAL,
                )
            await self._drop(destination, transfer_id)
            raise

    async def _move(
        self,
        source: WorkerInfo,
        destination: WorkerInfo,
        send: SendRequest,
        model_id: str,
        layout: KVLayout,
        *,
        keep: bool,
    ) -> MoveReport:
        """Announce the receive, have the source send, wait for the verified copy."""
        wire_id = send.request_id if send.transfer_id is None else send.transfer_id
        timeout = send.timeout_s + _HTTP_MARGIN_S
        receive = ReceiveRequest(
            request_id=wire_id,
            model_id=model_id,
            layout=LayoutModel.of(layout),
            medium=send.medium,
            keep=keep,
        )
        ready = _parsed(
            destination,
            "/v1/receive",
            await self._call(
                destination,
                "POST",
                "/v1/receive",
                receive.model_dump_json(),
                self.call_timeout_s,
                FailureKind.DESTINATION_DIED,
            ),
            ReceiveReady,
            FailureKind.DESTINATION_DIED,
        )
        send = send.model_copy(update={"destination": ready.address})
        sent = _parsed(
            source,
            "/v1/send",
            await self._call(
                source,
                "POST",
                "/v1/send",
                send.model_dump_json(),
                timeout,
                FailureKind.SOURCE_LOST,
            ),
            SendResult,
            FailureKind.SOURCE_LOST,
        )
        waited = f"/v1/kv/{wire_id}/wait"
        held = _parsed(
            destination,
            waited,
            await self._call(
                destination,
                "POST",
                waited,
                WaitRequest(timeout_s=send.timeout_s).model_dump_json(),
                timeout,
                FailureKind.DESTINATION_DIED,
                not_found=FailureKind.TRANSPORT,
            ),
            KVSummary,
            FailureKind.DESTINATION_DIED,
        )
        return MoveReport(sent, held)

    async def _abandon(self, plan: AttemptPlan) -> None:
        """Stop the source sending and drop anything that reached the destination."""
        with contextlib.suppress(AttemptFailed):
            await self._call(
                plan.source,
                "POST",
                f"/v1/kv/{plan.request_id}/cancel",
                None,
                self.call_timeout_s,
                FailureKind.INTERNAL,
            )
        await self._drop(plan.destination, plan.request_id)


def _remember(table: OrderedDict[int, Any], request_id: int, value: Any) -> None:
    table[request_id] = value
    table.move_to_end(request_id)
    while len(table) > _REMEMBERED:
        table.popitem(last=False)


async def _answer_text(response: aiohttp.ClientResponse, worker: WorkerInfo, path: str) -> str:
    """The answer's body as text (undecodable bytes replaced), at most
    :data:`_MAX_ANSWER_BYTES`; a longer one raises ``aiohttp.ClientPayloadError``."""
    declared = response.content_length
    if declared is not None and declared > _MAX_ANSWER_BYTES:
        raise aiohttp.ClientPayloadError(
            f"{worker.worker_id} answered {path} with {declared} bytes (at most "
            f"{_MAX_ANSWER_BYTES} are read)"
        )
    data = bytearray()
    async for chunk in response.content.iter_any():
        data += chunk
        if len(data) > _MAX_ANSWER_BYTES:
            raise aiohttp.ClientPayloadError(
                f"{worker.worker_id} answered {path} with over {_MAX_ANSWER_BYTES} bytes"
            )
    return data.decode("utf-8", "replace")


def _parsed(
    worker: WorkerInfo, path: str, payload: object, answer: type[M], kind: FailureKind
) -> M:
    """``payload`` as an ``answer``; an answer of another shape (nonsense from a worker)
    is a failed call of ``kind``, an :class:`AttemptFailed`, never a crash."""
    try:
        return answer.model_validate(payload)
    except ValidationError as exc:
        raise AttemptFailed(
            kind,
            f"{worker.worker_id} answered {path} with nonsense: not a {answer.__name__} "
            f"({exc.error_count()} error(s))",
        ) from None


def _worker_error(
    worker: WorkerInfo,
    path: str,
    status: int,
    payload: object,
    text: str,
    not_found: FailureKind,
) -> AttemptFailed:
    error = payload.get("error") if isinstance(payload, dict) else None
    kind_text = error.get("kind") if isinstance(error, dict) else None
    detail = error.get("detail") if isinstance(error, dict) else None
    kind: FailureKind
    if status == 404:
        kind = not_found
    elif kind_text == "capacity":
        kind = FailureKind.NO_DESTINATION  # the orchestrator reroutes
    else:
        try:
            kind = FailureKind(str(kind_text))
        except ValueError:
            kind = FailureKind.TRANSPORT if status in (502, 504) else FailureKind.INTERNAL
    message = detail if isinstance(detail, str) else text[:300]
    return AttemptFailed(kind, f"{worker.worker_id} {path} -> {status}: {message}")
