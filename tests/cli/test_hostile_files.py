"""Every file-taking command fails cleanly on a hostile file (issue 11, item 3).

The commands: ``plan --config``, ``discover`` (each probe-file option, and ``--from DIR``),
``select --topology``, ``sim --trace/--cluster/--config``, ``demo --trace`` and
``sim-validate --demo-json/--calibrate-from/--trace``. The files: empty, random bytes, NUL
bytes, non-UTF-8 text, truncated JSON, JSON with wrong types, a YAML alias bomb, one 8 MiB
line, a CSV with only a header, unparseable dates, numbers like 1e400 (and deep nesting),
then hypothesis-drawn bytes and JSON documents.

Cleanly: exit status 2 and exactly one stderr line ``topkv: error: FILE...`` (FILE = the
path given), no traceback, no hang, and (for the fixed files) memory bounded by the
input's size. The CLI runs in-process through :func:`topkv.cli.main.app`, as the console
script does; the demo's worker/model stage is patched to fail the test if it is reached.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from topkv.cli import main
from topkv.cli.discover import FILE_FLAGS
from topkv.demo.runner import DemoRun
from topkv.engine import model_extra_available
from topkv.topology.build import discover_from_files
from topkv.topology.model import Cluster
from topkv.topology.probes import PROBES

TESTS = Path(__file__).resolve().parents[1]
H100_TOPO = TESTS / "fixtures" / "nvidia-smi-topo" / "sglang-30401-h100-8gpu-nv18-8nic.txt"
DEMO_RECORD = TESTS / "sim" / "data" / "demo_record_50.json"
MiB = 1 << 20
#: ``discover --from DIR`` runs every probe kind's parser on what DIR holds; the fixed files
#: go in as these kinds (a table, a key-value and a YAML/JSON parser), drawn ones as any kind.
FROM_KINDS = ("nvidia-smi-topo", "lscpu", "k8s-node")
ALL_KINDS = tuple(FILE_FLAGS.values())
#: The files whose memory use is traced (tracemalloc is slow): the big and the expanding ones.
MEMORY_KINDS = {"yaml-bomb", "long-line-csv", "long-line-json", "deep", "huge-cluster",
                "huge-config"}  # fmt: skip
#: Seconds one invocation may take: far above any clean failure (milliseconds), far below
#: a hang.
SLOW_S = 30.0

GOOD_TRACE = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    "2023-11-16 18:15:46.6805900,374,44\n"
    "2023-11-16 18:15:50.9951690,396,109\n"
)
GOOD_CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "vocab_size": 128256,
}
GOOD_CLUSTER = "node_groups:\n  - {count: 2, gpu: H100, gpus_per_node: 8, nics_per_node: 8}\n"
BOMB = (
    'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    + "".join(
        f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n"
        for a, b in zip("abcdefgh", "bcdefghi", strict=True)
    )
    + "node_groups: *i\n"
)


# -- running the CLI -----------------------------------------------------------------------


def run_cli(args: list[str]) -> tuple[int, str, str]:
    """``topkv ARGS`` in-process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    code: int | str | None = 0
    with (
        mock.patch.object(sys, "argv", ["topkv", *args]),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        # the demo must refuse the trace before it starts workers or loads a model
        mock.patch.object(DemoRun, "run", side_effect=AssertionError("demo reached its run")),
    ):
        try:
            main.app()
        except SystemExit as exc:
            code = exc.code
    return (code if isinstance(code, int) else 1), out.getvalue(), err.getvalue()


def assert_clean(args: list[str], path: Path) -> str:
    """Run ``args`` and check the clean-failure contract; return the error line."""
    started = time.perf_counter()
    rc, _out, err = run_cli(args)
    elapsed = time.perf_counter() - started
    where = f"topkv {' '.join(args)}"
    assert "Traceback" not in err, f"{where}:\n{err}"
    lines = err.splitlines()
    assert rc == 2, f"{where}: exit {rc}, stderr {err[:500]!r}"
    assert len(lines) == 1, f"{where}: stderr is not one line: {err[:500]!r}"
    assert lines[0].startswith(f"topkv: error: {path}"), f"{where}: {lines[0][:300]!r}"
    assert elapsed < SLOW_S, f"{where}: took {elapsed:.1f} s"
    return lines[0]


# -- the commands --------------------------------------------------------------------------


Command = Callable[[Path], tuple[list[str], Path]]  # hostile file -> (args, path named)


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Valid companion inputs: a trace, a topology, demo records (with and without arrivals)."""
    base = tmp_path_factory.mktemp("good")
    trace = base / "trace.csv"
    trace.write_text(GOOD_TRACE)
    node = discover_from_files({"nvidia-smi-topo": H100_TOPO}, name="node0", gpu_name="H100")
    topology = base / "topology.json"
    topology.write_text(json.dumps(Cluster(nodes=[node]).model_dump(mode="json")))
    record = json.loads(DEMO_RECORD.read_text())
    keys = ("id", "transport", "bytes", "prefill_ms", "exposed_ms", "ttft_ms")
    plain = {"requests": [{k: r[k] for k in keys} for r in record["requests"]]}
    plain["summary"] = record["summary"]
    plain_path = base / "plain_record.json"
    plain_path.write_text(json.dumps(plain))
    return {"trace": trace, "topology": topology, "record": DEMO_RECORD, "plain": plain_path}


def commands(good: dict[str, Path], from_kinds: tuple[str, ...] = FROM_KINDS) -> dict[str, Command]:
    """Every file-taking command, keyed by a label, with the hostile file in its place
    (``discover --from DIR``: a directory holding it as the output of each of ``from_kinds``)."""

    def plain(*args: str) -> Command:
        return lambda f: ([a.replace("{F}", str(f)) for a in args], f)

    table: dict[str, Command] = {
        "plan --config": plain("plan", "--config", "{F}"),
        "select --topology": plain(
            "select", "--topology", "{F}", "--src", "node0:0", "--dst", "node0:1", "-b", "1GB"
        ),
        "sim --trace": plain("sim", "--trace", "{F}", "--limit", "2"),
        "sim --cluster": plain("sim", "--trace", str(good["trace"]), "--cluster", "{F}"),
        "sim --config": plain("sim", "--trace", str(good["trace"]), "--config", "{F}"),
        "demo --trace": plain("demo", "--trace", "{F}", "--requests", "2"),
        "sim-validate --demo-json": plain("sim-validate", "--demo-json", "{F}"),
        "sim-validate --calibrate-from": plain(
            "sim-validate", "--demo-json", str(good["record"]), "--calibrate-from", "{F}"
        ),
        "sim-validate --trace": plain(
            "sim-validate", "--demo-json", str(good["plain"]), "--trace", "{F}"
        ),
    }
    for kind in FILE_FLAGS.values():
        table[f"discover --{kind}"] = plain("discover", f"--{kind}", "{F}")
    for kind in from_kinds:
        table[f"discover --from ({kind})"] = _from_dir(kind)
    return table


def _from_dir(kind: str) -> Command:
    def command(hostile: Path) -> tuple[list[str], Path]:
        directory = hostile.parent / f"from-{kind}-{hostile.stem}"
        directory.mkdir(exist_ok=True)
        (directory / PROBES[kind].files[0]).write_bytes(hostile.read_bytes())
        return ["discover", "--from", str(directory)], directory

    return command


# -- the hostile files ---------------------------------------------------------------------


def _random_bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def hostile_files(good: dict[str, Path]) -> dict[str, bytes]:
    """Each kind the issue names (several shapes of some), as bytes."""
    topology = good["topology"].read_text()
    record = json.loads(good["record"].read_text())
    wrong_record = {**record, "requests": [{**record["requests"][0], "id": "zero"}]}
    wrong_options = {**record, "options": {"seed": "zero", "requests": [50]}}
    big_record = json.loads(json.dumps(record))
    big_record["summary"]["emulation"]["dilation"] = "__INF__"
    header = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    return {
        "empty": b"",
        "blank": b" \n\n\t\n",
        "random": _random_bytes(4096, 0),
        "random-small": _random_bytes(7, 1),
        "nul": b'{"model_type": "llama"}\x00\n',
        "nul-csv": (header + "2023-11-16 18:15:46,\x0012,3\n").encode(),
        "latin-1": "TIMESTAMP,ContextTokens,GeneratedTokens\ncaf\xe9,1,1\n".encode("latin-1"),
        "utf-16": GOOD_TRACE.encode("utf-16"),
        "truncated-json": b'{"requests": [{"id": 1, "bytes"',
        "truncated-config": json.dumps(GOOD_CONFIG).encode()[:40],
        "truncated-topology": topology.encode()[: len(topology) // 2],
        "truncated-record": good["record"].read_bytes()[:5000],
        "wrong-types": b'{"requests": "x", "summary": [1], "model_type": 5, "nodes": 3}',
        "wrong-types-config": json.dumps({**GOOD_CONFIG, "num_hidden_layers": "32"}).encode(),
        "wrong-types-topology": b'{"nodes": [{"name": 5, "gpus": "eight"}]}',
        "wrong-types-record": json.dumps(wrong_record).encode(),
        "wrong-types-options": json.dumps(wrong_options).encode(),
        "wrong-types-cluster": b"node_groups:\n  - {count: many, gpu: [H100], gpus_per_node: 8}\n",
        "wrong-types-jsonl": b'{"timestamp": "x", "input_length": [], "output_length": {}}\n',
        "yaml-bomb": BOMB.encode(),
        "long-line-csv": (header + "2023-11-16 18:15:46," + "1" * (8 * MiB) + ",3\n").encode(),
        "long-line-json": b"[" + b"1" * (8 * MiB) + b"]",
        "header-only": header.encode(),
        "bad-date-csv": (header + "2023-13-45 25:61:61,10,10\n").encode(),
        "bad-date-yaml": b"name: 2023-02-30\nnode_groups: 2023-13-45\n",
        "1e400": b'{"model_type": "llama", "num_hidden_layers": 1e400}',
        "1e400-topology": topology.replace('"nodes"', '"x": 1e400, "nodes"', 1).encode(),
        "1e400-record": json.dumps(big_record).replace('"__INF__"', "1e400").encode(),
        "1e400-jsonl": b'{"timestamp": 1e400, "input_length": 1, "output_length": 1}\n',
        "1e400-csv": (header + "2023-11-16 18:15:46,1e400,3\n").encode(),
        "1e400-yaml": (GOOD_CLUSTER.replace("count: 2", "count: 2, nic_gb_s: 1.0e+400")).encode(),
        "huge-cluster": GOOD_CLUSTER.replace("count: 2", "count: 1000000000").encode(),
        "huge-config": json.dumps({**GOOD_CONFIG, "num_hidden_layers": 10**12}).encode(),
        "nan": b'{"model_type": "llama", "num_hidden_layers": NaN}',
        "deep": b"[" * 100_000,
    }


@contextlib.contextmanager
def peak_memory() -> Iterator[list[int]]:
    """Peak bytes traced by tracemalloc inside the block (appended to the yielded list)."""
    peak: list[int] = []
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


def test_every_command_refuses_every_hostile_file(good: dict[str, Path], tmp_path: Path) -> None:
    table = commands(good)
    for kind, content in hostile_files(good).items():
        hostile = tmp_path / f"{kind}.dat"
        hostile.write_bytes(content)
        for label, command in table.items():
            args, path = command(hostile)
            if kind not in MEMORY_KINDS:
                assert_clean(args, path)
                continue
            with peak_memory() as peak:
                assert_clean(args, path)
            bound = 8 * len(content) + 32 * MiB  # a few copies of the text, never expanded
            assert peak[0] < bound, f"{label} on {kind}: {peak[0] / MiB:.0f} MiB traced"


def test_the_demo_guard_is_live(good: dict[str, Path]) -> None:
    """A valid trace gets the demo as far as its run, which the guard refuses: so the
    hostile traces above failed before any worker or model."""
    if not model_extra_available():
        pytest.skip("the demo needs the model extra (torch, transformers)")
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(AssertionError, match="demo reached its run"):
            run_cli(["demo", "--trace", str(good["trace"]), "--requests", "2"])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def test_nonexistent_fifo_and_directory(good: dict[str, Path], tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for command in commands(good, from_kinds=()).values():
        for path in (tmp_path / "missing.json", fifo, tmp_path):
            assert_clean(command(path)[0], path)
    for path in (tmp_path / "missing", fifo):
        assert_clean(["discover", "--from", str(path)], path)


# -- hypothesis: drawn bytes and drawn JSON documents ----------------------------------------

#: A byte string that is never valid UTF-8 text without NUL: a NUL, a lone continuation byte,
#: an invalid lead, a truncated sequence, an encoded surrogate.
_POISON = st.sampled_from([b"\x00", b"\x80", b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88"])


@st.composite
def binary_files(draw: st.DrawFn) -> bytes:
    data = draw(st.binary(max_size=512))
    at = draw(st.integers(min_value=0, max_value=len(data)))
    poison = draw(_POISON)
    if poison == b"\xc3":  # a truncated two-byte sequence: nothing valid may follow it
        return data[:at] + poison + draw(st.sampled_from([b"", b"A", b"\xc3"]))
    return data[:at] + poison + data[at:]


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_JSON_KEYS = ["model_type", "num_hidden_layers", "nodes", "gpus", "requests", "summary",
              "node_groups", "count", "gpu", "options", "emulation", "dilation"]  # fmt: skip
_JSON_COMMANDS = ["plan --config", "select --topology", "sim --cluster", "sim --config",
                  "sim-validate --demo-json", "sim-validate --calibrate-from"]  # fmt: skip


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(content=binary_files(), pick=st.randoms(use_true_random=False))
def test_drawn_bytes_are_refused(
    good: dict[str, Path], tmp_path: Path, content: bytes, pick: random.Random
) -> None:
    table = commands(good, from_kinds=ALL_KINDS)
    label = pick.choice(sorted(table))
    hostile = tmp_path / "drawn.bin"
    hostile.write_bytes(content)
    args, path = table[label](hostile)
    assert_clean(args, path)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    doc=st.dictionaries(st.sampled_from(_JSON_KEYS) | st.text(max_size=6), _JSON, max_size=5)
    | _JSON,
    pick=st.randoms(use_true_random=False),
)
def test_drawn_json_documents_are_refused(
    good: dict[str, Path], tmp_path: Path, doc: Any, pick: random.Random
) -> None:
    label = pick.choice(_JSON_COMMANDS)
    hostile = tmp_path / "drawn.json"
    hostile.write_text(json.dumps(doc))
    args, path = commands(good)[label](hostile)
    assert_clean(args, path)
