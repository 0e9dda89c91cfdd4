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
    "GPU_OFFLOAD_MIN_SLAB_BYTES": ("run", "smallest slab the default arena pins"),
    "GPU_OFFLOAD_PIN": ("run", "how the default arena pins: auto, none, hostalloc, register"),
    "GPU_OFFLOAD_NUM_THREADS": ("run", "threads of the host copy pool"),
    "GPU_OFFLOAD_GATHER_MAX_BYTES": ("run", "storages up to this size go through the gather kernel"),
    "GPU_OFFLOAD_CUDA": ("build", "compile the CUDA backend: auto, 0 or 1"),
    "GPU_OFFLOAD_CUDA_ARCHS": ("build", "CUDA architectures to compile for"),
    "GPU_OFFLOAD_BUILD_DIR": ("build", "where the CMake build lives"),
    "GPU_OFFLOAD_EXPECT_CUDA_BUILD": ("test", "the tests check that the build has (1) or lacks (0) CUDA"),
    "GPU_OFFLOAD_FUZZ_EXAMPLES": ("test", "examples per property of the fuzz tests"),
    "GPU_OFFLOAD_DS_FULL": ("test", "1: the full DeepSpeed test matrix"),
}


def unknown(environ: Optional[Mapping[str, str]] = None) -> list[tuple[str, Optional[str]]]:
    """The GPU_OFFLOAD_* names set in `environ` (default: os.environ) that gpu_offload does not read, each
    with the known name it most resembles (None when none is close)."""
    env = os.environ if environ is None else environ
    out = []
    for name in sorted(env):
        if name.startswith(PREFIX) and name not in VARIABLES:
            # Compared without the prefix, which every name shares.
            close = difflib.get_close_matches(name[len(PREFIX):], [k[len(PREFIX):] for k in VARIABLES], n=1,
                                              cutoff=0.6)
            out.append((name, PREFIX + close[0] if close else None))
    return out


def describe_unknown(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """One sentence per unknown GPU_OFFLOAD_* variable: that it is ignored, and the likely intended name."""
    return [f"{name} is not a gpu_offload setting and is ignored" + (f" (did you mean {near}?)" if near else "")
            for name, near in unknown(environ)]
