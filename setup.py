"""Builds gpu_offload._C with CMake and ninja.

Environment:
  GPU_OFFLOAD_CUDA        auto (default: CUDA when nvcc is found) | 1 (require CUDA) | 0 (CPU-only build)
  GPU_OFFLOAD_CUDA_ARCHS  CMake CUDA architectures, default "80-real;90" (sm_80, sm_90 and PTX for 90)
  GPU_OFFLOAD_BUILD_DIR   where CMake builds (default build/cmake; the C++ unit tests run there with ctest)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
DEFAULT_CUDA_ARCHS = "80-real;90"  # SASS for sm_80 and sm_90, PTX for compute_90 (newer GPUs JIT from it)
VERSION = re.search(r'__version__ = "([^"]+)"', (ROOT / "gpu_offload" / "_version.py").read_text()).group(1)


def find_nvcc() -> str | None:
    for candidate in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11

        mode = os.environ.get("GPU_OFFLOAD_CUDA", "auto").lower()
        if mode not in ("auto", "0", "1"):
            raise SystemExit(f"GPU_OFFLOAD_CUDA must be auto, 0 or 1, not {mode!r}")
        nvcc = find_nvcc() if mode != "0" else None
        if mode == "1" and nvcc is None:
            raise SystemExit("GPU_OFFLOAD_CUDA=1 but nvcc was not found (set CUDACXX or put nvcc on PATH)")
        with_cuda = nvcc is not None

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(os.environ.get("GPU_OFFLOAD_BUILD_DIR", ROOT / "build" / "cmake")).resolve()
        build_dir.mkdir(parents=True, exist_ok=True)
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DGPU_OFFLOAD_VERSION={VERSION}",
            f"-DGPU_OFFLOAD_WITH_CUDA={'ON' if with_cuda else 'OFF'}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if shutil.which("ninja"):
            args.append("-GNinja")
        if with_cuda:
            args.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
            # Always passed: a value cached by an earlier configure must not outlive the variable.
            archs = os.environ.get("GPU_OFFLOAD_CUDA_ARCHS") or DEFAULT_CUDA_ARCHS
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={archs}")
        cache = build_dir / "CMakeCache.txt"
        if cache.exists() and f"GPU_OFFLOAD_WITH_CUDA:BOOL={'ON' if with_cuda else 'OFF'}" not in cache.read_text():
            shutil.rmtree(build_dir)  # switching CUDA on/off needs a fresh configure
            build_dir.mkdir(parents=True)
        subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build_dir), *args], check=True)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        subprocess.run(["cmake", "--build", str(build_dir), "--parallel", jobs], check=True)


setup(
    version=VERSION,
    ext_modules=[CMakeExtension("gpu_offload._C")],
    cmdclass={"build_ext": CMakeBuild},
)
