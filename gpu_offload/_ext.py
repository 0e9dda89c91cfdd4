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

__all__ = ["_C"]
