"""How a worker's control API answers errors: a JSON body with a failure kind the remote
executor maps back to a :class:`~topkv.relay.transfers.FailureKind` (and how a medium that
fails to start becomes that medium's transport failure)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from topkv.errors import TopKVError
from topkv.relay.executor import classify_failure
from topkv.service.compute.engines import EngineRequestError
from topkv.service.errors import ServiceError
from topkv.service.http.util import error_middleware
from topkv.service.kvstore import CapacityExceeded, PrefillFailed, UnknownKV
from topkv.transport.errors import TransferTimeout, TransportError, TransportUnavailable

T = TypeVar("T")


def made_medium(make: Callable[[bytes], T], secret: bytes, medium: str, what: str) -> T:
    """``make(secret)``; a library that fails to start is this medium's transport failure."""
    try:
        return make(secret)
    except TransportError:
        raise
    except Exception as exc:  # e.g. a NIXL agent that cannot start here
        raise TransportUnavailable(f"{medium} {what} failed to start: {exc!r}") from exc


def _special_error(exc: TopKVError) -> tuple[int, str] | None:
    if not isinstance(exc, TransportError):
        return None
    return (504 if isinstance(exc, TransferTimeout) else 502), classify_failure(exc).value


#: TopKV errors become JSON answers with a failure kind the executor understands.
worker_error_middleware = error_middleware(
    (
        (UnknownKV, 404, "not_found"),
        (CapacityExceeded, 409, "capacity"),
        (EngineRequestError, 400, "bad_request"),
        (PrefillFailed, 502, "source_lost"),
        (ServiceError, 500, "internal"),
    ),
    _special_error,
)
