"""Every GPU_OFFLOAD_* environment variable, in one place.

`gpu-offload info` lists the ones set and flags any other GPU_OFFLOAD_* name (a typo such as
GPU_OFFLOAD_MAX_BYTES would otherwise be ignored without a word), and the default arena logs a warning for
them when it is created. Code that reads a new variable adds it here: tests/test_cli.py fails for a
variable read by the package, the build or the tests that is missing here, and for one listed here that
nothing reads.
"""

from __future__ import annotations

import difflib
import os
from typing import Mapping, Optional

PREFIX = "GPU_OFFLOAD_"

# name: (when it is read, what it sets)
VARIABLES: dict[str, tuple[str, str]] = {
    "GPU_OFFLOAD_ARENA_MAX_BYTES": ("run", "hard cap on the default arena's capacity"),
    "GPU_OFFLOAD_MIN_SLAB_BYTES": ("run", "the size the default arena's shared slabs grow to"),
    "GPU_OFFLOAD_NODE_MAX_BYTES": ("run", "one host-memory budget for every process of the node (bytes or a fraction)"),
    "GPU_OFFLOAD_LEDGER_DIR": ("run", "where the node's ledger of pinned bytes lives (default /dev/shm)"),
    "GPU_OFFLOAD_SYSFS_ROOT": ("run", "where the GPUs' NUMA nodes are read (default /sys)"),
    "GPU_OFFLOAD_HOST_MEMORY_BYTES": ("run", "host memory to assume available instead of MemAvailable (0: no check)"),
    "GPU_OFFLOAD_PIN": ("run", "how the default arena pins: auto, none, hostalloc, register"),
    "GPU_OFFLOAD_NUM_THREADS": ("run", "threads of the host copy pool"),
    "GPU_OFFLOAD_GATHER_MAX_BYTES": ("run", "storages up to this size go through the gather kernel"),
    "GPU_OFFLOAD_KERNELS": ("run", "where the kernels come from: auto, fatbin, nvrtc, off"),
    "GPU_OFFLOAD_BATCHED_COPIES": ("run", "0: one cuMemcpyAsync per copy even where the driver batches"),
    "GPU_OFFLOAD_NVRTC": ("run", "the libnvrtc to compile the kernels with"),
    "GPU_OFFLOAD_CACHE_DIR": ("run", "where NVRTC's compiled kernels are cached (default ~/.cache/gpu_offload)"),
    "GPU_OFFLOAD_TORCH_EXT": ("build", "the torch-aware helper: auto, 1 or 0 (0 at run time: the pure-Python path)"),
    "GPU_OFFLOAD_SIM": ("test", "a simulated CUDA driver with this many devices instead of libcuda"),
    "GPU_OFFLOAD_CUDA": ("build", "compile the CUDA backend: auto, 0 or 1"),
    "GPU_OFFLOAD_CUDA_ARCHS": ("build", "CUDA architectures to compile for"),
    "GPU_OFFLOAD_BUILD_DIR": ("build", "where the CMake build lives"),
    "GPU_OFFLOAD_EXPECT_CUDA_BUILD": ("test", "the tests check that the build has (1) or lacks (0) CUDA"),
    "GPU_OFFLOAD_FUZZ_EXAMPLES": ("test", "examples per property of the fuzz tests"),
    "GPU_OFFLOAD_DS_FULL": ("test", "1: the full DeepSpeed test matrix"),
    "GPU_OFFLOAD_EXPECT_FATBIN": ("test", "the tests check that the build embeds the kernels' fatbin (1, default) or not"),
    "GPU_OFFLOAD_EXPECT_KERNELS": ("test", "where the simulator tests expect the kernels to come from"),
    "GPU_OFFLOAD_CI_CACHE": ("test", "where .ci/run keeps downloaded wheels"),
}


def unknown(environ: Optional[Mapping[str, str]] = None) -> list[tuple[str, Optional[str]]]:
    """The GPU_OFFLOAD_* names set in `environ` (default: os.environ) that gpu_offload does not read, each
    with the known names it most resembles ("A or B" when two are about as close; None when none is)."""
    env = os.environ if environ is None else environ
    out = []
    for name in sorted(env):
        if name.startswith(PREFIX) and name not in VARIABLES:
            # Compared without the prefix, which every name shares.
            typed = name[len(PREFIX):]
            close = difflib.get_close_matches(typed, [k[len(PREFIX):] for k in VARIABLES], n=2, cutoff=0.6)
            if len(close) == 2:  # MAX_BYTES: ARENA_MAX_BYTES or NODE_MAX_BYTES, not the first one alone
                ratios = [difflib.SequenceMatcher(None, typed, c).ratio() for c in close]
                if ratios[0] - ratios[1] > 0.05:
                    close = close[:1]
            out.append((name, " or ".join(PREFIX + c for c in close) if close else None))
    return out


def describe_unknown(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """One sentence per unknown GPU_OFFLOAD_* variable: that it is ignored, and the likely intended name."""
    return [f"{name} is not a gpu_offload setting and is ignored" + (f" (did you mean {near}?)" if near else "")
            for name, near in unknown(environ)]
