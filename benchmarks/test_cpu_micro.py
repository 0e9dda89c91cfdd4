"""CPU micro-benchmarks (pytest-benchmark): the engine beside one contiguous copy of the same bytes.

Run with `make bench-micro` (or `.venv/bin/python -m pytest benchmarks --benchmark-only`). These measure;
they assert nothing about speed. The ratio that matters is snapshot / one-copy in the same run.
"""

from __future__ import annotations

import pytest
import torch

import gpu_offload as go
from gpu_offload import bench

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def qwen_f32():
    # The 339-tensor Qwen2-1.5B layout in float32, scaled down to about 0.2 GB.
    layout = bench.load_layout("qwen1.5b", dtype="float32", scale=32)
    return layout, bench.make_tensors(layout, CPU)


@pytest.fixture(scope="module")
def arena():
    return go.Arena()


def test_one_contiguous_copy(benchmark, qwen_f32):
    layout, _ = qwen_f32
    src = torch.ones(layout.nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    benchmark.extra_info["bytes"] = layout.nbytes
    benchmark(dst.copy_, src)


def test_snapshot(benchmark, qwen_f32, arena):
    layout, tensors = qwen_f32
    benchmark.extra_info["bytes"] = layout.nbytes
    benchmark(lambda: go.snapshot(tensors, arena=arena).free())


def test_restore(benchmark, qwen_f32, arena):
    layout, tensors = qwen_f32
    snap = go.snapshot(tensors, arena=arena)
    benchmark.extra_info["bytes"] = layout.nbytes
    benchmark(go.restore, tensors, snap)
    snap.free()


@pytest.mark.parametrize("name", ["qwen1.5b", "tiny4k"])
def test_host_side_cost_of_a_cached_snapshot(benchmark, name, arena):
    # Shapes scaled to almost no bytes: what is left is the per-call work (cached plan, one C++ call).
    layout = bench.load_layout(name, scale=1 << 20)
    tensors = bench.make_tensors(layout, CPU)
    go.snapshot(tensors, arena=arena).free()
    benchmark.extra_info["tensors"] = layout.num_tensors
    benchmark(lambda: go.snapshot(tensors, arena=arena).free())
