"""Every error the engine raises, and that nothing changed after it (target and arena)."""

from __future__ import annotations

import pytest
import torch

import gpu_offload as go
from conftest import assert_bitwise_equal, inject_resize_failure


def _state(device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, generator=g).to(device)
    return {"w": torch.randn(8, 8, generator=g).to(device), "b": base, "view": base[4:12]}


def _unchanged(state: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> None:
    for k, v in before.items():
        assert_bitwise_equal(state[k], v)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: s.pop("w"), "missing from target: w"),
        (lambda s: s.update(extra=torch.zeros(1, device=s["b"].device)), "not in snapshot: extra"),
        (lambda s: s.update(w=torch.zeros(8, 9, device=s["b"].device)), "w: shape"),
        (lambda s: s.update(w=torch.zeros(8, 8, dtype=torch.float64, device=s["b"].device)), "w: dtype"),
        (lambda s: s.update(view=s["b"][5:13]), "view: offset"),
        (lambda s: s.update(view=s["b"][4:12].clone()), "view: storage of"),
        (lambda s: s.update(w=torch.zeros(8, 8, device=s["b"].device).t()), "w: stride"),
    ],
    ids=["missing", "extra", "shape", "dtype", "offset", "not-shared", "stride"],
)
def test_restore_layout_mismatch_names_the_difference_and_copies_nothing(device, arena, change, message):
    state = _state(device)
    snap = go.snapshot(state, arena=arena)
    target = dict(state)
    change(target)
    before = {k: v.clone() for k, v in target.items()}
    used = arena.used_bytes
    with pytest.raises(go.LayoutMismatchError, match=message):
        go.restore(target, snap)
    _unchanged(target, before)
    assert arena.used_bytes == used


def test_restore_onto_a_twin_that_shares_differently(arena):
    a = torch.randn(10)
    snap = go.snapshot({"x": a[:5], "y": a[5:]}, arena=arena)
    with pytest.raises(go.LayoutMismatchError):
        go.restore({"x": torch.randn(10)[:5], "y": torch.randn(10)[5:]}, snap)


def test_arena_cap_is_hard_and_reports_sizes(device):
    arena = go.Arena(max_bytes=4096, min_slab_bytes=4096)
    small = go.snapshot({"a": torch.zeros(512, device=device)}, arena=arena)  # 2 KiB
    used, capacity = arena.used_bytes, arena.capacity_bytes
    with pytest.raises(go.OffloadError, match=r"arena cap exceeded.*max_bytes 4096 bytes.*"
                       r"the regions in use leave too little room under the cap"):
        go.snapshot({"a": torch.zeros(1024, device=device)}, arena=arena)
    state = {"a": torch.ones(1024, device=device)}
    with pytest.raises(go.OffloadError, match="arena cap exceeded"):
        go.offload(state, arena=arena)
    assert state["a"].untyped_storage().nbytes() == 4096 and bool((state["a"] == 1).all())
    assert not go.is_offloaded(state)
    assert (arena.used_bytes, arena.capacity_bytes) == (used, capacity)
    small.free()
    go.snapshot({"a": torch.zeros(1024, device=device)}, arena=arena).free()  # fits once space is back


def test_arena_cap_error_says_why(device):
    """The reason matches the arena's state: empty (the region is larger than the cap), or enough free bytes
    split into blocks too small for the region (not "too little room")."""
    empty = go.Arena(max_bytes=4096, min_slab_bytes=4096)
    with pytest.raises(go.OffloadError, match="in use 0 bytes.*the region alone is larger than max_bytes"):
        go.snapshot({"a": torch.zeros(2048, device=device)}, arena=empty)  # 8 KiB
    align = int(go._C.ARENA_ALIGNMENT)
    arena = go.Arena(max_bytes=4 * align, min_slab_bytes=4 * align)
    n = align // 4  # float32 elements in one aligned block
    snaps = [go.snapshot({"a": torch.zeros(n, device=device)}, arena=arena).wait() for _ in range(4)]
    snaps[0].free()
    snaps[2].free()  # two free blocks of one alignment unit each, apart
    with pytest.raises(go.OffloadError, match=f"enough free bytes in total, but the largest free block is {align} "):
        go.snapshot({"a": torch.zeros(2 * n, device=device)}, arena=arena)
    for s in (snaps[1], snaps[3]):
        s.free()


def test_pinning_more_than_the_machine_has_is_refused(arena):
    import gpu_offload._ext as ext

    too_much = ext._C.available_host_memory() + (64 << 30)
    with pytest.raises(go.OffloadError, match="available"):
        arena.reserve(too_much)
    assert arena.capacity_bytes == 0


def test_offload_twice_and_reload_not_offloaded(device, arena):
    state = _state(device)
    with pytest.raises(go.OffloadError, match="nothing in the target is offloaded"):
        go.reload(state)
    go.offload(state, arena=arena)
    with pytest.raises(go.OffloadError, match="is offloaded"):
        go.offload(state, arena=arena)
    with pytest.raises(go.OffloadError, match="is offloaded"):
        go.snapshot(state, arena=arena)
    go.reload(state)
    with pytest.raises(go.OffloadError, match="nothing in the target is offloaded"):
        go.reload(state)


def test_restore_into_offloaded_target_is_refused(device, arena):
    state = _state(device)
    snap = go.snapshot(state, arena=arena)
    go.offload(state, arena=arena)
    with pytest.raises(go.OffloadError, match="is offloaded"):
        go.restore(state, snap)
    go.reload(state)
    go.restore(state, snap)


def test_freed_snapshot_cannot_be_used(arena):
    state = {"a": torch.ones(3)}
    snap = go.snapshot(state, arena=arena)
    snap.free()
    for use in (lambda: go.restore(state, snap), snap.wait, snap.done, snap.tensors):
        with pytest.raises(go.OffloadError, match="freed"):
            use()


@pytest.mark.parametrize(
    "bad, message",
    [
        (object(), "unsupported target"),
        ("weights", "unsupported target"),
        ({"m": torch.empty(3, device="meta")}, "meta tensors"),
        ({"s": torch.eye(3).to_sparse()}, "sparse|strided"),
        ({"nested": {"ok": torch.ones(1), "bad": object()}}, "unsupported target"),
    ],
    ids=["object", "str", "meta", "sparse", "nested-object"],
)
def test_bad_targets_are_clear_errors(arena, bad, message):
    with pytest.raises(go.OffloadError, match=message):
        go.snapshot(bad, arena=arena)
    with pytest.raises(go.OffloadError, match=message):
        go.offload(bad, arena=arena)
    assert arena.used_bytes == 0


def test_restore_needs_a_snapshot(arena):
    with pytest.raises(go.OffloadError, match="needs a Snapshot"):
        go.restore({"a": torch.ones(1)}, {"a": torch.ones(1)})


def test_storage_that_cannot_be_resized_is_refused_before_anything_moves(arena):
    import numpy as np

    borrowed = torch.from_numpy(np.arange(16, dtype=np.float32))
    owned = torch.ones(4)
    state = {"owned": owned, "borrowed": borrowed}
    with pytest.raises(go.OffloadError, match="not resizable"):
        go.offload(state, arena=arena)
    assert owned.untyped_storage().nbytes() == 16 and arena.used_bytes == 0


def test_reload_allocation_failure_keeps_the_target_offloaded_and_retry_works(arena, monkeypatch):
    state = {"a": torch.randn(100), "b": torch.randn(50), "c": torch.randn(10)}
    expected = {k: v.clone() for k, v in state.items()}
    go.offload(state, arena=arena)
    # The second allocation fails, as a full device would.
    inject_resize_failure(monkeypatch, 2, torch.OutOfMemoryError, when=lambda size: size > 0)
    with pytest.raises(go.OffloadError, match="still offloaded with its data intact"):
        go.reload(state)
    assert go.is_offloaded(state)
    assert all(t.untyped_storage().nbytes() == 0 for t in state.values())
    monkeypatch.undo()
    go.reload(state)
    for k in state:
        assert_bitwise_equal(state[k], expected[k])
    assert arena.used_bytes == 0


def test_bad_arena_arguments():
    for kwargs in ({"max_bytes": 0}, {"max_bytes": -1}, {"min_slab_bytes": 0}, {"pin": "sometimes"}):
        with pytest.raises(go.OffloadError):
            go.Arena(**kwargs)


def test_core_errors_carry_where_they_failed(arena):
    import gpu_offload._ext as ext

    with pytest.raises(go.OffloadError, match=r"arena\.cpp:\d+"):
        arena._impl.free(12345)
    with pytest.raises(go.OffloadError, match=r"check `.*` failed at copy_plan\.cpp:\d+"):
        ext._C.CopyPlan(-1, [1, 2], [0], [1, 1])


def test_memory_released_outside_gpu_offload_is_refused(arena):
    # Another tool freed the storage (resize_(0)) but the tensor still claims its shape: a snapshot would
    # silently hold nothing.
    w = torch.randn(16)
    w.untyped_storage().resize_(0)
    with pytest.raises(go.OffloadError, match="released outside gpu_offload"):
        go.snapshot({"w": w}, arena=arena)
    with pytest.raises(go.OffloadError, match="released outside gpu_offload"):  # not cached either
        go.snapshot({"w": w}, arena=arena)
    w.untyped_storage().resize_(64)
    go.snapshot({"w": w}, arena=arena).free()


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_strided_nested_tensor_is_refused_by_name(arena):
    nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.strided)
    for op in (go.snapshot, go.offload):
        with pytest.raises(go.OffloadError, match="nt: nested tensors are not supported"):
            op({"ok": torch.ones(2), "nt": nested}, arena=arena)
    assert arena.used_bytes == 0


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e400", str(1 << 64)])
@pytest.mark.parametrize("name", ["GPU_OFFLOAD_ARENA_MAX_BYTES", "GPU_OFFLOAD_GATHER_MAX_BYTES"])
def test_byte_counts_in_the_environment_that_are_not_finite_are_clear_errors(monkeypatch, name, value):
    from gpu_offload import arena as arena_module
    from gpu_offload import plan

    monkeypatch.setenv(name, value)
    monkeypatch.setattr(arena_module, "_default_arena", None)  # read the environment afresh
    plan.clear_cache()
    with pytest.raises(go.OffloadError, match=f"{name}={value!r} is not a"):
        go.snapshot({"a": torch.ones(3)})
    plan.clear_cache()
