#!/usr/bin/env bash
# The one GPU check: build the extension on the lent H200, run the cuda-marked tests and the whole suite, run
# the GPU benchmark on every layout, and print a short table last. Writes everything under $OUT (or ./out).
#   run from the repo root:  bash benchmarks/gpu_check.sh
# Budget: about 7 minutes on an H200 (build ~1 min, tests ~1 min, strategies ~30 s, soak and threads
# ~2.5 min, bench ~2 min); run it with timeout_s=540.
# megatron-core is not on the H200: carry it as wheels first (here, in the repo root):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl megatron-core==0.19.2
# and name .whl in the device call's `carry`; without it the megatron check is recorded as not run.
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GPU_OFFLOAD_CUDA=1 GPU_OFFLOAD_CUDA_ARCHS=${GPU_OFFLOAD_CUDA_ARCHS:-90}
PY=${PYTHON:-python3}
log() { echo "== $* ($(date +%H:%M:%S))"; }

log "machine"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,memory.total --format=csv | tee "$OUT/machine.txt"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/machine.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/machine.txt"

log "wheels carried in .whl (if any)"
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi

log "build"
start=$(date +%s)
$PY -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -5 | tee "$OUT/build.txt"
echo "build seconds: $(( $(date +%s) - start ))" | tee -a "$OUT/build.txt"
$PY -c "import gpu_offload as go, json; print(json.dumps(go.build_info())); assert go.cuda_available()" | tee -a "$OUT/build.txt" || exit 1

log "C++ unit tests"
ctest --test-dir build/cmake --output-on-failure 2>&1 | tail -5 | tee "$OUT/ctest.txt"

log "tests (cuda-marked first, then all)"
$PY -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tail -25 | tee "$OUT/pytest-cuda.txt"
$PY -m pytest -q -p no:cacheprovider -x tests 2>&1 | tail -15 | tee "$OUT/pytest-all.txt"

log "strategies on the GPU (FSDP1, FSDP2, megatron-core DDP; NCCL, world size 1)"
timeout 240 $PY benchmarks/gpu_strategies.py --device cuda --json "$OUT/strategies-h200.json" 2>&1 | grep -v Warning | tail -8 \
  | tee "$OUT/strategies.txt"

log "soak (1000 cycles, leak check, checksum overhead) and two threads for 30 s"
timeout 150 $PY benchmarks/soak.py --device cuda --cycles 1000 --json "$OUT/soak-h200.json" 2>&1 | tail -12 | tee "$OUT/soak.txt"
timeout 60 $PY benchmarks/stress_threads.py --device cuda --seconds 30 2>&1 | tail -4 | tee "$OUT/threads.txt"

log "benchmark"
timeout 300 $PY -m gpu_offload bench --device cuda --layout all --repeats 5 \
  --json "$OUT/bench-h200.json" --markdown "$OUT/bench-h200.md" --plot "$OUT/bench-h200.png" 2>&1 | tee "$OUT/bench-h200.txt"

log "summary"
$PY - "$OUT/bench-h200.json" <<'PYEOF'
import json, sys
try:
    data = json.load(open(sys.argv[1]))
except Exception as exc:
    print("no benchmark JSON:", exc); sys.exit(0)
print(f"{'layout':<10} {'method':<34} {'dir':<4} {'GB/s':>7} {'x limit':>8}")
for res in data["results"]:
    for r in res["rows"]:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
        print(f"{res['layout']:<10} {r['method']:<34} {r['direction']:<4} {r['gbps']:7.2f} {ratio:>8}")
PYEOF
