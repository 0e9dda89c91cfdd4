"""Builds gpu_offload._C with CMake and ninja.

The CUDA backend talks to the driver (libcuda, loaded at run time) and needs no CUDA toolkit to build: g++
builds the whole module. nvcc, where it is found, only adds the kernels' fatbin; without it the kernels are
compiled by NVRTC at first use (or stay off, and the copy engines do every copy).

Environment:
  GPU_OFFLOAD_CUDA        auto (default: the CUDA backend, with a fatbin when nvcc is found) | 1 (the same, and
                          nvcc is required: the fatbin must be built) | 0 (CPU-only build, no CUDA backend)
  GPU_OFFLOAD_CUDA_ARCHS  the fatbin's architectures, CMake syntax, default
                          "75-real;80-real;86-real;89-real;90-real;100-real;120-real;120"
                          (SASS for T4, A100, A10/RTX 30, L4/L40/RTX 40, H100/H200, B200, RTX 50; PTX for 120)
  GPU_OFFLOAD_BUILD_DIR   where CMake builds (default: a folder under setuptools' build_temp, fresh for each
                          `pip install .`; `make` sets build/cmake, where the C++ unit tests run with ctest)
  GPU_OFFLOAD_TORCH_EXT   auto (default: build gpu_offload._torch_ext when torch is importable) | 1 (require it)
                          | 0 (skip it); see "The torch-aware helper" below

The build prints one line saying what was built and why (pip shows it with -v; `gpu-offload info` and
gpu_offload.build_info() say it at run time).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
# SASS for every current data-center and workstation family, PTX for compute_120 (newer GPUs JIT from it).
# The kernels are small: their fatbin for this list is 137 KiB (nvcc 13.0), beside a 0.6 MiB module.
# sm_70 (V100) needs nvcc 12.x: GPU_OFFLOAD_CUDA_ARCHS="70-real;75-real;80-real;86-real;89-real;90-real;100-real;120-real;120".
DEFAULT_CUDA_ARCHS = "75-real;80-real;86-real;89-real;90-real;100-real;120-real;120"
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
        if isinstance(ext, TorchExtension):
            build_torch_extension(self, ext)
            return
        mode = os.environ.get("GPU_OFFLOAD_CUDA", "auto").lower()
        if mode not in ("auto", "0", "1"):
            raise SystemExit(f"GPU_OFFLOAD_CUDA must be auto, 0 or 1, not {mode!r}")
        nvcc = find_nvcc() if mode != "0" else None
        if mode == "1" and nvcc is None:
            raise SystemExit("GPU_OFFLOAD_CUDA=1 but nvcc was not found for the kernels' fatbin (set CUDACXX or put "
                             "nvcc on PATH; GPU_OFFLOAD_CUDA=auto builds without it, kernels then from NVRTC)")
        with_cuda = mode != "0"
        if not with_cuda:
            what = "CPU-ONLY, without the CUDA backend (GPU_OFFLOAD_CUDA=0)"
        elif nvcc is not None:
            what = f"WITH the CUDA backend (driver API) and the kernels' fatbin (nvcc: {nvcc})"
        else:
            what = ("WITH the CUDA backend (driver API), no fatbin: no nvcc on PATH, in CUDACXX or at "
                    "/usr/local/cuda/bin/nvcc, so the kernels come from NVRTC at first use (torch's "
                    "nvidia-cuda-nvrtc package), else the copy engines do every copy")

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        # A fresh folder per build unless one is named: a `pip install .` must not pick up a CMake cache
        # that an earlier build left in the source tree (another compiler or cmake, another python).
        named = os.environ.get("GPU_OFFLOAD_BUILD_DIR")
        scratch = None if named else tempfile.TemporaryDirectory(prefix="gpu_offload-cmake-")
        try:
            self._cmake(Path(named or scratch.name).resolve(), out_dir, with_cuda, nvcc, what)
        finally:
            if scratch is not None:
                scratch.cleanup()

    def _cmake(self, build_dir: Path, out_dir: Path, with_cuda: bool, nvcc: str | None, what: str) -> None:
        import pybind11

        build_dir.mkdir(parents=True, exist_ok=True)
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DGPU_OFFLOAD_VERSION={VERSION}",
            f"-DGPU_OFFLOAD_WITH_CUDA={'ON' if with_cuda else 'OFF'}",
            "-DCMAKE_BUILD_TYPE=Release",
            # The C++ unit tests only where someone will run them (a named build folder: make, CI).
            f"-DGPU_OFFLOAD_BUILD_TESTS={'ON' if os.environ.get('GPU_OFFLOAD_BUILD_DIR') else 'OFF'}",
        ]
        if shutil.which("ninja"):
            args.append("-GNinja")
        # Always passed: a value cached by an earlier configure must not outlive the variable.
        args.append(f"-DGPU_OFFLOAD_NVCC={nvcc or ''}")
        # The driver declarations are checked against the toolkit's cuda.h where there is one.
        headers = [Path(nvcc).resolve().parent.parent / "include",
                   Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda") / "include"] if nvcc else []
        include = next((h for h in headers if (h / "cuda.h").is_file()), "")
        args.append(f"-DGPU_OFFLOAD_CUDA_INCLUDE={include}")
        if nvcc:
            archs = os.environ.get("GPU_OFFLOAD_CUDA_ARCHS") or DEFAULT_CUDA_ARCHS
            args.append(f"-DGPU_OFFLOAD_CUDA_ARCHS={archs}")
            what += f", architectures {archs}"
        # print, not logging or warnings: this is the build script, and pip shows its output with -v.
        print(f"gpu_offload: building gpu_offload._C {what}", flush=True)
        cache = build_dir / "CMakeCache.txt"
        text = cache.read_text() if cache.exists() else ""
        # Switching CUDA on/off, or a cache configured for another source tree, needs a fresh configure.
        if text and (f"GPU_OFFLOAD_WITH_CUDA:BOOL={'ON' if with_cuda else 'OFF'}" not in text
                     or f"CMAKE_HOME_DIRECTORY:INTERNAL={ROOT}\n" not in text):
            shutil.rmtree(build_dir)
            build_dir.mkdir(parents=True)
        subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build_dir), *args], check=True)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(_cores()))
        subprocess.run(["cmake", "--build", str(build_dir), "--parallel", jobs], check=True)


# -- The torch-aware helper: gpu_offload._torch_ext ---------------------------------------------------------
# A second, optional extension for what only torch's C++ reaches (batched per-call checks of a target's
# tensors, refusing access to offloaded storages). Built from csrc/torch_ext/*.cpp when torch is importable
# at build time (make and CI install with --no-build-isolation, so it is), against that torch: its headers,
# its C++ ABI flag, its libraries, the C++ standard its own extension builder uses. The torch it was built
# against is compiled into the binary as a string that gpu_offload/torch_ext.py reads before loading it: it
# loads only into that torch, and falls back to pure Python otherwise. The torch-free core above knows
# nothing of it.
TORCH_EXT_NAME = "gpu_offload._torch_ext"


def _find_installing_torch() -> str | None:
    """Where torch was found when the build could not import it: pip's isolated build runs this file with the
    installing environment's interpreter but hides that environment's site-packages, and the helper must be
    built against that very torch (it loads into no other). The folder is appended after the build's own
    (its setuptools, pybind11 stay first) and only its torch is asked for. None where torch imports as it is,
    or none is found there (uv and `python -m build` build in an environment of their own: the build then
    goes on without the helper)."""
    import importlib.util
    import site
    import sysconfig

    if importlib.util.find_spec("torch") is not None:
        return None
    # (The user's site too, last: pip's build sets PYTHONNOUSERSITE, which hides a `pip install --user` torch.)
    folders = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
               site.getusersitepackages()]
    for folder in dict.fromkeys(folders):
        if (Path(folder) / "torch" / "__init__.py").is_file() and folder not in sys.path:
            sys.path.append(folder)
            return folder
    return None


class TorchExtension(Extension):
    def __init__(self, name: str, sources: list[str], record: dict, **kwargs) -> None:
        super().__init__(name, sources=sources, language="c++", **kwargs)
        self.record = record  # the torch it is built against


def torch_extension() -> list[Extension]:
    mode = os.environ.get("GPU_OFFLOAD_TORCH_EXT", "auto").lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"GPU_OFFLOAD_TORCH_EXT must be auto, 0 or 1, not {mode!r}")
    if mode == "0":
        print("gpu_offload: not building gpu_offload._torch_ext (GPU_OFFLOAD_TORCH_EXT=0)", flush=True)
        return []
    try:
        found_in = _find_installing_torch()
        import torch
        from torch.utils import cpp_extension
    except Exception as exc:  # (not only ImportError: a torch found in the installing environment may fail
        # otherwise beside this build's packages; the package builds without the helper then)
        if mode == "1":
            raise SystemExit(f"GPU_OFFLOAD_TORCH_EXT=1 but torch is not importable at build time ({exc}); install "
                             "torch first (or build with --no-build-isolation)") from None
        print(f"gpu_offload: not building gpu_offload._torch_ext (torch is not importable at build time, nor found "
              f"in the installing environment ({type(exc).__name__}: {exc}); pip install --no-build-isolation builds "
              f"it against the installed torch)", flush=True)
        return []
    if found_in is not None:
        print(f"gpu_offload: an isolated build: the helper is built against the installing environment's torch "
              f"{torch.__version__} ({found_in})", flush=True)
    abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    record = {"torch": torch.__version__, "torch_git": getattr(torch.version, "git_version", None) or "",
              "cxx11_abi": bool(abi)}
    # torch's own builder knows which standard its headers need (C++20 from 2.10, C++17 before).
    std = "c++20" if "-std=c++20" in Path(cpp_extension.__file__).read_text() else "c++17"
    folder = ROOT / "csrc" / "torch_ext"
    sources = sorted(str(p.relative_to(ROOT)) for p in folder.glob("*.cpp"))
    return [TorchExtension(
        TORCH_EXT_NAME, sources, record, depends=sorted(str(p.relative_to(ROOT)) for p in folder.glob("*.hpp")),
        include_dirs=[*cpp_extension.include_paths(), str(folder)],
        library_dirs=cpp_extension.library_paths(),
        # The libraries `import torch` has loaded already (no rpath needed: torch is always imported first).
        libraries=["c10", "torch", "torch_cpu", "torch_python"],
        define_macros=[("_GLIBCXX_USE_CXX11_ABI", str(abi)), ("TORCH_API_INCLUDE_EXTENSION_H", None),
                       ("TORCH_EXTENSION_NAME", "_torch_ext"),
                       ("GPU_OFFLOAD_TORCH_EXT_RECORD", json.dumps(json.dumps(record, sort_keys=True)))],
        # (-Wno-subobject-linkage: a file compiled as a member of a unit is an included file, and g++ warns of
        # its file-local types in a class there, which it does not in a file compiled on its own.)
        extra_compile_args=[f"-std={std}", "-O2", "-g0", "-fvisibility=hidden", "-Wno-subobject-linkage"],
    )]


def _cores() -> int:
    """The cores this process may run on (a container's CPU set, where os.cpu_count() names the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _unity_sources(sources: list[str], jobs: int, folder: Path) -> dict[str, list[str]]:
    """The helper's files grouped into `jobs` translation units where there are more files than that: each
    unit is a file written in `folder` that #includes its members (diagnostics still name the member's file
    and line), balanced by the members' sizes. Most of a file's compile is torch's headers (about 20 of its
    25-35 s on a 2-core VM), so that one unit per core parses them once per core instead of once per file:
    on 2 cores the helper then builds in about half the time. With as many cores as files each file is its
    own unit. Returns each source to compile -> the files whose change makes its object stale. (The members
    share one namespace per unit: their file-local names must differ. CI compiles each file on its own
    against another torch's headers, .ci/torch_headers.sh, so that none leans on another's includes.)"""
    if jobs >= len(sources):
        return {src: [src] for src in sources}
    units: list[list[str]] = [[] for _ in range(jobs)]
    weight = [0] * jobs
    size = {src: (ROOT / src).stat().st_size for src in sources}
    for src in sorted(sources, key=lambda s: (-size[s], s)):
        lightest = weight.index(min(weight))
        units[lightest].append(src)
        weight[lightest] += size[src]
    folder.mkdir(parents=True, exist_ok=True)
    grouped = {}
    for i, members in enumerate(units):
        unit = folder / f"unit{i}.cpp"
        text = "".join(f'#include "{(ROOT / m).resolve()}"\n' for m in sorted(members))
        if not unit.exists() or unit.read_text() != text:  # (rewritten only when it changes: its object stays fresh)
            unit.write_text(text)
        grouped[str(unit)] = members
    return grouped


def _compile_in_parallel(compiler: Any, jobs: int, members: dict[str, list[str]], headers: list[str]) -> None:
    """Compiles one extension's sources `jobs` at a time (setuptools compiles them one by one; each of the
    helper's units takes about 25-50 s against torch's headers), the same steps as CCompiler.compile, and skips
    an object newer than its source, the files it includes (`members`: a unit's) and the `headers` when the
    flags (torch's version among them) are the same as last time: `make test`'s second install then compiles
    nothing, and an edit to one file compiles its unit alone."""
    def compile(sources: list[str], output_dir: Any = None, macros: Any = None, include_dirs: Any = None,
                debug: Any = 0, extra_preargs: Any = None, extra_postargs: Any = None, depends: Any = None) -> list[str]:
        macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)
        stamp = Path(output_dir or ".") / "gpu_offload-compile-flags.json"
        flags = json.dumps([list(compiler.compiler_so), cc_args, extra_postargs, pp_opts])
        same = stamp.exists() and stamp.read_text() == flags
        newest = max([os.path.getmtime(h) for h in headers if os.path.exists(h)], default=0.0)

        def fresh(obj: str) -> bool:
            src = build[obj][0]
            inputs = [src, *(str(ROOT / m) for m in members.get(src, []))]
            return same and os.path.exists(obj) and os.path.getmtime(obj) > max(newest, *map(os.path.getmtime, inputs))

        def one(obj: str) -> None:
            src, ext = build[obj]
            compiler._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)

        todo = [obj for obj in objects if obj in build and not fresh(obj)]
        stamp.unlink(missing_ok=True)  # (rewritten once every object is compiled with these flags)
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            list(pool.map(one, todo))
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(flags)
        if len(todo) < len(objects):
            print(f"gpu_offload: {len(objects) - len(todo)} of {len(objects)} objects up to date in {output_dir}",
                  flush=True)
        return objects

    compiler.compile = compile


def build_torch_extension(builder: build_ext, ext: "TorchExtension") -> None:
    print(f"gpu_offload: building {TORCH_EXT_NAME} against torch {ext.record['torch']} "
          f"(C++11 ABI {int(ext.record['cxx11_abi'])})", flush=True)
    jobs = int(os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or _cores())
    # Objects kept beside CMake's build where it is named (setuptools' build_temp is a fresh folder per pip
    # install), so that a second install finds them.
    named = os.environ.get("GPU_OFFLOAD_BUILD_DIR")
    if named:
        builder.build_temp = str(Path(named).resolve() / "torch_ext")
    if all(hasattr(builder.compiler, name) for name in ("_setup_compile", "_get_cc_args", "_compile")):
        members = _unity_sources(ext.sources, jobs, Path(builder.build_temp).resolve() / "units")
        _compile_in_parallel(builder.compiler, jobs, members, headers=list(ext.depends))
        # (The files stay among the depends: setuptools skips the whole build when none is newer than the module.)
        ext.depends = [*ext.depends, *ext.sources]
        ext.sources = list(members)
    try:
        build_ext.build_extension(builder, ext)
    except Exception as exc:  # optional: the package is complete without it
        if os.environ.get("GPU_OFFLOAD_TORCH_EXT", "auto").lower() == "1":
            raise
        print(f"gpu_offload: WARNING: {TORCH_EXT_NAME} failed to build ({exc}); gpu_offload works without it "
              "(pure-Python checks); GPU_OFFLOAD_TORCH_EXT=1 makes this an error", flush=True)


setup(
    version=VERSION,
    ext_modules=[CMakeExtension("gpu_offload._C"), *torch_extension()],
    cmdclass={"build_ext": CMakeBuild},
)
