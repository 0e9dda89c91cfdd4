"""GPU-only behaviour: stream order, memory really freed, copies overlapping work. Skipped without a GPU.

Stream order is checked with gates (cuda_gates.py): a copy or the work around it is held on a host-released
wait while the test looks, so nothing depends on a clock rate."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

import gpu_offload as go
from conftest import assert_bitwise_equal
from cuda_gates import engine_stream, hold, recorded, settle, warm

pytestmark = pytest.mark.cuda


def _ready() -> None:
    """Before a gate: kernels loaded, the engine's streams made, the default arena's slab pinned."""
    warm()
    go.snapshot({"w": torch.ones(1024, device="cuda")}).wait().free()
    go.default_arena().reserve(256 << 20)
    torch.cuda.synchronize()


def test_snapshot_sees_work_enqueued_before_it_and_not_after():
    _ready()
    w = torch.zeros(64 << 20, device="cuda")  # 256 MiB
    torch.cuda.synchronize()
    # Before: with the current stream held, the fill and the copy after it wait; a copy that did not wait
    # for the stream would read the zeros at once.
    with hold(torch.cuda.current_stream()) as gate:
        w.fill_(1.0)  # enqueued before the snapshot: must be in it
        snap = go.snapshot({"w": w})
        assert not settle(snap._pending()[0]), "the copy ran before the work enqueued ahead of it"
        gate.release()
    assert bool((snap.wait().tensors()["w"] == 1.0).all())
    snap.free()
    # After: with the copy held, work enqueued after the snapshot must wait for it.
    with hold(engine_stream(0, to_host=True)) as gate:
        snap = go.snapshot({"w": w})
        w.fill_(2.0)  # enqueued after: must not reach the snapshot
        assert not settle(recorded()), "work enqueued after the snapshot ran before its copy"
        gate.release()
    assert bool((snap.wait().tensors()["w"] == 1.0).all())
    torch.cuda.synchronize()
    assert bool((w == 2.0).all())
    snap.free()


def test_restore_is_seen_by_later_work():
    _ready()
    w = torch.full((16 << 20,), 3.0, device="cuda")
    snap = go.snapshot({"w": w})
    w.zero_()
    torch.cuda.synchronize()
    with hold(engine_stream(0, to_host=False)) as gate:
        go.restore({"w": w}, snap)
        seen = (w == 3.0).all()  # enqueued after the restore on the same stream: must see it
        assert not settle(recorded()), "work enqueued after the restore ran before its copy"
        gate.release()
    assert bool(seen.item())
    snap.free()


def test_snapshot_returns_before_the_copy_finishes_and_wait_completes_it():
    _ready()
    w = torch.randn(32 << 20, device="cuda")
    torch.cuda.synchronize()
    with hold(engine_stream(0, to_host=True)) as gate:
        snap = go.snapshot({"w": w})  # returns with the copy held: the CPU was not blocked
        assert not snap.done()
        gate.release()
    snap.wait()
    assert snap.done()
    assert_bitwise_equal(snap.tensors()["w"].cuda(), w)
    snap.free()


def test_offload_frees_device_memory_and_reload_brings_it_back():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)]).cuda()
    payload = sum(p.numel() * p.element_size() for p in model.parameters())
    expected = [p.detach().clone() for p in model.parameters()]
    before = torch.cuda.memory_allocated()
    go.offload(model)
    after = torch.cuda.memory_allocated()
    assert before - after >= payload
    assert torch.cuda.memory_reserved() <= before - payload + (64 << 20)
    go.reload(model)
    assert torch.cuda.memory_allocated() == before
    for p, e in zip(model.parameters(), expected):
        assert_bitwise_equal(p, e)
    model(torch.randn(4, 1024, device="cuda")).sum().backward()


def test_arena_is_pinned_on_a_gpu_machine():
    arena = go.Arena(min_slab_bytes=4 << 20)
    go.snapshot({"w": torch.ones(10, device="cuda")}, arena=arena).free()
    assert arena.pin_mode in ("register", "hostalloc")


def test_mixed_cpu_and_cuda_target(arena):
    state = {"gpu": torch.randn(1000, device="cuda"), "cpu": torch.randn(1000), "step": torch.tensor(3.0)}
    _round_trip(state, arena)


def test_many_small_tensors_round_trip(arena):
    _round_trip({f"t{i}": torch.randn(2048, device="cuda", dtype=torch.bfloat16) for i in range(4096)}, arena)


def _round_trip(state: dict[str, torch.Tensor], arena: go.Arena, snap: Optional[go.Snapshot] = None) -> None:
    """snapshot (unless given), clobber, restore, then offload/reload; every value must come back bitwise."""
    expected = {k: v.clone() for k, v in state.items()}
    snap = snap if snap is not None else go.snapshot(state, arena=arena)
    for v in state.values():
        v.zero_()
    go.restore(state, snap)
    for k in state:
        assert_bitwise_equal(state[k], expected[k])
    go.offload(state, arena=arena)
    go.reload(state)
    for k in state:
        assert_bitwise_equal(state[k], expected[k])


@pytest.mark.parametrize("gather_max_bytes", [0, 1 << 20])
def test_hybrid_plan_round_trips_mixed_sizes(arena, monkeypatch, gather_max_bytes):
    # Small storages through the gather/scatter kernel, large ones through the copy engines, at once;
    # odd sizes exercise the kernel's byte tail and unaligned ends.
    monkeypatch.setenv("GPU_OFFLOAD_GATHER_MAX_BYTES", str(gather_max_bytes))
    sizes = [1, 3, 15, 16, 17, 4095, 4096, 65537, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 8 << 20]
    state = {f"t{i}": torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda") for i, n in enumerate(sizes)}
    state["view"] = state["t11"][5:77]
    expected = {k: v.clone() for k, v in state.items()}
    snap = go.snapshot(state, arena=arena)
    kernel_copies = sum(p.num_kernel_copies for _, p in go.plan._cache[next(reversed(go.plan._cache))].copies().groups)
    assert kernel_copies == (sum(1 for n in sizes if n <= gather_max_bytes) if gather_max_bytes else 0)
    snap.wait()
    for k in state:
        assert_bitwise_equal(snap.tensors()[k].cuda(), expected[k])
    _round_trip(state, arena, snap)


def test_an_offload_that_empties_the_cache_waits_for_its_copies_instead_of_recording_stream_uses(monkeypatch):
    # empty_cache() would wait for the copies anyway: the offload waits first and releases the storages as
    # plain frees (no copy-stream use, no event per freed block); without empty_cache it tells the allocator.
    from gpu_offload import api
    from gpu_offload import plan as _plan

    _ready()
    arena = go.Arena(min_slab_bytes=64 << 20)
    recorded_uses: list[int] = []
    mark = _plan.mark_live_in_use
    monkeypatch.setattr(_plan, "mark_live_in_use", lambda *a, **kw: (recorded_uses.append(1), mark(*a, **kw)))
    state = {"w": torch.randn(4 << 20, device="cuda"), "b": torch.randn(1000, device="cuda")}
    want = {k: v.clone() for k, v in state.items()}
    waited: list[int] = []
    wait_for = api.wait_for
    monkeypatch.setattr(api, "wait_for", lambda events: (waited.append(len(events)), wait_for(events)))
    go.offload(state, arena=arena)
    assert recorded_uses == [] and waited and waited[0] >= 1
    # The released blocks are free at once: whatever takes them now cannot reach the host copy.
    junk = torch.full((4 << 20,), 3.0, device="cuda")
    go.reload(state)
    for k, v in want.items():
        assert_bitwise_equal(state[k], v)
    go.offload(state, arena=arena, empty_cache=False)
    assert recorded_uses == [1] and len(waited) == 1
    go.reload(state)
    for k, v in want.items():
        assert_bitwise_equal(state[k], v)
    del junk
