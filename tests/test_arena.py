"""Arena bookkeeping through the Python API: reuse, coalescing, fragmentation, cap, steady state."""

from __future__ import annotations

import os

import pytest
import torch

import gpu_offload as go

_MIB = 1 << 20


def test_steady_state_pins_nothing_new(arena):
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    for cycle in range(5):
        v1 = go.snapshot(model, arena=arena)
        go.offload([model, opt], arena=arena)
        go.reload([model, opt])
        go.restore(model, v1)
        v1.free()
        if cycle == 0:
            slabs = arena.stats()["num_slab_allocations"]
            capacity = arena.capacity_bytes
    assert arena.stats()["num_slab_allocations"] == slabs
    assert arena.capacity_bytes == capacity
    assert arena.used_bytes == 0


def test_free_in_any_order_coalesces_back_to_one_block(arena):
    arena.reserve(4 * _MIB)  # one slab for them all (the first slab would otherwise be the first region's size)
    sizes = [1000, 50_000, 7, 300_000, 4096, 123_456]
    snaps = [go.snapshot({"t": torch.zeros(n, dtype=torch.uint8)}, arena=arena) for n in sizes]
    stats = arena.stats()
    assert stats["num_regions"] == len(sizes) and stats["num_slabs"] == 1
    for i in (3, 0, 5, 1, 4, 2):
        snaps[i].free()
    stats = arena.stats()
    assert stats["used_bytes"] == 0 and stats["num_free_blocks"] == 1
    assert stats["largest_free_block_bytes"] == stats["capacity_bytes"]


def test_holes_are_reused_best_fit(arena):
    arena.reserve(4 * _MIB)  # one slab for them all
    a = go.snapshot({"t": torch.zeros(_MIB, dtype=torch.uint8)}, arena=arena)
    sep = go.snapshot({"t": torch.zeros(10, dtype=torch.uint8)}, arena=arena)
    b = go.snapshot({"t": torch.zeros(_MIB // 4, dtype=torch.uint8)}, arena=arena)
    sep2 = go.snapshot({"t": torch.zeros(10, dtype=torch.uint8)}, arena=arena)
    hole_small = b._region.ptr
    a.free()
    b.free()
    c = go.snapshot({"t": torch.zeros(_MIB // 4, dtype=torch.uint8)}, arena=arena)
    assert c._region.ptr == hole_small  # the 256 KiB hole, not the 1 MiB one
    assert arena.stats()["num_slabs"] == 1
    for s in (c, sep, sep2):
        s.free()


def test_grows_by_slabs_and_trims(arena):
    big = go.snapshot({"t": torch.zeros(6 * _MIB, dtype=torch.uint8)}, arena=arena)  # > 4 MiB min slab
    assert arena.stats()["num_slabs"] == 1 and arena.capacity_bytes >= 6 * _MIB
    small = go.snapshot({"t": torch.zeros(_MIB, dtype=torch.uint8)}, arena=arena)
    assert arena.stats()["num_slabs"] == 2
    big.free()
    assert arena.trim() >= 6 * _MIB
    assert arena.stats()["num_slabs"] == 1
    small.free()
    arena.trim()
    assert arena.capacity_bytes == 0


def test_reserve_pins_ahead(arena):
    arena.reserve(10 * _MIB)
    capacity = arena.capacity_bytes
    assert capacity >= 10 * _MIB and arena.used_bytes == 0
    go.snapshot({"t": torch.zeros(10 * _MIB, dtype=torch.uint8)}, arena=arena).free()
    assert arena.capacity_bytes == capacity and arena.stats()["num_slab_allocations"] == 1


def test_arena_overhead_is_small_for_many_tensors(arena):
    # Thousands of small storages: alignment padding must stay a few percent of the payload.
    state = {f"t{i}": torch.zeros(2048, dtype=torch.bfloat16) for i in range(2000)}
    snap = go.snapshot(state, arena=arena)
    assert snap.layout.host_bytes <= 1.02 * snap.nbytes
    snap.free()


def test_default_arena_is_shared():
    assert go.default_arena() is go.default_arena()
    snap = go.snapshot({"a": torch.ones(4)})
    assert snap.arena is go.default_arena()
    snap.free()


def test_an_empty_arena_takes_any_request_under_its_cap():
    arena = go.Arena(max_bytes=8 * _MIB, min_slab_bytes=2 * _MIB)
    snaps = [go.snapshot({"t": torch.zeros(2 * _MIB, dtype=torch.uint8)}, arena=arena) for _ in range(4)]
    for s in snaps:
        s.free()
    assert arena.stats()["num_slabs"] == 4 and arena.used_bytes == 0  # four empty slabs fill the cap
    whole = go.snapshot({"t": torch.ones(8 * _MIB, dtype=torch.uint8)}, arena=arena)
    assert bool((whole.tensors()["t"] == 1).all()) and arena.capacity_bytes <= 8 * _MIB
    whole.free()
    try:
        go.snapshot({"t": torch.zeros(9 * _MIB, dtype=torch.uint8)}, arena=arena)
        raise AssertionError("expected the cap to refuse")
    except go.OffloadError as exc:
        assert "larger than max_bytes" in str(exc) and "largest free block" not in str(exc)


@pytest.mark.cuda
def test_pinned_slabs_are_not_inherited_by_a_forked_child():
    # A DataLoader worker forks: it must not share the pinned pages copy-on-write (MADV_DONTFORK).
    arena = go.Arena(min_slab_bytes=2 * _MIB, pin="register")
    snap = go.snapshot({"t": torch.ones(_MIB, dtype=torch.uint8, device="cuda")}, arena=arena)
    snap.wait()
    ptr = snap._live().ptr
    pid = os.fork()
    if pid == 0:  # the child: only look at its own mappings, then leave at once
        code = 3
        try:
            with open("/proc/self/maps") as f:
                mapped = any(int(lo, 16) <= ptr < int(hi, 16)
                             for lo, hi in (line.split()[0].split("-") for line in f))
            code = 1 if mapped else 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0, "the pinned slab is mapped in the forked child"
    assert bool((snap.tensors()["t"] == 1).all())
    snap.free()


def test_host_memory_figure_can_be_set_for_machines_whose_memory_grows(monkeypatch):
    """GPU_OFFLOAD_HOST_MEMORY_BYTES replaces MemAvailable in the pinning check (a VM whose memory grows as
    it is used starts with a small MemAvailable): a slab above it is refused, 0 turns the check off, and a
    value that is not a byte count is a clear error."""
    from gpu_offload._ext import _C

    monkeypatch.setenv("GPU_OFFLOAD_HOST_MEMORY_BYTES", str(3 * _MIB))
    assert _C.available_host_memory() == 3 * _MIB
    small = go.Arena(min_slab_bytes=4 * _MIB, pin="none")
    with pytest.raises(go.OffloadError, match="refusing to pin"):
        small.reserve(4 * _MIB)  # a 4 MiB slab, above the 3 MiB given
    assert small.capacity_bytes == 0
    monkeypatch.setenv("GPU_OFFLOAD_HOST_MEMORY_BYTES", "0")
    assert _C.available_host_memory() == 0
    small.reserve(4 * _MIB)
    assert small.capacity_bytes >= 4 * _MIB
    monkeypatch.setenv("GPU_OFFLOAD_HOST_MEMORY_BYTES", "12 apples")
    with pytest.raises(go.OffloadError, match="GPU_OFFLOAD_HOST_MEMORY_BYTES"):
        go.Arena(min_slab_bytes=64 * _MIB, pin="none").reserve(64 * _MIB)
    monkeypatch.delenv("GPU_OFFLOAD_HOST_MEMORY_BYTES")
    assert _C.available_host_memory() > 0
