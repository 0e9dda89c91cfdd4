"""Integrity: a checksum of every storage, taken from the source as it is copied and checked against copies.

The checksum (csrc/core/checksum.hpp) is one 64-bit value per storage, the same whether a kernel computes
it on the GPU or a thread computes it on the host, so a sum taken from device memory at snapshot time can
be checked against the host copy, a file on disk, or the device memory a restore wrote.

    snap = gpu_offload.snapshot(model, checksum=True)   # sums enqueued before the copy, in stream order
    snap.verify()                                       # recomputed over the host copy
    gpu_offload.restore(model, snap, verify=True)       # host copy checked first, restored data after
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional, Sequence

import torch

from ._errors import OffloadError
from ._ext import _C
from .plan import device_index
from .storages import Layout

logger = logging.getLogger("gpu_offload")

_MAX_REPORT = 5


class Checksums:
    """The checksums of a layout's storages, those of GPU storages possibly still being computed."""

    def __init__(self, values: list[Optional[int]], jobs: Sequence[tuple[list[int], Any]] = ()) -> None:
        self._values = values
        self._jobs = list(jobs)  # (storage indices, _C.ChecksumJob) per device

    def done(self) -> bool:
        """True once every sum is on the host; never blocks."""
        return all(job.done() for _, job in self._jobs)

    def result(self) -> list[int]:
        """The checksums, one per storage, waiting (without the GIL) for those computed on a GPU."""
        if self._jobs:
            for indices, job in self._jobs:
                for i, value in zip(indices, job.result()):
                    self._values[i] = value
            self._jobs = []
        return [int(v) for v in self._values]  # type: ignore[arg-type]


def compute(layout: Layout, ptrs: Sequence[int]) -> Checksums:
    """Checksums of live storages: `ptrs[i]` is the data pointer of `layout.storages[i]`.

    CPU storages are summed now. For CUDA storages the kernel is enqueued on each device's current stream,
    so it reads the data as of the work enqueued before this call, as the copy that follows it does.
    """
    groups: dict[int, list[int]] = {}
    for i, spec in enumerate(layout.storages):
        groups.setdefault(device_index(spec.device), []).append(i)
    values: list[Optional[int]] = [None] * len(layout.storages)
    jobs: list[tuple[list[int], Any]] = []
    for device, indices in sorted(groups.items()):
        sizes = [layout.storages[i].nbytes for i in indices]
        dptrs = [int(ptrs[i]) if n else 0 for i, n in zip(indices, sizes)]
        if device < 0:
            for i, value in zip(indices, _C.checksum_host(dptrs, sizes)):
                values[i] = value
        else:
            stream = torch.cuda.current_stream(device).cuda_stream
            jobs.append((indices, _C.checksum_device_async(device, dptrs, sizes, stream)))
    return Checksums(values, jobs)


def host_checksums(layout: Layout, host_base: int) -> list[int]:
    """Checksums of a layout's storages as they lie in a host region starting at `host_base`."""
    sizes = [s.nbytes for s in layout.storages]
    return list(_C.checksum_host([host_base + s.host_offset for s in layout.storages], sizes))


def check(layout: Layout, expected: Sequence[int], actual: Sequence[int], what: str) -> None:
    """Raises OffloadError naming the storages whose checksums differ (the first few, and how many)."""
    if len(expected) != len(actual):
        raise OffloadError(f"{what}: {len(actual)} checksums for {len(expected)} storages")
    bad = [i for i, (e, a) in enumerate(zip(expected, actual)) if e != a]
    if not bad:
        return
    details = []
    for i in bad[:_MAX_REPORT]:
        spec = layout.storages[i]
        details.append(f"storage {i} ({spec.name}, {spec.nbytes} bytes, {spec.device}): "
                       f"expected {expected[i]:#018x}, got {actual[i]:#018x}")
    more = f" (+{len(bad) - _MAX_REPORT} more)" if len(bad) > _MAX_REPORT else ""
    raise OffloadError(f"{what}: checksum mismatch in {len(bad)} of {len(expected)} storages: "
                       + "; ".join(details) + more)


def verify_host(layout: Layout, host_base: int, expected: Sequence[int], what: str = "snapshot") -> None:
    """Recomputes the checksums over a host region and raises OffloadError on a mismatch."""
    start = time.perf_counter()
    check(layout, expected, host_checksums(layout, host_base), f"{what} host copy is corrupt")
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("verified %d storages, %d bytes in %.3f ms", len(layout.storages), layout.nbytes,
                     (time.perf_counter() - start) * 1e3)


def verify_storages(layout: Layout, ptrs: Sequence[int], expected: Sequence[int], what: str) -> None:
    """Recomputes the checksums of live storages (on their devices, after the work already enqueued) and
    raises OffloadError on a mismatch. Blocks until the GPU sums are on the host."""
    check(layout, expected, compute(layout, ptrs).result(), what)
