"""Benchmark rows for checkpoint staging (`gpu-offload bench --stager`): `ArenaStager` beside the stager
that torch.distributed.checkpoint itself offers, on the same tensors, first call and steady state.

DCP's stager is `DefaultStager` where this torch has it (2.9 on; pinned memory and non-blocking copies on
a GPU, as its defaults, but synchronous so that the call itself is timed), else
`BlockingAsyncStager(cache_staged_state_dict=True)`. The first call of either includes what it allocates
(and on a GPU pins); the steady state is the median of later calls on the same stager, each one's staged
state dict dropped before the next (as a finished checkpoint write drops it).
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Optional

import torch

from . import bench
from .arena import Arena

__all__ = ["dcp_stager", "rows"]


def dcp_stager(device: torch.device) -> tuple[str, Callable[[], Any]]:
    """The name and a factory of DCP's own stager for this torch version and device."""
    pinned = device.type == "cuda"
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        return ("DCP BlockingAsyncStager(cache_staged_state_dict=True)",
                lambda: BlockingAsyncStager(cache_staged_state_dict=True))
    options = StagingOptions(use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=False,
                             use_non_blocking_copy=pinned)
    return f"DCP DefaultStager(pinned={pinned})", lambda: DefaultStager(options)


def rows(layout: bench.Layout, device: torch.device, *, repeats: int = 5, limit_gbps: Optional[float] = None,
         progress: Optional[Callable[[str], None]] = None) -> list[bench.Row]:
    """Times ArenaStager and DCP's stager staging the layout's tensors (device to host); returns rows in
    the shape of bench.run's (ratio: to `limit_gbps`, the same run's one-contiguous-copy limit)."""
    from .checkpoint import ArenaStager

    step = progress or (lambda _name: None)
    tensors = bench.make_tensors(layout, device)
    nbytes = layout.nbytes
    out: list[bench.Row] = []

    def add(method: str, seconds: float, note: str) -> None:
        gbps = nbytes / seconds / 1e9
        out.append(bench.Row(method=method, direction="d2h", seconds=seconds, nbytes=nbytes, gbps=gbps,
                             ratio=None if not limit_gbps else gbps / limit_gbps, note=note))

    def measure(name: str, stager: Any, first_note: str, steady_note: str) -> None:
        held: dict[str, Any] = {}

        def stage() -> None:
            held["sd"] = stager.stage(tensors)

        def drop() -> None:
            held.pop("sd", None)

        add(f"{name} first call", bench._time(stage, device, 1, warmup=0), first_note)
        add(f"{name} steady state", bench._time(stage, device, repeats, setup=drop), steady_note)
        drop()
        stager.close()

    step("ArenaStager")
    arena = Arena()  # a fresh arena: the first call pins what the checkpoint needs
    measure("ArenaStager", ArenaStager(arena), "fresh arena, pinning included", "arena reused, nothing pinned")
    del arena
    gc.collect()

    name, make = dcp_stager(device)
    step(name)
    measure(name, make(), "empty cache, allocation" + (" and pinning" if device.type == "cuda" else "") + " included",
            "cached host copies reused")
    bench._release_torch_pinned()
    return out
