#!/usr/bin/env bash
# The KV device tier on a GPU (docs/tiers.md, "Device tier"): the CUDA tests, then the tier
# benchmark with the device tier's put/get against torch copy_ in the same run.
# Under 5 minutes on one GPU. Results go to $OUT (default /tmp/topkv-gpu-check):
# nvidia-smi.csv, tests.txt, tests.xml, tiers.json.
# Needs the project installed with its dev and model extras (pip install -e '.[dev,model]'
# with a CUDA build of torch). Fails if torch sees no GPU or a CUDA test skipped.
# Usage: scripts/gpu-check.sh   (PYTHON=... to pick the interpreter; default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-/tmp/topkv-gpu-check}
mkdir -p "$OUT"

"$PY" - <<'PYEOF'
import sys

try:
    import torch
except ImportError:
    sys.exit("gpu-check: torch is not installed (pip install -e '.[model]')")
if not torch.cuda.is_available():
    sys.exit(f"gpu-check: torch {torch.__version__} sees no CUDA GPU")
free, total = torch.cuda.mem_get_info()
print(f"gpu-check: torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"{torch.cuda.get_device_name(0)}, {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
PYEOF
nvidia-smi --query-gpu=name,memory.total,memory.free,pcie.link.gen.current,pcie.link.width.current \
    --format=csv >"$OUT/nvidia-smi.csv" 2>&1 || true

# The device tier's tests (CPU and CUDA) and the live worker tests (auto picks the GPU tier).
rc=0
timeout 170 "$PY" -m pytest tests/service/test_kv_tier_device.py tests/service/test_kv_tiers_live.py \
    tests/service/test_kv_tiers_cli.py -q -rs -p no:cacheprovider --junitxml "$OUT/tests.xml" \
    2>&1 | tee "$OUT/tests.txt" || rc=$?
if grep -q "needs a CUDA GPU" "$OUT/tests.txt"; then
    echo "gpu-check: a CUDA test was skipped on a GPU machine" >&2
    rc=1
fi

# 256 MiB, 5 repeats: host, disk, the peer, and the device tier vs torch copy_.
timeout 110 "$PY" benchmarks/tiers.py --json --size $((256 << 20)) --repeat 5 >"$OUT/tiers.json" || rc=$?
"$PY" - "$OUT/tiers.json" <<'PYEOF' || rc=$?
import json
import sys

report = json.load(open(sys.argv[1]))
device = report["device_tier"]
if not device.get("ran") or device.get("kind") != "gpu":
    sys.exit(f"gpu-check: the device tier benchmark did not run on a GPU: {device}")
print(f"device tier on {device['device']}: put {device['put_gbps']:.1f} GB/s "
      f"(pinned copy_ {device['h2d_gbps']:.1f}, pageable {device['h2d_pg_gbps']:.1f}), "
      f"get {device['get_gbps']:.1f} GB/s (pinned copy_ {device['d2h_gbps']:.1f}, "
      f"pageable {device['d2h_pg_gbps']:.1f})")
print(f"device_put_ratio {report['device_put_ratio']:.2f}, "
      f"device_get_ratio {report['device_get_ratio']:.2f} (vs pinned copy_); "
      f"host_put_ratio {report['host_put_ratio']:.2f}, host_get_ratio {report['host_get_ratio']:.2f}")
PYEOF
exit $rc
