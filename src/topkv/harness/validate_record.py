"""The record of a live demo run (``topkv demo --json``), read strictly.

:class:`DemoRecord` is what :mod:`topkv.harness.validate_live` validates the simulator
against: every request's measured times, route and (in newer records) arrival and prompt
length; errors name the file, the request and the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from topkv.inputs import InputFileError, load_json
from topkv.sim.errors import SimError


class LiveValidationError(SimError):
    """The demo record cannot be validated against (malformed, or other demo settings)."""


# -- the demo's record ---------------------------------------------------------------------


@dataclass(frozen=True)
class DemoMeasurement:
    """One request of ``topkv demo --json`` (wall-clock ms on the demo's host).

    The optional fields are newer than issue #6's list; older records lack them.
    """

    id: int
    transport: str
    bytes: int
    prefill_ms: float
    exposed_ms: float
    ttft_ms: float
    decode_ms: float | None = None
    arrival_ms: float | None = None
    prompt_len: int | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None
    queue_ms: float | None = None


@dataclass(frozen=True)
class DemoRecord:
    """A recorded demo run: its requests, the time dilation and any recorded options."""

    requests: tuple[DemoMeasurement, ...]
    dilation: float
    options: Mapping[str, Any] = field(default_factory=dict)
    source: str = "<demo json>"

    @classmethod
    def load(cls, path: Path) -> DemoRecord:
        try:
            data = load_json(path, what="a topkv demo --json record", invalid="not JSON")
        except InputFileError as exc:
            raise LiveValidationError(str(exc)) from None
        return cls.from_json(data, str(path))

    @classmethod
    def from_json(cls, data: Any, source: str = "<demo json>") -> DemoRecord:
        """Parse ``topkv demo --json`` output; errors name the request and the field."""
        if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
            raise LiveValidationError(f"{source}: expected topkv demo --json output")
        summary = data.get("summary")
        try:
            dilation = float(summary["emulation"]["dilation"])  # type: ignore[index]
        except (TypeError, KeyError, ValueError):
            raise LiveValidationError(f"{source}: no summary.emulation.dilation") from None
        if not (math.isfinite(dilation) and 1 <= dilation <= _RECORD_MAX):
            raise LiveValidationError(
                f"{source}: dilation must be >= 1 and <= {_RECORD_MAX:g}, got {dilation}"
            )
        rows = [_measurement(row, i, source) for i, row in enumerate(data["requests"])]
        if not rows:
            raise LiveValidationError(f"{source}: the record has no requests")
        ids = [m.id for m in rows]
        if len(set(ids)) != len(ids):
            raise LiveValidationError(f"{source}: request ids are not unique")
        options = data.get("options")
        options = dict(options) if isinstance(options, dict) else {}
        for key, low in (("requests", 1), ("seed", 0), ("new_tokens", 1), ("speedup", 1e-3)):
            value = options.get(key)
            high = _RECORD_BOUNDS.get(key, _RECORD_MAX)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not low <= value <= high
                or (key != "speedup" and value != int(value))
            ):
                kind = "a number" if key == "speedup" else "an integer"
                raise LiveValidationError(
                    f"{source}: options.{key} must be {kind} in [{low:g}, {high:g}]"
                )
        return cls(tuple(rows), dilation, options, source)

    @property
    def has_requests(self) -> bool:
        """Every request carries its arrival and prompt length (no rebuild needed)."""
        return all(m.arrival_ms is not None and m.prompt_len is not None for m in self.requests)

    @property
    def has_timeline(self) -> bool:
        """Every request's prefill and decode intervals follow from the record."""
        return self.has_requests and all(
            m.queue_ms is not None
            and m.decode_ms is not None
            and math.isfinite(m.prefill_ms)
            and math.isfinite(m.ttft_ms)
            for m in self.requests
        )


#: Largest magnitude of a demo record's times (ms), counts and options (except these keys):
#: far beyond any run, and small enough that the simulated horizon -- hence the memory of
#: the simulation -- stays bounded whatever the file says.
_RECORD_MAX = 1e7
_RECORD_BOUNDS = {"bytes": 1e13, "seed": 2.0**63}


def _measurement(row: Any, index: int, source: str) -> DemoMeasurement:
    where = f"{source}: requests[{index}]"
    if not isinstance(row, dict):
        raise LiveValidationError(f"{where}: expected an object")

    def number(key: str, optional: bool = False) -> float:
        value = row.get(key)
        if value is None and (optional or key in row):
            return math.nan  # the demo writes null for a request it could not measure
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise LiveValidationError(f"{where}: {key} must be a number, got {value!r}")
        bound = _RECORD_BOUNDS.get(key, _RECORD_MAX)
        if not abs(value) <= bound:
            raise LiveValidationError(
                f"{where}: {key} {value:g} is out of range (at most {bound:g})"
            )
        return float(value)

    def optional(key: str) -> float | None:
        value = number(key, optional=True)
        return None if math.isnan(value) else value

    def worker(key: str) -> str | None:
        value = row.get(key)
        if value is None or value == "":
            return None
        if not isinstance(value, str):
            raise LiveValidationError(f"{where}: {key} must be a string, got {value!r}")
        return value

    rid, nbytes = number("id"), number("bytes")
    if not (math.isfinite(rid + nbytes) and rid == int(rid) >= 0 and nbytes == int(nbytes) >= 0):
        raise LiveValidationError(f"{where}: id and bytes must be non-negative integers")
    prompt_len = optional("prompt_len")
    if prompt_len is not None and not (prompt_len == int(prompt_len) and prompt_len >= 1):
        raise LiveValidationError(f"{where}: prompt_len must be a positive integer")
    arrival = optional("arrival_ms")
    if arrival is not None and not (math.isfinite(arrival) and arrival >= 0):
        raise LiveValidationError(f"{where}: arrival_ms must be >= 0, got {arrival}")
    return DemoMeasurement(
        id=int(rid),
        transport=str(row.get("transport") or ""),
        bytes=int(nbytes),
        prefill_ms=number("prefill_ms"),
        exposed_ms=number("exposed_ms"),
        ttft_ms=number("ttft_ms"),
        decode_ms=optional("decode_ms"),
        arrival_ms=arrival,
        prompt_len=None if prompt_len is None else int(prompt_len),
        prefill_worker=worker("prefill_worker"),
        decode_worker=worker("decode_worker"),
        queue_ms=optional("queue_ms"),
    )
