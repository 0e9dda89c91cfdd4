"""Cached copy plans: a bound layout turned into one _C.CopyPlan per device.

The pointer arrays are built once per (storage pointers, sizes, host offsets) and kept in C++; a training
loop that snapshots the same model every step reuses them, and per-call Python work stays per storage,
never per byte.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Optional, Sequence

import torch

from ._errors import OffloadError
from ._ext import _C

_MAX_CACHED = 64
_cache: "OrderedDict[tuple, CopyPlans]" = OrderedDict()
_cache_lock = threading.Lock()


def _device_index(device: torch.device) -> int:
    if device.type == "cpu":
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


class CopyPlans:
    """The copies for one target layout, grouped by device."""

    def __init__(self, groups: list[tuple[int, Any]]) -> None:
        self.groups = groups  # (device index or -1, _C.CopyPlan)

    @property
    def num_copies(self) -> int:
        return sum(p.num_copies for _, p in self.groups)

    def run(self, to_host: bool, host_base: int, waits: Sequence[Any] = (), stream_waits: bool = True) -> list[Any]:
        """Runs every group; returns the completion events of the device groups (host groups finish
        before this returns). Device groups are ordered after their current stream's pending work."""
        events: list[Any] = []
        wait_list = [e for e in waits if e is not None]
        for device, plan in self.groups:
            stream = torch.cuda.current_stream(device).cuda_stream if device >= 0 else 0
            event = plan.run(to_host, host_base, stream, wait_list, stream_waits)
            if event is not None:
                events.append(event)
        return events


def build(entries: Sequence[tuple[torch.device, int, int, int]]) -> CopyPlans:
    """Plans copies of (device, device pointer, host offset, nbytes) entries; cached by their values."""
    key = tuple((str(d), p, o, n) for d, p, o, n in entries)
    with _cache_lock:
        plans = _cache.get(key)
        if plans is not None:
            _cache.move_to_end(key)
            return plans
    by_device: dict[int, tuple[list[int], list[int], list[int]]] = {}
    for device, ptr, offset, nbytes in entries:
        if nbytes == 0:
            continue
        idx = _device_index(device)
        ptrs, offsets, sizes = by_device.setdefault(idx, ([], [], []))
        ptrs.append(ptr)
        offsets.append(offset)
        sizes.append(nbytes)
    if any(idx >= 0 for idx in by_device) and not _C.cuda_compiled():
        raise OffloadError("the target has CUDA tensors but gpu_offload was built without CUDA; "
                           "reinstall with nvcc available (GPU_OFFLOAD_CUDA=1)")
    plans = CopyPlans([(idx, _C.CopyPlan(idx, *arrays)) for idx, arrays in sorted(by_device.items())])
    with _cache_lock:
        _cache[key] = plans
        while len(_cache) > _MAX_CACHED:
            _cache.popitem(last=False)
    return plans


def cache_info() -> dict[str, int]:
    with _cache_lock:
        return {"num_plans": len(_cache)}


def clear_cache() -> None:
    with _cache_lock:
        _cache.clear()


def cuda_devices(groups: Optional[CopyPlans]) -> list[int]:
    return [] if groups is None else [d for d, _ in groups.groups if d >= 0]
