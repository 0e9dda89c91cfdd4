"""CUDA graph capture: what the engine refuses under it, and how it queries events without breaking it.

Under `torch.cuda.graph(...)` (or `CUDAGraph.capture_begin`) the engine's streams would join the capture
(host and chunk-table addresses baked into the graph, replayed later into whatever lives there then). So
every public entry refuses while the current stream captures, before anything is allocated or enqueued (the
core refuses a capturing stream too, as a last check). Event queries and waits run in relaxed capture mode
in the core (in torch's default "global" mode they would fail and invalidate the capture); the arena still
checks no event while the caller captures, as torch's caching allocator does, and reaps later.
"""

from __future__ import annotations

import torch

from ._errors import OffloadError

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
