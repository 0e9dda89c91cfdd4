"""CUDA graph capture: what the engine refuses under it, and how it queries events without breaking it.

Under `torch.cuda.graph(...)` (or `CUDAGraph.capture_begin`) the engine's streams would join the capture
(host and chunk-table addresses baked into the graph, replayed later into whatever lives there then), and
`cudaEventQuery` / `cudaEventSynchronize` are illegal in the capturing thread in torch's default ("global")
capture mode: they fail and invalidate the capture. So every public entry refuses while the current stream
captures, and the bookkeeping that queries events (arena reaping, the overlap join) skips or relaxes its
queries there, as torch's caching allocator skips its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from typing import Any, Iterator, Optional

import torch

from ._errors import OffloadError

logger = logging.getLogger("gpu_offload")

ADVICE = ("call gpu_offload.join() and wait for snapshots (snap.wait()) before capturing, and snapshot, restore, "
          "offload, reload or swap outside the capture")


def capturing() -> bool:
    """Whether the calling thread's current CUDA stream is capturing a graph. Never initializes CUDA (a
    process that has not initialized it cannot be capturing)."""
    if not torch.cuda.is_initialized():
        return False
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except Exception:  # a torch without CUDA graphs
        return False


def refuse(op: str) -> None:
    """Raises OffloadError when the current stream is capturing a CUDA graph."""
    if capturing():
        raise OffloadError(f"cannot {op} while the current CUDA stream is capturing a CUDA graph "
                           f"(torch.cuda.graph): the copies cannot be part of a graph; {ADVICE}")


# -- relaxed capture mode -------------------------------------------------------------------------------
# cuThreadExchangeStreamCaptureMode (driver API): a thread in relaxed mode may query events recorded
# outside a capture while it, or another thread, captures (torch does the same around cudaMalloc).
_RELAXED = 2
_lib_lock = threading.Lock()
_exchange: Optional[Any] = None
_exchange_loaded = False


def _exchange_fn() -> Optional[Any]:
    global _exchange, _exchange_loaded
    with _lib_lock:
        if not _exchange_loaded:
            _exchange_loaded = True
            try:
                fn = ctypes.CDLL("libcuda.so.1").cuThreadExchangeStreamCaptureMode
                fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
                fn.restype = ctypes.c_int
                _exchange = fn
            except (OSError, AttributeError) as exc:
                logger.debug("cuThreadExchangeStreamCaptureMode is not available: %s", exc)
        return _exchange


@contextlib.contextmanager
def relaxed() -> Iterator[bool]:
    """The calling thread in relaxed capture mode for the block (yields False, changing nothing, where CUDA
    is not initialized or the driver cannot be reached)."""
    fn = _exchange_fn() if torch.cuda.is_initialized() else None
    mode = ctypes.c_int(_RELAXED)
    if fn is None or fn(ctypes.byref(mode)) != 0:
        yield False
        return
    try:
        yield True
    finally:
        fn(ctypes.byref(mode))  # back to the thread's previous mode
