"""Transfer records, their state machine, and the registry of active transfers.

States of one request's KV transfer::

    queued --> planned --> running --> verifying --> delivered
                  ^           |            |
                  +-----------+------------+   (retry, failover or reroute: plan again)

    any non-terminal state --> failed | cancelled

``queued``: accepted by ``submit`` and waiting for a concurrency slot. ``planned``: a decode
worker and a transport are chosen. ``running``: an attempt is moving bytes. ``verifying``:
the destination holds a copy whose digest is being checked against the source's.
``delivered``, ``failed`` and ``cancelled`` are terminal. A failed transfer says why
(:class:`FailureKind`) and whether it was handed back for recompute.
"""

from __future__ import annotations

import enum
import functools
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from topkv.errors import TopKVError
from topkv.transport.base import KVLayout


class TransferState(enum.StrEnum):
    QUEUED = "queued"
    PLANNED = "planned"
    RUNNING = "running"
    VERIFYING = "verifying"
    DELIVERED = "delivered"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset(
    {TransferState.DELIVERED, TransferState.FAILED, TransferState.CANCELLED}
)

_ALLOWED: dict[TransferState, frozenset[TransferState]] = {
    TransferState.QUEUED: frozenset({TransferState.PLANNED}),
    TransferState.PLANNED: frozenset({TransferState.PLANNED, TransferState.RUNNING}),
    TransferState.RUNNING: frozenset({TransferState.VERIFYING, TransferState.PLANNED}),
    TransferState.VERIFYING: frozenset({TransferState.DELIVERED, TransferState.PLANNED}),
}
_ENDINGS = frozenset({TransferState.FAILED, TransferState.CANCELLED})


class Outcome(enum.StrEnum):
    """How a transfer ended (the ``outcome`` label of the metrics)."""

    DELIVERED = "delivered"
    FAILED = "failed"
    RECOMPUTE = "recompute"
    CANCELLED = "cancelled"


class FailureKind(enum.StrEnum):
    """Why an attempt (or a whole transfer) failed; decides retry, failover or reroute."""

    CHECKSUM = "checksum"  # corrupted in flight: retry the same path
    TIMEOUT = "timeout"  # no progress in time: retry the same path
    TRANSPORT = "transport"  # the medium failed: fail over to the next transport
    DESTINATION_DIED = "destination_died"  # reroute to another decode worker
    SOURCE_LOST = "source_lost"  # the source no longer holds the KV: recompute
    NO_DESTINATION = "no_destination"  # no healthy decode worker with capacity
    COMPLETION_QUEUE_FULL = "completion_queue_full"  # nobody consumes completions
    CANCELLED = "cancelled"
    INTERNAL = "internal"  # a bug or an unexpected exception (reported, never hidden)


class InvalidTransition(TopKVError):
    """A transfer was moved between states the lifecycle does not connect (a bug)."""


class DuplicateRequest(TopKVError):
    """A request id was submitted while a transfer with that id is still active."""


class UnknownRequest(TopKVError):
    """No transfer with this request id is known to the orchestrator."""


@dataclass(frozen=True)
class AttemptRecord:
    """One attempt of a transfer: where to, over what, and how it ended."""

    number: int
    destination: str
    transport: str
    started_at: float
    ended_at: float | None = None
    error: FailureKind | None = None
    detail: str = ""
    medium: str = ""

    def to_dict(self) -> dict[str, object]:
        return _snapshot(self, _ATTEMPT_KEYS)


@dataclass
class TransferRecord:
    """Everything the orchestrator knows about one request's transfer (mutable, owned by it)."""

    request_id: int
    model_id: str
    layout: KVLayout
    source: str
    submitted_at: float
    state: TransferState = TransferState.QUEUED
    destination: str | None = None
    transport: str | None = None
    policy: str = ""
    rationale: str = ""
    source_digest: int | None = None
    #: The source is still producing the KV (layer-by-layer streaming): routing and the
    #: first attempt start at once, and the source's digest is fetched at verification.
    digest_deferred: bool = False
    manual_override: str | None = None
    attempts: list[AttemptRecord] = field(default_factory=list)
    retries: int = 0
    failovers: int = 0
    reroutes: int = 0
    outcome: Outcome | None = None
    failure: FailureKind | None = None
    reason: str = ""
    handed_off_at: float | None = None
    ended_at: float | None = None
    medium: str = ""
    emulated: bool = False
    transfer_seconds: float | None = None

    @functools.cached_property
    def size_bytes(self) -> int:
        """Bytes of the KV (the layout never changes; computed once)."""
        return self.layout.total_bytes

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready snapshot (what status queries and the HTTP API return)."""
        return {
            **_snapshot(self, _RECORD_KEYS),
            "layers": self.layout.num_layers,
            "attempts": [a.to_dict() for a in self.attempts],
        }


#: The attributes :meth:`AttemptRecord.to_dict` and :meth:`TransferRecord.to_dict` hold.
_ATTEMPT_KEYS = (
    "number",
    "destination",
    "transport",
    "medium",
    "started_at",
    "ended_at",
    "error",
    "detail",
)
_RECORD_KEYS = (
    "request_id",
    "model_id",
    "source",
    "destination",
    "state",
    "transport",
    "medium",
    "emulated",
    "policy",
    "rationale",
    "size_bytes",
    "submitted_at",
    "handed_off_at",
    "ended_at",
    "transfer_seconds",
    "retries",
    "failovers",
    "reroutes",
    "outcome",
    "failure",
    "reason",
)


def _snapshot(record: object, keys: Iterable[str]) -> dict[str, object]:
    """The attributes ``keys`` of ``record``, JSON-ready: an enum as its value."""
    values = ((key, getattr(record, key)) for key in keys)
    return {key: value.value if isinstance(value, enum.Enum) else value for key, value in values}


def check_transition(record: TransferRecord, new: TransferState) -> None:
    """Raise :class:`InvalidTransition` unless ``record`` may move to ``new``."""
    old = record.state
    if old.terminal:
        raise InvalidTransition(
            f"request {record.request_id} is already {old.value}; cannot move to {new.value}"
        )
    if new in _ENDINGS or new in _ALLOWED[old]:
        return
    raise InvalidTransition(
        f"request {record.request_id}: {old.value} -> {new.value} is not a step"
    )


class TransferTable:
    """Active transfers by request id plus a bounded history of finished ones."""

    def __init__(self, history: int = 10_000) -> None:
        if history < 0:
            raise TopKVError(f"history size must be >= 0, got {history}")
        self._history_limit = history
        self._active: dict[int, TransferRecord] = {}
        self._finished: OrderedDict[int, TransferRecord] = OrderedDict()

    def add(self, record: TransferRecord) -> None:
        if record.request_id in self._active:
            raise DuplicateRequest(
                f"request {record.request_id} is already being transferred "
                f"(state {self._active[record.request_id].state.value})"
            )
        self._finished.pop(record.request_id, None)
        self._active[record.request_id] = record

    def move(self, record: TransferRecord, new: TransferState) -> None:
        """Change ``record``'s state (checked); terminal records move to the history."""
        check_transition(record, new)
        record.state = new
        if new.terminal:
            self._active.pop(record.request_id, None)
            if self._history_limit:
                self._finished[record.request_id] = record
                while len(self._finished) > self._history_limit:
                    self._finished.popitem(last=False)

    def get(self, request_id: int) -> TransferRecord | None:
        return self._active.get(request_id) or self._finished.get(request_id)

    def require(self, request_id: int) -> TransferRecord:
        record = self.get(request_id)
        if record is None:
            raise UnknownRequest(f"no transfer for request {request_id}")
        return record

    def active(self) -> list[TransferRecord]:
        return list(self._active.values())

    def __iter__(self) -> Iterator[TransferRecord]:
        yield from self._active.values()
        yield from self._finished.values()

    def query(
        self,
        state: TransferState | None = None,
        worker: str | None = None,
        limit: int | None = None,
    ) -> list[TransferRecord]:
        """Records (active first, then the newest finished), filtered by state and worker."""
        found: list[TransferRecord] = []
        candidates = [*self._active.values(), *reversed(self._finished.values())]
        for record in candidates:
            if state is not None and record.state != state:
                continue
            if worker is not None and worker not in (record.source, record.destination):
                continue
            found.append(record)
            if limit is not None and len(found) >= limit:
                break
        return found

    def counts(self) -> dict[str, int]:
        """Number of records per state (active and remembered)."""
        counts = {state.value: 0 for state in TransferState}
        for record in self:
            counts[record.state.value] += 1
        return counts

    @property
    def active_count(self) -> int:
        return len(self._active)
