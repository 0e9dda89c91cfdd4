#!/usr/bin/env bash
# The sdist installed the way a user installs it, into a fresh venv of another torch and Python than `make
# test`'s (torch 2.13, Python 3.11): by default torch 2.11 under Python 3.12, what the lent H200 runs. Then the
# Python suite runs against that install.
#
# Why another torch: the torch-aware helper is compiled against whichever torch is installed and picks what that
# torch offers at compile time: an access refusal is lifted by clear_data_ptr_access_error_msg_() from torch
# 2.12, by the private members 2.6-2.11 have before it; a storage is materialized through has_materializer() from
# 2.13, through its copy-on-write DataPtr before. The module traversal's record reads Python 3.12's dicts
# otherwise than 3.11's. None of those paths runs under `make test`: here they do (a helper built against 2.13
# alone let an offloaded tensor that was touched crash the process on 2.11, and did not compile against it).
# Why the sdist: `pip install gpu_offload-*.tar.gz` with build isolation (the build requirements come from
# pyproject.toml; the helper is built against the venv's torch all the same) is what a user runs, and the suite
# then imports the installed package, so a file the sdist or the wheel leaves out fails here.
#
#   usage: other_torch.sh <folder> [torch spec] [Python version]     both steps below, one after the other
#          other_torch.sh prepare <folder> [torch spec] [Python version]   the venv, its torch, the suite's tools
#          other_torch.sh check <folder>                                   the sdist, installed; the checks; the suite
# (from the repository root). CI runs `prepare` in the background while `make test` runs: it is mostly the
# download of torch (a CUDA build from PyPI, about 6 GiB once installed).
set -euo pipefail
step=all
case "${1:-}" in prepare|check) step=$1; shift ;; esac
DIR=$(realpath -m "$1")
TORCH=${2:-torch==2.11.0}
WANT=${3:-3.12}
V="$DIR/venv/bin/python"

prepare() {
  # That Python: on PATH where it runs (a pyenv shim of a version that is not selected is on PATH and fails),
  # else one of pyenv's versions.
  local py="" p
  if "python$WANT" --version >/dev/null 2>&1; then
    py=$(command -v "python$WANT")
  else
    for p in "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/"$WANT".*/bin/python"$WANT"; do
      if [ -x "$p" ]; then py=$p; fi
    done
  fi
  if [ -z "$py" ]; then
    echo "other_torch.sh: no Python $WANT here" >&2
    exit 1
  fi
  local t0=$SECONDS
  rm -rf "$DIR" && mkdir -p "$DIR"
  "$py" -m venv "$DIR/venv"
  # (No Ray, transformers, DeepSpeed or megatron-core: their tests and the docs' snippets that import them skip,
  # saying so; the adapters read no torch internals of their own. `build` and setuptools make the sdist.)
  "$V" -m pip install --disable-pip-version-check -q --no-cache-dir "$TORCH" numpy "rich>=13" "pytest>=8" \
    "hypothesis>=6" "pytest-timeout>=2" "pytest-xdist>=3" "safetensors>=0.4" "build>=1" "matplotlib>=3.7" \
    "setuptools>=77" wheel
  touch "$DIR/prepared"
  echo "other_torch.sh: $TORCH under Python $WANT installed in $(( SECONDS - t0 )) s"
}

check() {
  if [ ! -f "$DIR/prepared" ]; then
    echo "other_torch.sh: $DIR was not prepared (other_torch.sh prepare $DIR ...)" >&2
    exit 1
  fi
  rm -rf "$DIR/dist" "$DIR/src" && mkdir -p "$DIR/dist" "$DIR/src"
  "$V" -m build --sdist --no-isolation --skip-dependency-check --outdir "$DIR/dist" . > "$DIR/sdist.log" 2>&1 \
    || { tail -30 "$DIR/sdist.log"; exit 1; }
  # One CUDA architecture keeps the kernels' compile short (where nvcc is found: GPU_OFFLOAD_CUDA as the caller
  # set it); the helper is required.
  GPU_OFFLOAD_TORCH_EXT=1 GPU_OFFLOAD_CUDA_ARCHS=90-real "$V" -m pip install --disable-pip-version-check -v \
    "$DIR"/dist/gpu_offload-*.tar.gz > "$DIR/install.log" 2>&1 || { tail -50 "$DIR/install.log"; exit 1; }
  # (setup.py says it is an isolated build once per build hook pip calls: once here)
  grep "gpu_offload: building\|gpu_offload: an isolated build" "$DIR/install.log" | awk '!seen[$0]++'
  # The tests, docs, examples and benchmarks, not the package: the suite imports the installed one (its
  # subprocesses put the folder on PYTHONPATH, where no gpu_offload is then found).
  git ls-files -z | grep -zv '^gpu_offload/' | xargs -0 cp --parents -t "$DIR/src"
  git ls-files gpu_offload/ > "$DIR/package-files.txt"
  cd "$DIR/src"
  # Every file of the package is installed (the sdist or the wheel leaving one out fails here, whether or not
  # a test imports it); the helper loads, with its access guard, and an offloaded tensor read directly raises
  # instead of reading released memory; the command line works from the install.
  "$V" - "$DIR/package-files.txt" <<'EOF'
import sys
from pathlib import Path

import torch

import gpu_offload as go
from gpu_offload import torch_ext

if "/venv/" not in go.__file__:
    sys.exit(f"gpu_offload was imported from {go.__file__}, not from the venv's install")
installed = Path(go.__file__).parent.parent
missing = [name for name in Path(sys.argv[1]).read_text().split() if not (installed / name).is_file()]
if missing:
    sys.exit(f"the install lacks {len(missing)} of the package's files: {missing}")
status = torch_ext.status()
print(f"Python {sys.version.split()[0]}, torch {torch.__version__}: gpu_offload from {go.__file__}; torch_ext "
      f"{status}; access guard {torch_ext.access_guard_available()}; module records "
      f"{bool(torch_ext.ext and torch_ext.ext.MODULE_TREE)}")
if not (status.startswith("loaded") and torch_ext.access_guard_available()):
    sys.exit("the helper must load, with its access guard, on this torch")
m = torch.nn.Linear(4, 4)
go.offload(m)
try:
    m.weight.norm()
    sys.exit("an offloaded weight was read")
except RuntimeError as exc:
    assert "offloaded" in str(exc), exc
go.reload(m)
print("the helper is loaded, and an offloaded weight refuses a read")
EOF
  "$DIR/venv/bin/gpu-offload" info
  "$DIR/venv/bin/gpu-offload" bench --layout qwen1.5b --scale 512 --repeats 1 --no-baselines
  # The files whose code reads torch's or CPython's own (the helper and its access guard, the FSDP and DCP
  # adapters, the plan cache), the examples users run, and the engine's cheap ones. Left to `make test` (torch
  # 2.13), which runs every file, are those that read nothing of torch's that it did not: the simulated
  # driver's C++ suite, the GPU check's script, the command line's options, and (since they took 130 of this
  # suite's 383 worker-seconds on a 2-core VM) the file format, the fault injection, host memory, the CPU
  # reload's blocking and the docs' snippets. test_packaging needs the package's sources, which this folder
  # leaves out: the build from the sdist and the check of the installed files above stand for it here.
  # (The fatbin has one architecture: test_build's check of the default list is off.)
  GPU_OFFLOAD_EXPECT_FATBIN=0 "$V" -m pytest -n 2 --dist worksteal -q -p no:cacheprovider tests \
    --ignore=tests/test_sim_driver.py --ignore=tests/test_gpu_check.py --ignore=tests/test_cli.py \
    --ignore=tests/test_packaging.py --ignore=tests/test_persist.py --ignore=tests/test_faults.py \
    --ignore=tests/test_host_memory.py --ignore=tests/test_cpu_reload_blocks.py --ignore=tests/test_docs.py
}

case $step in
  prepare) prepare ;;
  check) check ;;
  all) prepare; check ;;
esac
