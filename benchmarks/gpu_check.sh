#!/usr/bin/env bash
# The one GPU check, for a lent H200 (15 minutes a loan, 1-2 of them to start): one command that ends within
# 6 minutes, so that a second run fits. Stages in priority order, each under its own `timeout` (cut further
# to what is left of the 6 minutes), none stopping the rest, each recorded with its command's own status:
#   machine -> build (archs 90) + C++ tests -> cuda tests, the safety and stream-order ones first
#   (test_cuda_safety.py, test_cuda.py) -> benchmark of four layouts (gather threshold swept in the same
#   process) -> each call's phases (benchmarks/phases.py) -> the other cuda tests -> qwen7b -> strategies on
#   NCCL -> short soak -> thread stress -> the baselines and the stager, once
# The limits add up to more than the budget: what is left runs in a second window (GPU_CHECK_STAGES).
# Writes at most 10 small files under $OUT (or ./out): check.log (everything, the test names as they run),
# record.json (commit, machine, each stage's status and seconds, the benchmark summary; written last),
# junit-first.xml, junit-rest.xml, bench-small.json, phases.json, bench-qwen7b.json, strategies.json,
# soak.json, bench-baselines.json. Prints one summary table last.
#   run from the repo root:  GPU_CHECK_COMMIT=<sha> bash benchmarks/gpu_check.sh    (run's timeout_s=420)
# The device copy has no .git: pass the commit in GPU_CHECK_COMMIT (it is recorded as "unknown" otherwise).
# GPU_CHECK_STAGES="machine cuda-first ..." runs only the stages named (the others are recorded as not
# selected), e.g. the tests alone in a second window.
# megatron-core is not on the H200: carry it as wheels (here, in the repo root):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl megatron-core==0.19.2
# and name .whl in the device call's `carry`; without it the megatron check is recorded as not run.
# Without a GPU (to time the script itself) the GPU stages are recorded as skipped within seconds.
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
BUDGET=${GPU_CHECK_BUDGET_S:-360}
START=$(date +%s)
DEADLINE=$((START + BUDGET))
PY=${PYTHON:-python3}
COMMIT=${GPU_CHECK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} GPU_OFFLOAD_CUDA=1
export GPU_OFFLOAD_CUDA_ARCHS=${GPU_OFFLOAD_CUDA_ARCHS:-90} GPU_OFFLOAD_BUILD_DIR=${GPU_OFFLOAD_BUILD_DIR:-$PWD/build/cmake}
SWEEP=${GPU_CHECK_GATHER_SWEEP:-0,65536,262144,1048576}
SELECTED=${GPU_CHECK_STAGES:-}
# The machine's RAM starts small and grows as it is used (its MemAvailable at boot is far below its 128 GiB):
# the benchmarks' pinning check takes this figure instead (docs/troubleshooting.md).
BENCH_HOST_MEMORY=${GPU_CHECK_HOST_MEMORY_BYTES:-$((100 << 30))}
STAGES="$OUT/.stages"  # name status seconds, one line per stage (folded into record.json, then removed)
: >"$STAGES"
exec > >(tee "$OUT/check.log") 2>&1
TEE_PID=$!

HAVE_GPU=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then HAVE_GPU=1; fi

# stage NAME LIMIT_S NEEDS_GPU COMMAND...: runs COMMAND under `timeout` (LIMIT_S, or what is left of the
# budget less a reserve for the summary) and records how it ended; never stops the script.
stage() {
  local name=$1 limit=$2 gpu=$3
  shift 3
  local now left status rc t0
  now=$(date +%s)
  left=$((DEADLINE - now - 8))
  if [ -n "$SELECTED" ] && [[ " $SELECTED " != *" $name "* ]]; then
    echo "== $name: not selected"
    echo "$name not-selected 0" >>"$STAGES"
    return
  fi
  if [ "$gpu" = 1 ] && [ "$HAVE_GPU" = 0 ]; then
    echo "== $name: skipped (no GPU)"
    echo "$name skipped-no-gpu 0" >>"$STAGES"
    return
  fi
  if [ "$left" -lt 5 ]; then
    echo "== $name: skipped (budget spent)"
    echo "$name skipped-no-time 0" >>"$STAGES"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit}s, $(date +%H:%M:%S))"
  t0=$(date +%s)
  # In a child bash, so that shell functions run under `timeout` too (it signals the whole group). The
  # child gets pipefail of its own (the parent's does not reach it): a stage that pipes its command
  # through tail is recorded with the command's status, not tail's.
  timeout --kill-after=5 "$limit" bash -o pipefail -c '"$@"' _ "$@"
  rc=$?
  case $rc in
    0) status=ok ;;
    124 | 137) status=timeout ;;
    *) status=fail-rc$rc ;;
  esac
  echo "$name $status $(($(date +%s) - t0))" >>"$STAGES"
  echo "== $name: $status in $(($(date +%s) - t0))s"
}

machine() {
  set -o pipefail
  local rc=0
  if [ "$HAVE_GPU" = 1 ]; then
    nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,memory.total --format=csv \
      || rc=1
    nvidia-smi -q -d CLOCK 2>&1 | sed -n 1,24p || true  # (into check.log: no file outside $OUT)
  fi
  [ -r /proc/driver/nvidia/version ] && cat /proc/driver/nvidia/version
  echo "-- /proc/meminfo"
  cat /proc/meminfo
  echo "-- ulimit -l: $(ulimit -l)   nproc: $(nproc)   benchmarks' GPU_OFFLOAD_HOST_MEMORY_BYTES: $BENCH_HOST_MEMORY"
  $PY -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())" \
    || rc=1
  $PY -c "import setuptools; print('setuptools', setuptools.__version__)" || echo "setuptools: not importable"
  echo "commit $COMMIT"
  if ls .whl/*.whl >/dev/null 2>&1; then  # carried wheels (megatron-core)
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || rc=1
  fi
  return $rc
}

build() {
  set -o pipefail
  local rc=0
  $PY setup.py -q build_ext --inplace 2>&1 | tail -15 || return 1
  $PY -c "import gpu_offload as go, json; print(json.dumps(go.build_info())); assert go.cuda_available() or not $HAVE_GPU" || return 1
  # The torch-aware helper is built in auto mode (a failure there leaves gpu_offload working on its pure-Python
  # checks), but every host-cost figure after this stage assumes it: a helper that did not build against this
  # torch fails the stage, and the rest runs on.
  $PY -c "from gpu_offload import torch_ext as t; s = t.status(); print('torch_ext:', s); assert s.startswith('loaded'), s" || rc=1
  ctest --test-dir "$GPU_OFFLOAD_BUILD_DIR" --output-on-failure 2>&1 | tail -4 || rc=1
  return $rc
}

cuda_tests() {  # $1: junit file name, rest: what to run
  set -o pipefail
  local junit=$1
  shift
  local extra=()
  $PY -c "import pytest_timeout" 2>/dev/null && extra=(--timeout 120)
  # -v: each test's name and outcome is in check.log as it ends, so a timeout loses none of them.
  $PY -m pytest -v -m cuda -p no:cacheprovider -rfEs "${extra[@]}" --junitxml "$OUT/$junit" "$@"
}

bench() {  # $1: json file, $2: gather thresholds, rest: --layout arguments
  set -o pipefail
  local json=$1 sweep=$2
  shift 2
  # Its whole output goes to check.log as it comes (the script's output is tee'd there). Piped through tail,
  # a bench cut by its stage's timeout left nothing behind (the H200, 2026-12-04).
  GPU_OFFLOAD_HOST_MEMORY_BYTES=$BENCH_HOST_MEMORY \
    $PY -m gpu_offload bench --device cuda "$@" --repeats 3 --no-baselines --gather-sweep "$sweep" --json "$json" 2>&1
}

export -f machine build cuda_tests bench
export PY HAVE_GPU OUT COMMIT BENCH_HOST_MEMORY
stage machine 15 0 machine
[ -d /tmp/site ] && export PYTHONPATH=$PYTHONPATH:/tmp/site
stage build 90 0 build
stage cuda-first 90 1 cuda_tests junit-first.xml tests/test_cuda_safety.py tests/test_cuda.py
# Four layouts in one process, the 15 GB one in a second (its large tensors barely use the gather kernel:
# off and 1 MiB only), so that a slow qwen7b cannot cost the others' figures. Before the other tests: the
# first H200 run (2026-12-04) spent the budget on them (140 tests, 99 of them in 75 s) and measured nothing.
stage bench-small 100 1 bench "$OUT/bench-small.json" "$SWEEP" --layout tiny4k --layout small64k --layout mixed --layout qwen1.5b
# Where the time of each call goes on qwen1.5b and tiny4k (host phases, then the device's tail).
stage phases 60 1 env GPU_OFFLOAD_HOST_MEMORY_BYTES="$BENCH_HOST_MEMORY" $PY benchmarks/phases.py --device cuda \
  --layout qwen1.5b --layout tiny4k --repeats 3 --json "$OUT/phases.json"
stage cuda-rest 130 1 cuda_tests junit-rest.xml tests --ignore=tests/test_cuda_safety.py --ignore=tests/test_cuda.py
stage bench-qwen7b 40 1 bench "$OUT/bench-qwen7b.json" 0,1048576 --layout qwen7b
stage strategies 25 1 $PY benchmarks/gpu_strategies.py --device cuda --json "$OUT/strategies.json"
stage soak 15 1 $PY benchmarks/soak.py --device cuda --cycles 150 --warmup 10 --json "$OUT/soak.json"
stage threads 10 1 $PY benchmarks/stress_threads.py --device cuda --seconds 5
# Issue 19 asks for the baselines at least once (the seed's .cpu().clone(), per-tensor copies) and the
# stager against DCP's: one repeat, two layouts (tiny4k's per-tensor baselines alone take minutes).
stage baselines 90 1 env GPU_OFFLOAD_HOST_MEMORY_BYTES="$BENCH_HOST_MEMORY" $PY -m gpu_offload bench --device cuda \
  --layout qwen1.5b --layout small64k --repeats 1 --stager --json "$OUT/bench-baselines.json"

# The record and the summary table (printed last).
$PY - "$OUT" "$COMMIT" "$BUDGET" "$(($(date +%s) - START))" <<'PYEOF'
import datetime, json, os, platform, subprocess, sys

out, commit, budget, elapsed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
stages = []
with open(os.path.join(out, ".stages")) as f:
    for line in f:
        name, status, seconds = line.split()
        stages.append({"stage": name, "status": status, "seconds": int(seconds)})
os.remove(os.path.join(out, ".stages"))
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20).stdout.strip() or None
except Exception:
    gpu = None
rows = []
for name in ("bench-small.json", "bench-qwen7b.json", "bench-baselines.json"):
    try:
        data = json.load(open(os.path.join(out, name)))
    except Exception:
        continue
    for res in data["results"]:
        for r in res["rows"]:
            if r["method"] == "limit":
                continue
            rows.append({"layout": res["layout"], "method": r["method"].replace("gpu_offload.", ""),
                         "dir": r["direction"], "gbps": round(r["gbps"], 2),
                         "x_limit": None if r["ratio"] is None else round(r["ratio"], 3)})
mem = {}
try:
    for line in open("/proc/meminfo"):
        key, value = line.split(":", 1)
        if key in ("MemTotal", "MemAvailable"):
            mem[key] = value.strip()
except OSError:
    pass
record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
          "machine": {"gpu": gpu, "host": platform.node(), "python": platform.python_version(), "memory_at_end": mem},
          "budget_s": budget, "elapsed_s": elapsed, "stages": stages, "bench": rows}
with open(os.path.join(out, "record.json"), "w") as f:
    json.dump(record, f, indent=1)
print()
print(f"{'layout':<10} {'method':<32} {'dir':<4} {'GB/s':>7} {'x limit':>8}")
for r in rows:
    ratio = "" if r["x_limit"] is None else f"{r['x_limit']:.2f}"
    print(f"{r['layout']:<10} {r['method']:<32} {r['dir']:<4} {r['gbps']:7.2f} {ratio:>8}")
print()
print(f"{'stage':<14} {'status':<16} {'s':>5}    commit {commit[:12]}, {elapsed}s of {budget}s, GPU: {gpu}")
for s in stages:
    print(f"{s['stage']:<14} {s['status']:<16} {s['seconds']:>5}")
sys.exit(1 if any(s["status"].startswith(("fail", "timeout")) for s in stages) else 0)
PYEOF
RC=$?
# Flush: the summary above must reach check.log (and the caller) before the script ends.
exec >&- 2>&-
wait "$TEE_PID" 2>/dev/null
exit $RC
