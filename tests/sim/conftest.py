"""Tests on the simulated CUDA driver (csrc/core/sim_driver.hpp), run by tests/test_sim_driver.py in a process
of their own with GPU_OFFLOAD_SIM set (the driver is chosen at its first use, once per process):

    GPU_OFFLOAD_SIM=2 python -m pytest tests/sim

What stays for a real GPU: anything that needs torch's CUDA (tensors, torch.cuda streams and events,
record_stream, the caching allocator), the real driver's timing and its lazy loading, copies that really
cross PCIe, and the gather/checksum kernels' device code (here their host versions run the same bodies).
"""

from __future__ import annotations

import ctypes
from typing import Any, Iterator

import pytest

from gpu_offload import plan
from gpu_offload._ext import _C

sim = _C._sim


def pytest_configure(config: pytest.Config) -> None:
    if not _C.cuda_available() or not sim.enabled():
        raise pytest.UsageError("tests/sim needs GPU_OFFLOAD_SIM=<devices> (the simulated driver), e.g. "
                                "GPU_OFFLOAD_SIM=2 python -m pytest tests/sim")


def pattern(n: int, seed: int) -> bytes:
    base = bytes(range(256)) * (n // 256 + 2)
    return base[seed % 256:seed % 256 + n]


class Storages:
    """Simulated device storages with a pattern, laid out in a host region 256 bytes apart."""

    def __init__(self, device: int, sizes: list[int], seed: int) -> None:
        self.device = device
        self.sizes = sizes
        self.ptrs = [sim.mem_alloc(device, n) for n in sizes]
        self.offsets: list[int] = []
        extent = 0
        for n in sizes:
            self.offsets.append(extent)
            extent += (n + 255) // 256 * 256
        self.extent = extent
        self.fill(seed)

    def fill(self, seed: int) -> None:
        for k, (p, n) in enumerate(zip(self.ptrs, self.sizes)):
            sim.write(p, pattern(n, seed + k))

    def clear(self) -> None:
        for p, n in zip(self.ptrs, self.sizes):
            sim.write(p, bytes(n))

    def device_is(self, seed: int) -> bool:
        return all(sim.read(p, n) == pattern(n, seed + k) for k, (p, n) in enumerate(zip(self.ptrs, self.sizes)))

    def host_is(self, base: int, seed: int) -> bool:
        return all(ctypes.string_at(base + o, n) == pattern(n, seed + k)
                   for k, (o, n) in enumerate(zip(self.offsets, self.sizes)))

    def plan(self, gather_max_bytes: int = 0) -> Any:
        return _C.CopyPlan(self.device, self.ptrs, self.offsets, self.sizes, gather_max_bytes)


@pytest.fixture
def user_streams(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[int, int]]:
    """A fresh simulated stream per device, made plan.py's current stream (torch's is not there)."""
    streams: dict[int, int] = {}

    def current(device: int) -> int:
        if device not in streams:
            streams[device] = sim.stream_create(device)
        return streams[device]

    monkeypatch.setattr(plan, "current_stream", current)
    yield streams
    sim.clear_failures()
    sim.synchronize()
