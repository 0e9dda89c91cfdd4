"""Benchmark rows for checkpoint staging (`gpu-offload bench --stager`): `ArenaStager` beside the stager
that torch.distributed.checkpoint itself offers, on the same tensors, first call and steady state.

DCP's stager is `DefaultStager` where this torch has it (2.9 on; pinned memory and non-blocking copies on
a GPU, as its defaults, but synchronous so that the call itself is timed), else
`BlockingAsyncStager(cache_staged_state_dict=True)`. The first call of either includes what it allocates
(and on a GPU pins); the steady state is the median of later calls on the same stager, each one's staged
state dict dropped before the next (as a finished checkpoint write drops it). A DCP stager that cannot stage
twice (torch 2.11's DefaultStager: its second call raises) is timed with a new one each call, and its row says
so.
"""

from __future__ import annotations

import gc
import logging
from typing import Any, Callable

import torch

from . import bench
from .arena import Arena

__all__ = ["dcp_stager", "measure_stager"]

logger = logging.getLogger(__name__)


def dcp_stager(device: torch.device) -> tuple[str, Callable[[], Any]]:
    """What DCP's own stager is for this torch version and device (its class and options), and a factory."""
    pinned = device.type == "cuda"
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        return ("BlockingAsyncStager(cache_staged_state_dict=True)",
                lambda: BlockingAsyncStager(cache_staged_state_dict=True))
    options = StagingOptions(use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=False,
                             use_non_blocking_copy=pinned)
    return f"DefaultStager(pinned={pinned})", lambda: DefaultStager(options)


def measure_stager(b: bench.Bench) -> list[bench.Row]:
    """A bench group: ArenaStager and DCP's stager staging the layout's tensors (device to host), each on
    its first call and in steady state; ratios are to the same run's one-contiguous-copy limit."""
    from .checkpoint import ArenaStager

    tensors = b.tensors
    rows: list[bench.Row] = []

    def measure(name: str, label: str, make: Callable[[], Any], kind: str, first_note: str, steady_note: str) -> None:
        held: dict[str, Any] = {"stager": make()}

        def stage() -> None:
            held["sd"] = held["stager"].stage(tensors)

        def drop() -> None:
            held.pop("sd", None)

        rows.append(b.measure(f"{name} first", "d2h", stage, repeats=1, warmup=0, note=f"first call: {first_note}",
                              kind=kind))
        try:
            rows.append(b.measure(f"{name} steady", "d2h", stage, setup=drop, note=f"steady state: {steady_note}",
                                  kind=kind))
        except Exception as exc:
            if kind == "engine":
                raise
            # A baseline that cannot stage twice (torch 2.11's DefaultStager closes its inner stager at the end
            # of each stage(), and its second call raises KeyError): its steady state is then a new one per
            # checkpoint, which is what its users get.
            why = f"its second stage() raised {type(exc).__name__} in torch {torch.__version__}"
            logger.warning("%s: %s; its steady state is timed with a new stager each call", name, why)

            def renew() -> None:
                drop()
                held["stager"].close()
                held["stager"] = make()

            rows.append(b.measure(f"{name} steady", "d2h", stage, setup=renew, kind=kind,
                                  note=f"steady state: a new {label} each call ({why})"))
        drop()
        held["stager"].close()

    arena = Arena()  # a fresh arena: the first call pins what the checkpoint needs
    measure("ArenaStager", "ArenaStager", lambda: ArenaStager(arena), "engine", "a fresh arena, pinning included",
            "the arena reused, nothing pinned")
    del arena
    gc.collect()

    what, make = dcp_stager(b.device)
    measure("DCP stager", what, make, "baseline", f"torch's {what}, an empty cache, allocation"
            + (" and pinning" if b.device.type == "cuda" else "") + " included", f"{what}, its cached host copies reused")
    bench._release_torch_pinned()
    return rows
