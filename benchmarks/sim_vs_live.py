"""Simulator vs the live demo (issue #7 item 7b): run ``topkv demo --json``, then predict it.

Runs the live demo (real worker processes, emulated links, the relay orchestrator) on N
requests and keeps its ``--json`` output as the record (it carries each request's
arrival, prompt length, route, queueing and decode time), noting the host's load average
before and after: outside load changes the demo's times and is no input of the simulator.
Then the simulator, configured as that local cluster, predicts the run with both prefill
models (``quadratic``; ``contention``, a model of this CPU host) in-sample and
cross-validated (calibrated on even ids, compared on odd ids), and with the calibration of
each ``--calibrate-from`` record (cross-run).

    .venv/bin/python benchmarks/sim_vs_live.py [--requests 50] [--out /tmp/demo.json]
    .venv/bin/python benchmarks/sim_vs_live.py --demo-json /tmp/demo.json   # sim only
    .venv/bin/python benchmarks/sim_vs_live.py --demo-json A.json --calibrate-from B.json

Measured figures are wall-clock on this host; the links are emulated (time-dilated).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path


def record_demo(requests: int, out: Path) -> None:
    """One live ``topkv demo --requests N --json`` run, its stdout written to ``out``."""
    topkv = Path(sys.executable).with_name("topkv")
    before = os.getloadavg()[0]
    started = time.perf_counter()
    with out.open("w", encoding="utf-8") as stream:
        done = subprocess.run(
            [str(topkv), "demo", "--requests", str(requests), "--json"],
            stdout=stream,
            stderr=subprocess.DEVNULL,
            check=False,
        )
    after = os.getloadavg()[0]
    print(
        f"demo: {requests} requests in {time.perf_counter() - started:.1f} s, exit "
        f"{done.returncode}; load average (1 min) {before:.2f} before, {after:.2f} after; "
        f"record {out}",
        file=sys.stderr,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("/tmp/topkv-demo-record.json"))
    parser.add_argument("--demo-json", type=Path, help="skip the demo; validate this record")
    parser.add_argument(
        "--calibrate-from",
        type=Path,
        action="append",
        default=[],
        help="also predict with the calibration of this record (repeatable)",
    )
    args = parser.parse_args()
    from topkv.harness.validate_live import (
        calibration_from,
        format_report,
        validate_against_demo,
    )
    from topkv.harness.validate_model import PREFILL_MODELS
    from topkv.harness.validate_predict import ValidationOptions
    from topkv.harness.validate_record import DemoRecord

    path = args.demo_json
    if path is None:
        record_demo(args.requests, args.out)
        path = args.out
    record = DemoRecord.load(path)
    for model in PREFILL_MODELS:
        if model == "contention" and not record.has_timeline:
            print("\n(no contention model: the record lacks the demo's timeline fields)")
            continue
        options = ValidationOptions(prefill_model=model)
        print(f"\n== prefill model: {model} ==")
        print(format_report(validate_against_demo(record, options)))
        for other in args.calibrate_from:
            other_record = DemoRecord.load(other)
            if model == "contention" and not other_record.has_timeline:
                continue
            report = validate_against_demo(record, calibration_from(other_record, options))
            c = report.in_sample
            print(
                f"cross-run, calibrated on {other}: TTFT p50 {c.measured_p50_ms:,.1f} vs "
                f"{c.predicted_p50_ms:,.1f} ms ({100 * c.p50_error:+.1f}%), p90 "
                f"{c.measured_p90_ms:,.1f} vs {c.predicted_p90_ms:,.1f} ms "
                f"({100 * c.p90_error:+.1f}%)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
