"""gpu_offload: GPU<->CPU snapshots of PyTorch training state through a pinned host arena.

    import gpu_offload as go
    snap = go.snapshot(model)        # point-in-time copy into pinned host memory; returns at once
    go.restore(model, snap)          # copy back in place
    go.offload([model, optimizer])   # move out and free the device memory
    go.reload([model, optimizer])    # same objects, same values
"""

from __future__ import annotations

from typing import Any

from ._errors import LayoutMismatchError, OffloadError
from ._ext import _C
from ._version import __version__
from .api import discard, is_offloaded, join, offload, offloaded_bytes, reload, restore, snapshot, swap
from .arena import Arena, default_arena, memory_stats
from .persist import load, save, save_state_dict
from .snapshot import Snapshot

__all__ = [
    "Arena",
    "LayoutMismatchError",
    "OffloadError",
    "Snapshot",
    "__version__",
    "build_info",
    "cuda_available",
    "default_arena",
    "discard",
    "is_offloaded",
    "join",
    "load",
    "memory_stats",
    "offload",
    "offloaded_bytes",
    "reload",
    "restore",
    "save",
    "save_state_dict",
    "snapshot",
    "swap",
]


def __dir__() -> list[str]:
    # The API, not the modules it is made of (api, arena, plan, ...: importable, but not the interface).
    return sorted(__all__)


def cuda_available() -> bool:
    """True when this build has CUDA code and a CUDA driver and device answer."""
    return bool(_C.cuda_compiled() and _C.cuda_available())


def build_info() -> dict[str, Any]:
    """How the extension was built and what of CUDA it finds: version, whether the CUDA backend is in, the
    fatbin's architectures, and (loading the driver, creating no context) the driver's version, the entry
    points found, whether copies are batched, NVRTC, and where each device's kernels came from once its
    streams exist (fatbin, NVRTC, or none: the copy engines then do every copy)."""
    compiled = bool(_C.cuda_compiled())
    archs = _C.cuda_architectures()
    cuda = _C.cuda_info() if compiled else None
    return {
        "version": __version__,
        "core_version": _C.version(),
        "cuda": compiled,
        # Kept for callers that read it: no CUDA runtime is linked any more (the driver is in cuda_driver).
        "cuda_runtime_version": None,
        "cuda_architectures": [a for a in archs.split(",") if a] if compiled else [],
        "cuda_driver": cuda,
        "arena_alignment": int(_C.ARENA_ALIGNMENT),
    }
