"""The demo's workload: requests replayed from the Azure LLM inference trace 2023.

Prompt lengths are mapped into the small model's range on a log scale (the shortest trace
prompt of the window becomes ``min_tokens``, the longest ``max_tokens``, order preserved);
arrival times are compressed by ``speedup``. Each request gets a deterministic prompt
(:func:`topkv.engine.prompt_token_ids`) seeded by the demo seed and its index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from topkv.demo.errors import DemoError
from topkv.errors import ConfigError
from topkv.inputs import InputFileError
from topkv.packaged import SAMPLE_TRACE
from topkv.traces import TraceFormatError, read_azure_csv

#: The packaged sample: the Azure 2023 conversation trace's first 4,000 requests.
DEFAULT_TRACE = SAMPLE_TRACE


@dataclass(frozen=True)
class DemoRequest:
    """One replayed request."""

    rid: int
    arrival_s: float  # seconds after the demo starts submitting
    prompt_len: int  # tokens, scaled into the model's range
    trace_prompt_tokens: int  # ContextTokens in the trace
    trace_output_tokens: int  # GeneratedTokens in the trace
    prompt_seed: int  # seed of the prompt's token ids


def find_trace(explicit: Path | None = None) -> Path:
    """The trace file: ``explicit``, else the sample shipped in the package."""
    if explicit is None:
        return DEFAULT_TRACE
    if not explicit.is_file():
        raise DemoError(f"{explicit}: no such file; pass --trace FILE (an Azure 2023 trace CSV)")
    return explicit


def scale_length(tokens: int, low: int, high: int, min_tokens: int, max_tokens: int) -> int:
    """Map ``tokens`` in ``[low, high]`` onto ``[min_tokens, max_tokens]`` on a log scale."""
    if high <= low:
        return max_tokens if low > 0 else min_tokens
    position = math.log(tokens / low) / math.log(high / low)
    scaled: float = min_tokens * (max_tokens / min_tokens) ** min(1.0, max(0.0, position))
    return round(scaled)


def load_requests(
    trace: Path,
    count: int,
    *,
    seed: int,
    min_tokens: int = 128,
    max_tokens: int = 1024,
    speedup: float = 2.0,
    start: int = 0,
) -> list[DemoRequest]:
    """``count`` requests of ``trace`` from its ``start``-th (0-based; default its first),
    scaled for the demo model; arrivals count from the first of them."""
    if count < 1:
        raise DemoError(f"--requests must be >= 1, got {count}")
    if start < 0:
        raise DemoError(f"--trace-start must be >= 0, got {start}")
    if not 1 <= min_tokens <= max_tokens:
        raise DemoError(f"prompt range [{min_tokens}, {max_tokens}] is empty")
    if not (math.isfinite(speedup) and speedup > 0):
        raise DemoError(f"speedup must be a positive number, got {speedup}")
    try:
        workload = read_azure_csv(trace)
    except (TraceFormatError, InputFileError) as exc:
        where = exc.path if exc.line is None else f"{exc.path}:{exc.line}"
        raise DemoError(f"{where}: cannot read the trace: {exc.reason}") from None
    except (ConfigError, OSError) as exc:
        raise DemoError(f"{trace}: cannot read the trace: {exc}") from None
    rows = workload.requests[start : start + count]
    if len(rows) < count:
        have = len(workload.requests)
        raise DemoError(
            f"the trace {trace} has {have} requests: none left for {count} from request {start}"
            if start
            else f"the trace {trace} has {have} requests, fewer than {count}"
        )
    low = min(r.input_tokens for r in rows)
    high = max(r.input_tokens for r in rows)
    first_s = rows[0].arrival_s
    return [
        DemoRequest(
            rid=index,
            arrival_s=(row.arrival_s - first_s) / speedup,
            prompt_len=scale_length(row.input_tokens, low, high, min_tokens, max_tokens),
            trace_prompt_tokens=row.input_tokens,
            trace_output_tokens=row.output_tokens,
            prompt_seed=seed * 1_000_003 + index,
        )
        for index, row in enumerate(rows)
    ]
