#!/usr/bin/env bash
# The Python suite on another torch and Python than `make test`'s (torch 2.13, Python 3.11): by default torch
# 2.11 under Python 3.12, what the lent H200 runs. The torch-aware helper is compiled against whichever torch is
# installed and picks what that torch offers at compile time: an access refusal is lifted by
# clear_data_ptr_access_error_msg_() from torch 2.12, by the private members 2.6-2.11 have before it; a storage
# is materialized through has_materializer() from 2.13, through its copy-on-write DataPtr before. The module
# traversal's record reads Python 3.12's dicts otherwise than 3.11's. None of those paths runs under `make test`:
# here they do (a helper built against 2.13 alone let an offloaded tensor that was touched crash the process
# on 2.11, and did not compile against it). CPU-only build (GPU_OFFLOAD_CUDA=0): the CUDA side is `make test`'s.
#   usage: other_torch.sh <folder> [torch spec] [Python version]      (from the repository root)
set -euo pipefail
DIR=$(realpath -m "$1")
TORCH=${2:-torch==2.11.0}
WANT=${3:-3.12}
# That Python: on PATH where it runs (a pyenv shim of a version that is not selected is on PATH and fails),
# else one of pyenv's versions.
PY=""
if "python$WANT" --version >/dev/null 2>&1; then
  PY=$(command -v "python$WANT")
else
  for p in "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/"$WANT".*/bin/python"$WANT"; do
    if [ -x "$p" ]; then PY=$p; fi
  done
fi
if [ -z "$PY" ]; then
  echo "other_torch.sh: no Python $WANT here" >&2
  exit 1
fi
rm -rf "$DIR" && mkdir -p "$DIR/src"
"$PY" -m venv "$DIR/venv"
V="$DIR/venv/bin/python"
# (No Ray, transformers, DeepSpeed or megatron-core: their tests and the docs' snippets that import them skip,
# saying so; the adapters read no torch internals of their own.)
$V -m pip install --disable-pip-version-check -q --no-cache-dir "$TORCH" numpy "rich>=13" "pytest>=8" "hypothesis>=6" \
  "pytest-timeout>=2" "pytest-xdist>=3" "safetensors>=0.4" "build>=1" "matplotlib>=3.7" "pybind11>=2.12" "setuptools>=77" wheel \
  ninja "cmake>=3.24"
# A copy of the tracked tree, installed in place (the tests start processes that import the package and run
# its command): the helper is built there, and the suite's own stays as it is.
git ls-files -z | xargs -0 cp --parents -t "$DIR/src"
cd "$DIR/src"
GPU_OFFLOAD_CUDA=0 GPU_OFFLOAD_TORCH_EXT=1 GPU_OFFLOAD_BUILD_DIR="$DIR/cmake" \
  $V -m pip install --disable-pip-version-check -q --no-build-isolation --no-deps -e .
$V - <<'EOF'
import sys

import torch

from gpu_offload import torch_ext

status = torch_ext.status()
print(f"Python {sys.version.split()[0]}, torch {torch.__version__}: torch_ext {status}; access guard "
      f"{torch_ext.access_guard_available()}; module records {bool(torch_ext.ext and torch_ext.ext.MODULE_TREE)}")
if not (status.startswith("loaded") and torch_ext.access_guard_available()):
    sys.exit("the helper must load, with its access guard, on this torch")
EOF
# The suite less the files whose code reads nothing of torch's or CPython's that `make test` did not: the
# simulated driver's C++ suite, the GPU check's script, the command line's options and the packaging (their
# slowest tests alone took 123 of the suite's 840 worker-seconds on a 2-core VM).
GPU_OFFLOAD_EXPECT_CUDA_BUILD=0 $V -m pytest -n 2 --dist worksteal -q -p no:cacheprovider tests \
  --ignore=tests/test_sim_driver.py --ignore=tests/test_gpu_check.py --ignore=tests/test_cli.py \
  --ignore=tests/test_packaging.py
