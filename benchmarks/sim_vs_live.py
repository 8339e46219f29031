"""Simulator vs the live demo (issue #7 item 7b): run ``topkv demo``, then the simulator.

Runs the live demo (real worker processes, emulated links) on N requests, writes the same
JSON as ``topkv demo --json`` plus a few per-request fields the demo measures but does not
print (nominal arrival, prompt length, workers, prefill queueing, decode time: see
:data:`EXTRA_FIELDS`), then configures the simulator as that local cluster, calibrated
from the same run, and prints predicted vs measured TTFT p50/p90 with the error, and the
cross-validated error (compute calibrated on even request ids, TTFT compared on odd ids).

    .venv/bin/python benchmarks/sim_vs_live.py [--requests 50] [--out /tmp/demo.json]
    .venv/bin/python benchmarks/sim_vs_live.py --demo-json /tmp/demo.json   # sim only

Measured figures are wall-clock on this host; the links are emulated (time-dilated).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

#: Per-request fields this script adds to the demo's JSON (the demo measures them).
EXTRA_FIELDS = ("arrival_ms", "prompt_len", "prefill_worker", "decode_worker", "queue_ms",
                "decode_ms")  # fmt: skip


def record_demo(requests: int, seed: int, speedup: float, dilation: float) -> dict[str, Any]:
    """One live demo run: ``topkv demo --json``'s payload plus :data:`EXTRA_FIELDS`."""
    from topkv.demo.report import request_json, summarize
    from topkv.demo.runner import DemoOptions, DemoRun

    options = DemoOptions(requests=requests, seed=seed, speedup=speedup, dilation=dilation)
    started = time.perf_counter()
    run = DemoRun(options)
    results = run.run()
    summary = summarize(results, options, time.perf_counter() - started, run.model_id)
    rows = []
    for result in results:
        row = request_json(result)
        state = run.states[result.id]
        row["arrival_ms"] = round(state.request.arrival_s * 1e3, 3)
        row["prompt_len"] = state.request.prompt_len
        row["prefill_worker"] = state.prefill_worker
        row["decode_worker"] = state.decode_worker
        if state.prefill is not None:
            row["queue_ms"] = round((state.prefill.forward_start_s - state.arrival_s) * 1e3, 3)
        if state.decoded is not None:
            decoded = state.decoded
            row["decode_ms"] = round((decoded.decode_end_s - decoded.decode_start_s) * 1e3, 3)
        rows.append(row)
    options_json = {"requests": requests, "seed": seed, "speedup": speedup,
                    "dilation": dilation, "new_tokens": options.new_tokens}  # fmt: skip
    return {"requests": rows, "summary": summary, "options": options_json}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--speedup", type=float, default=1.5)
    parser.add_argument("--dilation", type=float, default=3000.0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/topkv-demo-record.json"))
    parser.add_argument("--demo-json", type=Path, help="skip the demo; validate this record")
    parser.add_argument(
        "--calibrate-from", type=Path, help="also predict with the calibration of this record"
    )
    args = parser.parse_args()
    from topkv.sim.validate_live import (
        DemoRecord,
        ValidationOptions,
        calibration_from,
        format_report,
        validate_against_demo,
    )

    if args.demo_json is None:
        print(f"running the live demo on {args.requests} requests ...", file=sys.stderr)
        payload = record_demo(args.requests, args.seed, args.speedup, args.dilation)
        args.out.write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")
        print(f"demo record written to {args.out}", file=sys.stderr)
        path = args.out
    else:
        path = args.demo_json
    record = DemoRecord.load(path)
    options = ValidationOptions(seed=args.seed, speedup=args.speedup)
    report = validate_against_demo(record, options)
    print(format_report(report))
    if args.calibrate_from is not None:
        other = calibration_from(DemoRecord.load(args.calibrate_from), options)
        print(f"\n-- calibrated on {args.calibrate_from} (another run) --")
        print(format_report(validate_against_demo(record, other)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
