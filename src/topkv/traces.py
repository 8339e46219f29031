"""Request workloads: trace readers, synthetic arrivals and rate scaling.

A bottom-layer module (it imports only :mod:`topkv.inputs` and :mod:`topkv.errors`): the
simulator (:mod:`topkv.sim`) and the demo (:mod:`topkv.demo.workload`) both read traces
through it. Readers for the Azure 2023 CSV (:func:`read_azure_csv`), Mooncake JSON lines
(:func:`read_mooncake_jsonl`) and ServeGen rate files or tables (:func:`read_servegen`), plus
:func:`synthetic`, :func:`scale_rate` and :func:`load_trace`; bad input raises
:class:`TraceFormatError` or :class:`TraceError`. The formats: docs/simulator.md ("Workloads").
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import re
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from topkv.errors import ConfigError
from topkv.inputs import MAX_LINE_BYTES, InputFileError, excerpt, text_lines


class TraceError(ConfigError):
    """A trace cannot be read or a workload cannot be built as asked."""


class TraceFormatError(TraceError):
    """A trace file is malformed; the message names the file and the line."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        self.path = path
        self.line = line
        self.reason = reason
        super().__init__(f"{path}:{line}: {reason}")


@dataclass(frozen=True, slots=True)
class Request:
    """One inference request: arrival time (s from trace start) and token counts."""

    rid: int
    arrival_s: float
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Workload:
    """Requests sorted by arrival, with where they came from."""

    name: str
    requests: tuple[Request, ...]

    @property
    def duration_s(self) -> float:
        if not self.requests:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    def __len__(self) -> int:
        return len(self.requests)


def _finish(name: str, rows: list[tuple[float, int, int]]) -> Workload:
    rows.sort(key=lambda r: r[0])
    start = rows[0][0] if rows else 0.0
    requests = tuple(Request(i, t - start, inp, out) for i, (t, inp, out) in enumerate(rows))
    return Workload(name, requests)


#: Longest time a trace file may span: the traces are an hour or a week; the simulator's
#: per-link utilization is kept per second of simulated time, so a far-off timestamp in a
#: three-line file must not make it allocate years of bins.
MAX_TRACE_SPAN_S = 7 * 86400.0


def _check_span(path: Path, rows: list[tuple[float, int, int]]) -> None:
    times = [t for t, _, _ in rows]
    span = max(times) - min(times)
    if not span <= MAX_TRACE_SPAN_S:
        raise InputFileError(
            path,
            f"the trace spans {span / 86400:.4g} days, more than the "
            f"{MAX_TRACE_SPAN_S / 86400:g} the simulator replays (a timestamp out of range?)",
        )


def _positive_int(path: str, line: int, field: str, text: str, minimum: int = 0) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise TraceFormatError(path, line, f"{field} {excerpt(text)} is not an integer") from None
    if value < minimum:
        raise TraceFormatError(path, line, f"{field} {value} is below {minimum}")
    return value


# -- Azure 2023 ------------------------------------------------------------------------

AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_AZURE_TS = re.compile(r"^(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:\.(\d+))?$")


def _azure_time(path: str, line: int, text: str) -> float:
    match = _AZURE_TS.match(text.strip())
    if not match:
        raise TraceFormatError(
            path, line, f"timestamp {excerpt(text)} is not YYYY-MM-DD HH:MM:SS[.f]"
        )
    try:
        whole = datetime.fromisoformat(match.group(1)).timestamp()
    except (ValueError, OverflowError, OSError) as exc:
        raise TraceFormatError(path, line, f"timestamp {excerpt(text)}: {exc}") from None
    frac = match.group(2)
    return whole + (int(frac) / 10 ** len(frac) if frac else 0.0)


def read_azure_csv(path: Path) -> Workload:
    """Read an Azure LLM inference trace 2023 CSV (code or conversation)."""
    name = str(path)
    rows: list[tuple[float, int, int]] = []
    reader = csv.reader(_lines(path))
    with _csv_errors(name, reader):
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header) != AZURE_HEADER:
            got = excerpt(",".join(header)) if header is not None else "nothing"
            raise TraceFormatError(name, 1, f"expected header {','.join(AZURE_HEADER)}, got {got}")
        for row in reader:
            line = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != 3:
                raise TraceFormatError(name, line, f"expected 3 fields, got {len(row)}")
            t = _azure_time(name, line, row[0])
            inp = _positive_int(name, line, "ContextTokens", row[1], 1)
            out = _positive_int(name, line, "GeneratedTokens", row[2], 1)
            rows.append((t, inp, out))
    if not rows:
        raise TraceFormatError(name, 2, "the trace has no requests")
    _check_span(path, rows)
    return _finish(f"azure:{path.name}", rows)


# -- Mooncake ------------------------------------------------------------------------


def read_mooncake_jsonl(path: Path, jitter_s: float = 3.0, seed: int = 0) -> Workload:
    """Read a Mooncake trace; spread each quantized timestamp over ``jitter_s`` seconds."""
    if jitter_s < 0:
        raise TraceError(f"jitter must be >= 0 s, got {jitter_s}")
    name = str(path)
    rng = np.random.default_rng(seed)
    rows: list[tuple[float, int, int]] = []
    for line, text in enumerate(_lines(path), start=1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(name, line, f"invalid JSON: {exc.msg}") from None
        except (ValueError, RecursionError) as exc:  # a 4300+ digit integer, deep nesting
            raise TraceFormatError(name, line, f"invalid JSON: {exc}") from None
        if not isinstance(record, dict):
            raise TraceFormatError(name, line, "expected a JSON object")
        fields = []
        for key in ("timestamp", "input_length", "output_length"):
            value = record.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TraceFormatError(name, line, f"{key!r} missing or not a number")
            if not math.isfinite(value) or value < 0:
                raise TraceFormatError(name, line, f"{key!r} = {value} is not a finite number >= 0")
            fields.append(value)
        ts_ms, inp, out = fields
        if inp < 1 or out < 1:
            raise TraceFormatError(name, line, "input_length and output_length must be >= 1")
        t = ts_ms / 1000.0 + (rng.uniform(0.0, jitter_s) if jitter_s else 0.0)
        rows.append((t, int(inp), int(out)))
    if not rows:
        raise TraceFormatError(name, 1, "the trace has no requests")
    _check_span(path, rows)
    return _finish(f"mooncake:{path.name}", rows)


# -- ServeGen ------------------------------------------------------------------------


@dataclass(frozen=True)
class ServeGenOptions:
    """Which part of the (two-week) rate files to turn into requests, and lengths."""

    start_s: float | None = None  # None: the first window in which any client sends
    duration_s: float = 600.0
    input_median: int = 1024
    input_sigma: float = 1.0
    output_median: int = 256
    output_sigma: float = 1.0
    max_tokens: int = 32768
    seed: int = 0
    #: Every client's rate multiplied by this (its inter-arrival shape, hence its
    #: burstiness, kept): the rates scaled to a cluster.
    rate_scale: float = 1.0


#: The header of a ServeGen rate table: every client's windows in one CSV.
SERVEGEN_TABLE_HEADER = ("client", "window_start_s", "rate_rps", "distribution", "shape")

#: One window of one client: start (s), mean rate (req/s), distribution, shape.
Window = tuple[float, float, str, float]


def _servegen_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(path.glob("*-trace.csv")) or sorted(path.glob("*.csv"))
        if not files:
            raise TraceError(f"{path}: no ServeGen rate files (*-trace.csv) in this directory")
        return files
    return [path]


def _is_table(path: Path) -> bool:
    first = next(_lines(path, "a ServeGen rate table"), "")
    return tuple(c.strip() for c in first.split(",")) == SERVEGEN_TABLE_HEADER


def servegen_clients(path: Path) -> list[list[Window]]:
    """Each client's windows: from a rate table, or one rate file each (a file or a
    directory of them)."""
    if path.is_file() and _is_table(path):
        return _servegen_table(path)
    return [_servegen_windows(file) for file in _servegen_files(path)]


def servegen_profile(path: Path) -> list[tuple[float, float]]:
    """``(window_start_s, total rate)``: the rates of all clients summed per window start."""
    totals: dict[float, float] = {}
    for windows in servegen_clients(path):
        for start, rate, _, _ in windows:
            totals[start] = totals.get(start, 0.0) + rate
    return sorted(totals.items())


#: Most requests one ServeGen window may generate (rate x window length): memory stays
#: bounded whatever the rate file says.
MAX_WINDOW_REQUESTS = 10_000_000


def read_servegen(path: Path, options: ServeGenOptions | None = None) -> Workload:
    """Turn ServeGen per-client rate files (a file or a directory of them) into requests."""
    opts = options or ServeGenOptions()
    if opts.duration_s <= 0:
        raise TraceError(f"ServeGen duration must be > 0 s, got {opts.duration_s}")
    if not (opts.rate_scale > 0 and math.isfinite(opts.rate_scale)):
        raise TraceError(f"ServeGen rate scale must be a finite number > 0, got {opts.rate_scale}")
    rng = np.random.default_rng(opts.seed)
    per_file = servegen_clients(path)
    start_s = opts.start_s
    if start_s is None:
        active = [w[0] for windows in per_file for w in windows if w[1] > 0]
        start_s = min(active) if active else 0.0
    end_s = start_s + opts.duration_s
    arrivals: list[np.ndarray] = []
    for windows in per_file:
        for i, (start, rate, dist, shape) in enumerate(windows):
            rate *= opts.rate_scale
            stop = windows[i + 1][0] if i + 1 < len(windows) else start + _default_window(windows)
            lo, hi = max(start, start_s), min(stop, end_s)
            if rate <= 0 or hi <= lo:
                continue
            if (stop - start) * rate > MAX_WINDOW_REQUESTS:
                raise TraceError(
                    f"{path}: the window at {start:g} s asks for {(stop - start) * rate:.3g} "
                    f"requests, more than the {MAX_WINDOW_REQUESTS:,} one window may replay"
                )
            arrivals.append(_renewal_arrivals(rng, dist, shape, rate, start, stop, lo, hi))
    times = np.sort(np.concatenate(arrivals)) if arrivals else np.empty(0)
    if times.size == 0:
        raise TraceError(
            f"{path}: no requests between {start_s:g} s and {end_s:g} s "
            "(choose another window with --servegen-start-s)"
        )
    n = times.size
    inp = _lognormal_tokens(rng, opts.input_median, opts.input_sigma, n, opts.max_tokens)
    out = _lognormal_tokens(rng, opts.output_median, opts.output_sigma, n, opts.max_tokens)
    rows = [(float(t), int(a), int(b)) for t, a, b in zip(times, inp, out, strict=True)]
    scaled = "" if opts.rate_scale == 1.0 else f"x{opts.rate_scale:g}"
    return _finish(f"servegen:{path.name}{scaled}", rows)


def _default_window(windows: list[Window]) -> float:
    if len(windows) >= 2:
        return windows[1][0] - windows[0][0]
    return 600.0


def _servegen_windows(file: Path) -> list[Window]:
    name = str(file)
    out: list[Window] = []
    reader = csv.reader(_lines(file, "a ServeGen rate CSV"))
    with _csv_errors(name, reader):
        for row in reader:
            line = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != 6:
                raise TraceFormatError(
                    name,
                    line,
                    f"expected 6 fields (start,rate,cv,distribution,shape,scale), got {len(row)}",
                )
            try:
                float(row[2]), float(row[5] or 0)
            except ValueError:
                raise TraceFormatError(name, line, "a numeric field is not a number") from None
            _add_window(name, line, out, row[0], row[1], row[3], row[4])
    if not out:
        raise TraceFormatError(name, 1, "the rate file has no rows")
    return out


def _servegen_table(file: Path) -> list[list[Window]]:
    """A rate table's windows per client (in the order the clients first appear)."""
    name = str(file)
    clients: dict[str, list[Window]] = {}
    reader = csv.reader(_lines(file, "a ServeGen rate table"))
    with _csv_errors(name, reader):
        next(reader)  # the header (checked by the caller)
        for row in reader:
            line = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != len(SERVEGEN_TABLE_HEADER):
                raise TraceFormatError(
                    name, line, f"expected 5 fields ({','.join(SERVEGEN_TABLE_HEADER)})"
                )
            client = row[0].strip()
            if not client:
                raise TraceFormatError(name, line, "the client is empty")
            _add_window(name, line, clients.setdefault(client, []), *row[1:])
    if not clients:
        raise TraceFormatError(name, 2, "the rate table has no rows")
    return list(clients.values())


def _add_window(
    name: str, line: int, out: list[Window], start_t: str, rate_t: str, dist_t: str, shape_t: str
) -> None:
    """Check one window of a client and append it to ``out`` (its earlier windows)."""
    try:
        start, rate = float(start_t), float(rate_t)
        shape = float(shape_t) if shape_t.strip() else 0.0
    except ValueError:
        raise TraceFormatError(name, line, "a numeric field is not a number") from None
    dist = dist_t.strip()
    if not all(math.isfinite(v) for v in (start, rate, shape)) or rate < 0:
        raise TraceFormatError(name, line, "start, rate and shape must be finite, rate >= 0")
    if rate > 0:
        if dist not in ("Gamma", "Weibull", "Exponential"):
            raise TraceFormatError(
                name, line, f"distribution {excerpt(dist)} is not Gamma, Weibull or Exponential"
            )
        if dist != "Exponential" and shape <= 0:
            raise TraceFormatError(name, line, f"{dist} shape {shape} must be > 0")
    if out and start <= out[-1][0]:
        raise TraceFormatError(name, line, "window starts must increase")
    out.append((start, rate, dist, shape))


def _renewal_arrivals(
    rng: np.random.Generator,
    dist: str,
    shape: float,
    rate: float,
    start: float,
    stop: float,
    lo: float,
    hi: float,
) -> np.ndarray:
    """Arrivals of a renewal process of mean rate ``rate`` over [start, stop), kept in [lo, hi)."""
    mean = 1.0 / rate
    expected = int((stop - start) * rate * 1.5) + 16
    if dist == "Gamma":
        gaps = rng.gamma(shape, mean / shape, expected)
    elif dist == "Weibull":
        gaps = rng.weibull(shape, expected) * (mean / math.gamma(1.0 + 1.0 / shape))
    else:
        gaps = rng.exponential(mean, expected)
    # start at a random phase so windows do not all begin with an arrival
    times = start + rng.uniform(0.0, mean) + np.concatenate(([0.0], np.cumsum(gaps[:-1])))
    while times[-1] < stop:
        more = rng.exponential(mean, expected)
        times = np.concatenate((times, times[-1] + np.cumsum(more)))
    return times[(times >= lo) & (times < hi)]


def _lognormal_tokens(
    rng: np.random.Generator, median: int, sigma: float, n: int, cap: int
) -> np.ndarray:
    values = rng.lognormal(math.log(max(median, 1)), sigma, n)
    return np.clip(np.rint(values), 1, cap).astype(np.int64)


# -- synthetic -----------------------------------------------------------------------


def synthetic(
    num_requests: int,
    rate_rps: float,
    input_tokens: int = 1024,
    output_tokens: int = 128,
    cv: float = 1.0,
    seed: int = 0,
    length_sigma: float = 0.0,
) -> Workload:
    """Poisson (``cv`` = 1) or Gamma arrivals with fixed or log-normal lengths."""
    if num_requests < 1 or rate_rps <= 0 or cv <= 0:
        raise TraceError("synthetic workload needs num_requests >= 1, rate > 0 and cv > 0")
    rng = np.random.default_rng(seed)
    mean = 1.0 / rate_rps
    if cv == 1.0:
        gaps = rng.exponential(mean, num_requests)
    else:
        shape = 1.0 / (cv * cv)
        gaps = rng.gamma(shape, mean / shape, num_requests)
    times = np.cumsum(gaps) - gaps[0]
    if length_sigma > 0:
        inp = _lognormal_tokens(rng, input_tokens, length_sigma, num_requests, 1 << 20)
        out = _lognormal_tokens(rng, output_tokens, length_sigma, num_requests, 1 << 20)
    else:
        inp = np.full(num_requests, input_tokens)
        out = np.full(num_requests, output_tokens)
    rows = [(float(t), int(a), int(b)) for t, a, b in zip(times, inp, out, strict=True)]
    kind = "poisson" if cv == 1.0 else f"gamma-cv{cv:g}"
    return _finish(f"synthetic:{kind}@{rate_rps:g}rps", rows)


# -- scaling and dispatch ------------------------------------------------------------


def scale_rate(workload: Workload, factor: float) -> Workload:
    """Multiply the request rate by ``factor`` (arrival times divided by it)."""
    if not factor > 0 or math.isinf(factor):
        raise TraceError(f"rate scale must be a finite number > 0, got {factor}")
    if factor == 1.0:
        return workload
    requests = tuple(
        Request(r.rid, r.arrival_s / factor, r.input_tokens, r.output_tokens)
        for r in workload.requests
    )
    return Workload(f"{workload.name}x{factor:g}", requests)


def head(workload: Workload, count: int) -> Workload:
    """The first ``count`` requests."""
    return Workload(workload.name, workload.requests[:count])


def detect_format(path: Path) -> str:
    """``azure``, ``mooncake`` or ``servegen`` from the path and its first line."""
    if not path.exists():
        raise TraceError(f"{path}: no such trace file")
    if path.is_dir():
        return "servegen"
    first = next(_lines(path), "")
    if first.lstrip().startswith("{"):
        return "mooncake"
    if first.replace(" ", "").startswith("TIMESTAMP,"):
        return "azure"
    if first.count(",") == 5 or first.startswith("client,window_start_s,"):
        return "servegen"
    raise TraceError(
        f"{path}: cannot tell the trace format from its first line {first[:60]!r}; expected "
        "an Azure 2023 CSV, a Mooncake JSONL or a ServeGen rate CSV"
    )


def load_trace(
    path: Path,
    fmt: str = "auto",
    jitter_s: float = 3.0,
    seed: int = 0,
    servegen: ServeGenOptions | None = None,
) -> Workload:
    """Read any supported trace; ``fmt`` is ``auto``, ``azure``, ``mooncake`` or ``servegen``."""
    kind = detect_format(path) if fmt == "auto" else fmt
    if kind == "azure":
        return read_azure_csv(path)
    if kind == "mooncake":
        return read_mooncake_jsonl(path, jitter_s=jitter_s, seed=seed)
    if kind == "servegen":
        return read_servegen(path, servegen)
    raise TraceError(f"unknown trace format {fmt!r}; use auto, azure, mooncake or servegen")


_TRACE = "a trace (Azure 2023 CSV, Mooncake JSONL or ServeGen rate CSV)"


def _lines(path: Path, what: str = _TRACE) -> Iterator[str]:
    """The trace's lines, strict UTF-8 (:func:`topkv.inputs.text_lines`); a ``.gz`` file
    decompressed first."""
    if path.name.endswith(".gz"):
        return _gzip_lines(path, what)
    return text_lines(path, what=what)


def _gzip_lines(path: Path, what: str) -> Iterator[str]:
    try:
        with gzip.open(path, "rt", encoding="utf-8", errors="strict", newline="") as handle:
            number = 0
            while line := handle.readline(MAX_LINE_BYTES + 1):
                number += 1
                if len(line) > MAX_LINE_BYTES:
                    raise InputFileError(path, f"line too long; expected {what}", number)
                yield line
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as exc:
        raise InputFileError(path, f"not a readable gzip file ({exc}); expected {what}") from None


@contextmanager
def _csv_errors(name: str, reader: Any) -> Iterator[None]:
    """A ``csv.Error`` (a field over the csv module's limit, a stray quote) as a
    :class:`TraceFormatError` on the line the reader had reached."""
    try:
        yield
    except csv.Error as exc:
        reason = str(exc)
        if "field larger than field limit" in reason:
            reason = f"a field is longer than {csv.field_size_limit():,} characters"
        raise TraceFormatError(name, max(reader.line_num, 1), f"malformed CSV: {reason}") from None
