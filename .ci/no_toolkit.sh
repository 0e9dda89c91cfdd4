#!/usr/bin/env bash
# The build a GPU machine without a CUDA toolkit gets (most people who train with torch's wheels): run by
# .ci/run inside a private mount namespace (`unshare -m`, as root) where every CUDA toolkit is hidden, so
# neither setup.py nor CMake can find nvcc, CUDACXX, CUDA_HOME or /usr/local/cuda. The module must still
# have the CUDA backend (driver API, g++ only), its C++ tests must pass on the simulated driver, and the
# kernels must come from NVRTC (PyPI's nvidia-cuda-nvrtc-cu12, found in site-packages the way the package
# looks for it on a user's machine).
#   usage: no_toolkit.sh <folder for the build> <folder where nvidia-cuda-nvrtc-cu12 was installed>
set -euo pipefail
NT=$(realpath "$1")
SITE=$(realpath "$2")
mkdir -p "$NT/empty"
: > "$NT/not-nvcc"
for d in /usr/local/cuda-* /opt/cuda /opt/nvidia; do
  if [ -d "$d" ]; then mount --bind "$NT/empty" "$d"; fi
done
# Every nvcc on PATH is covered by an empty, non-executable file (bash's `command -v` still names such a
# file, so the check below asks what setup.py asks: shutil.which).
IFS=: read -ra path_dirs <<< "$PATH"
for d in "${path_dirs[@]}"; do
  if [ -f "$d/nvcc" ] && [ -x "$d/nvcc" ]; then mount --bind "$NT/not-nvcc" "$d/nvcc"; fi
done
unset CUDACXX CUDA_HOME CUDA_PATH CUDA_ROOT
if [ -n "$(.venv/bin/python -c 'import shutil; print(shutil.which("nvcc") or "")')" ] ||
   [ -e /usr/local/cuda/bin/nvcc ] || [ -e /usr/local/cuda/include/cuda.h ]; then
  echo "no_toolkit.sh: a CUDA toolkit is still visible" >&2
  exit 1
fi
echo "no nvcc, no CUDACXX, no /usr/local/cuda: building"
rm -rf "$NT/cmake" "$NT/lib" "$NT/pkg" "$NT/kernel-cache"  # NVRTC must compile here, not read a cache
# (Only _C: the torch-aware helper has nothing of CUDA, and the package copy below keeps the tree's.)
GPU_OFFLOAD_CUDA=auto GPU_OFFLOAD_TORCH_EXT=0 GPU_OFFLOAD_BUILD_DIR="$NT/cmake" .venv/bin/python setup.py -q build_ext --build-lib "$NT/lib"
grep -q "GPU_OFFLOAD_NVCC:FILEPATH=$" "$NT/cmake/CMakeCache.txt"
# The C++ tests on the simulated driver; sim_kernels_from_nvrtc compiles the kernels with NVRTC here.
GPU_OFFLOAD_NVRTC="$SITE/nvidia/cuda_nvrtc/lib/libnvrtc.so.12" GPU_OFFLOAD_CACHE_DIR="$NT/kernel-cache" \
  ctest --test-dir "$NT/cmake" --output-on-failure
# The Python side against this module, from a copy of the package (not the source tree's module): the build
# facts, and the simulated-driver suite, whose kernels must come from NVRTC found in site-packages/nvidia.
mkdir -p "$NT/pkg" && cp -r gpu_offload "$NT/pkg/" && rm -f "$NT/pkg/gpu_offload/"_C*.so
cp "$NT/lib/gpu_offload/"_C*.so "$NT/pkg/gpu_offload/"
cd tests
export PYTHONPATH="$NT/pkg:$SITE" GPU_OFFLOAD_CACHE_DIR="$NT/kernel-cache"
../.venv/bin/python -m gpu_offload info
GPU_OFFLOAD_EXPECT_CUDA_BUILD=1 GPU_OFFLOAD_EXPECT_FATBIN=0 GPU_OFFLOAD_EXPECT_KERNELS=nvrtc \
  ../.venv/bin/python -m pytest -q -p no:cacheprovider --rootdir="$OLDPWD" -c "$OLDPWD/pyproject.toml" \
  test_build.py test_sim_driver.py test_roundtrip.py
