"""Loads the compiled core and routes its errors into OffloadError. Importing it makes no CUDA call."""

from __future__ import annotations

from ._errors import OffloadError

try:
    from . import _C  # type: ignore[attr-defined]
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(
        "gpu_offload._C is not built: install the package with `pip install -e .` (or `make test`)"
    ) from exc

_C._set_error_type(OffloadError)


def _nvidia_dirs() -> list[str]:
    """site-packages/nvidia folders on sys.path, where the pip wheels of CUDA components (torch's
    nvidia-cuda-nvrtc among them) put their libraries: searched for libnvrtc when kernels are first needed.
    (A few stat calls; nothing touches CUDA here.)"""
    import os
    import sys

    return [d for d in (os.path.join(p or ".", "nvidia") for p in sys.path) if os.path.isdir(d)]


_C._set_library_dirs(_nvidia_dirs())

__all__ = ["_C"]
