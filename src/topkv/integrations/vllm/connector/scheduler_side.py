"""The connector's scheduler half: which requests send or load KV this step, and when their
blocks may be freed. Runs in vLLM's scheduler; moves no bytes (the worker half does).

:class:`SchedulerSide` puts a :class:`SaveSpec` in a prefill's step metadata
(``do_remote_decode``) and a :class:`LoadSpec` in a decode's (``do_remote_prefill``), delays
freeing a prefill's blocks until its copy is acknowledged, hands vLLM back the blocks a load
could not fill, and answers ``{"topkv": {"report_of": ID}}`` requests with a load report (the
last :data:`REPORTS_KEPT` kept). How: docs/vllm.md ("The connector").
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from topkv.integrations.vllm.connector.params import (
    ConnectorConfigError,
    ConnectorSettings,
    LoadParams,
    SendParams,
    report_of,
)

#: Finished loads whose report a later request may still ask for.
REPORTS_KEPT = 1024


@dataclass(frozen=True)
class SaveSpec:
    """Stream tokens ``[first_token, num_tokens)`` of ``req_id`` (its pages: ``block_ids``;
    the destination holds the ones before ``first_token``)."""

    req_id: str
    transfer_id: int
    destination: str
    block_ids: tuple[int, ...]
    num_tokens: int
    corrupt: bool = False  # fault injection: flip one bit of one layer after its CRC
    first_token: int = 0


@dataclass(frozen=True)
class LoadSpec:
    """Fill tokens ``[start, num_tokens)`` of ``req_id`` from transfer ``transfer_id``."""

    req_id: str
    transfer_id: int
    medium: str
    block_ids: tuple[int, ...]
    start: int
    num_tokens: int
    timeout_s: float


@dataclass
class StepPlan:
    """What the worker half does this step (carried in the connector metadata)."""

    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)


@dataclass
class _Load:
    spec: LoadSpec
    kv_bytes: int
    failed: bool = False
    done: bool = False


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, block_size: int, bytes_per_token: int) -> None:
        self.settings = settings
        self.block_size = block_size
        self.bytes_per_token = bytes_per_token  # all layers, K and V
        self._sends: dict[str, tuple[SendParams, int]] = {}  # admitted, not yet streamed
        self._sent: dict[str, tuple[int, int]] = {}  # streamed: transfer id, tokens
        self._pending_loads: dict[str, LoadSpec] = {}
        self._loads: dict[str, _Load] = {}
        self._reports: OrderedDict[int, dict[str, Any]] = OrderedDict()  # transfer id -> report

    # -- decode ---------------------------------------------------------------------------

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        load = LoadParams.of(request.kv_transfer_params)
        if load is None:
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        send = SendParams.of(params)
        if send is not None:
            self._sends[request.request_id] = (send, len(request.prompt_token_ids or ()))
            return
        load = LoadParams.of(params)
        if load is None or num_external_tokens <= 0:
            return
        prompt = len(request.prompt_token_ids or ())
        spec = LoadSpec(
            req_id=request.request_id,
            transfer_id=load.transfer_id,
            medium=load.medium,
            block_ids=tuple(block_ids),
            start=prompt - num_external_tokens,
            num_tokens=prompt,
            timeout_s=load.timeout_s or self.settings.load_timeout_s,
        )
        self._pending_loads[spec.req_id] = spec
        self._loads[spec.req_id] = _Load(spec, num_external_tokens * self.bytes_per_token)
        params["do_remote_prefill"] = False  # loaded once, even if rescheduled

    def loaded(self, finished_recving: set[str], invalid_block_ids: set[int]) -> None:
        """The worker's report of finished loads and the blocks it could not fill."""
        for req_id in finished_recving:
            load = self._loads.get(req_id)
            if load is not None:
                load.done = True
                load.failed = bool(invalid_block_ids.intersection(load.spec.block_ids))

    # -- prefill --------------------------------------------------------------------------

    def plan(
        self, new_reqs: list[Any], cached: Any, scheduled: dict[str, int], blocks: Any
    ) -> StepPlan:
        """This step's saves and loads. ``blocks(req_id)`` gives a request's page ids."""
        plan = StepPlan(loads=list(self._pending_loads.values()))
        self._pending_loads.clear()
        computed = {r.req_id: r.num_computed_tokens for r in new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, (send, prompt) in list(self._sends.items()):
            if req_id not in scheduled or req_id not in computed:
                continue
            if computed[req_id] + scheduled[req_id] < prompt:
                continue  # a chunk of a longer prompt: stream once all of it is computed
            del self._sends[req_id]
            first = min(send.skip_tokens, prompt - 1)  # the last token always travels
            self._sent[req_id] = (send.transfer_id, prompt - first)
            plan.saves.append(
                SaveSpec(
                    req_id,
                    send.transfer_id,
                    send.destination,
                    tuple(blocks(req_id)),
                    prompt,
                    corrupt=send.fault == "corrupt",
                    first_token=first,
                )
            )
        return plan

    def report(self, transfer_id: int) -> dict[str, Any] | None:
        """What became of transfer ``transfer_id``'s load here (None: unknown, or its load
        has not finished yet)."""
        if transfer_id in self._reports:
            return self._reports[transfer_id]
        for load in self._loads.values():
            if load.spec.transfer_id == transfer_id and load.done:
                return _load_report(load)
        return None

    def finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """(delay freeing the blocks?, kv_transfer_params for the response)."""
        req_id = request.request_id
        try:
            asked = report_of(request.kv_transfer_params)
        except ConnectorConfigError as exc:  # never raise into vLLM's scheduler for a request
            return False, {"topkv": {"error": str(exc)}}
        if asked is not None:
            return False, {"topkv": {"report_of": asked, "report": self.report(asked)}}
        self._sends.pop(req_id, None)
        sent = self._sent.pop(req_id, None)
        if sent is not None:  # freed once the worker reports the send settled
            transfer_id, tokens = sent
            return True, {
                "topkv": {"transfer_id": transfer_id, "kv_bytes": tokens * self.bytes_per_token}
            }
        load = self._loads.pop(req_id, None)
        if load is None:
            return False, None
        self._pending_loads.pop(req_id, None)
        report = _load_report(load)
        self._reports[load.spec.transfer_id] = report
        while len(self._reports) > REPORTS_KEPT:
            self._reports.popitem(last=False)
        return False, {"topkv": report}


def _load_report(load: _Load) -> dict[str, Any]:
    verified = load.done and not load.failed
    return {
        "transfer_id": load.spec.transfer_id,
        "medium": load.spec.medium,
        "kv_bytes": load.kv_bytes if verified else 0,
        "verified": verified,
        "recomputed": not verified,
    }
