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
    with pytest.raises(go.OffloadError) as err:
        go.snapshot({"a": torch.zeros(1024, device=device)}, arena=arena)
    # Sizes a person reads, and none of the C++ check's text: the cap is the user's setting.
    assert str(err.value) == ("arena cap exceeded: a region of 4 KiB does not fit; in use 2 KiB, capacity 4 KiB, "
                              "max_bytes 4 KiB (the regions in use leave too little room under the cap)")
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
    with pytest.raises(go.OffloadError, match=r"a region of 8 KiB does not fit; in use 0 B, capacity 0 B, max_bytes "
                       r"4 KiB \(the region alone is larger than max_bytes\)$"):
        go.snapshot({"a": torch.zeros(2048, device=device)}, arena=empty)  # 8 KiB
    align = int(go._C.ARENA_ALIGNMENT)
    arena = go.Arena(max_bytes=4 * align, min_slab_bytes=4 * align)
    n = align // 4  # float32 elements in one aligned block
    snaps = [go.snapshot({"a": torch.zeros(n, device=device)}, arena=arena).wait() for _ in range(4)]
    snaps[0].free()
    snaps[2].free()  # two free blocks of one alignment unit each, apart
    with pytest.raises(go.OffloadError, match=f"enough free bytes in total, but the largest free block is {align} B "):
        go.snapshot({"a": torch.zeros(2 * n, device=device)}, arena=arena)
    for s in (snaps[1], snaps[3]):
        s.free()


def test_pinning_more_than_the_machine_has_is_refused(arena):
    import gpu_offload._ext as ext

    too_much = ext._C.available_host_memory() + (64 << 30)
    with pytest.raises(go.OffloadError, match=r"^refusing to pin \d.* (KiB|MiB|GiB|TiB): the machine has only .* "
                       r"available .*lower the arena's max_bytes$"):  # no check text: the user's limit
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


def test_an_offloaded_part_is_named_as_the_target_names_it(device, arena):
    # Offloaded alone, then asked for inside a list or a dict: the message names it in that target.
    a, b = _state(device), _state(device)
    go.offload(b, arena=arena)
    first = next(iter(b))  # (its first storage's name)
    with pytest.raises(go.OffloadError, match=rf"^cannot offload: 1\.{first} is offloaded;"):
        go.offload([a, b], arena=arena)
    with pytest.raises(go.OffloadError, match=rf"^cannot snapshot: ref\.{first} is offloaded;"):
        go.snapshot({"policy": a, "ref": b}, arena=arena)
    go.reload(b)


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
    with pytest.raises(go.OffloadError, match="borrowed: its storage cannot be released and re-allocated"):
        go.offload(state, arena=arena)
    assert owned.untyped_storage().nbytes() == 16 and arena.used_bytes == 0


def test_a_tensor_in_shared_memory_is_refused_before_anything_moves(arena):
    # share_memory_() leaves a storage torch calls resizable, with no allocator: growing it back from 0
    # bytes would crash the process in torch's resize.
    owned, shared = torch.ones(4), torch.arange(6.0)
    shared.share_memory_()
    state = {"owned": owned, "shared": shared}
    for _ in range(2):  # (the second call finds the target's plan cached)
        with pytest.raises(go.OffloadError, match="shared: its storage cannot be released and re-allocated"):
            go.offload(state, arena=arena)
        assert owned.untyped_storage().nbytes() == 16 and shared.untyped_storage().nbytes() == 24
        assert arena.used_bytes == 0
    go.snapshot(state, arena=arena).wait().free()  # (a snapshot releases nothing: it serves)
    plain = {"owned": owned}
    go.snapshot(plain, arena=arena).wait().free()  # a plan cached while its storage could be re-allocated
    owned.share_memory_()
    with pytest.raises(go.OffloadError, match="owned: its storage cannot be released"):
        go.offload(plain, arena=arena)
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


def _default_arena_from(monkeypatch: pytest.MonkeyPatch, **env: str) -> go.Arena:
    from gpu_offload import arena as arena_module

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(arena_module, "_default_arena", None)  # read the environment afresh
    return go.default_arena()


@pytest.mark.parametrize("value", ["0.5", "1.5", ".25", "0.999"])
def test_a_fraction_for_the_arena_cap_is_refused_naming_the_variable(monkeypatch, value):
    # 0.5 was read as 0 ("got 0", no variable named) and 1.5 as a cap of one byte.
    with pytest.raises(go.OffloadError, match=f"GPU_OFFLOAD_ARENA_MAX_BYTES={value!r} is not a whole number of "
                                              "bytes.*GPU_OFFLOAD_NODE_MAX_BYTES"):
        _default_arena_from(monkeypatch, GPU_OFFLOAD_ARENA_MAX_BYTES=value)


@pytest.mark.parametrize("name, value", [("GPU_OFFLOAD_ARENA_MAX_BYTES", "0"), ("GPU_OFFLOAD_MIN_SLAB_BYTES", "0"),
                                         ("GPU_OFFLOAD_MIN_SLAB_BYTES", "1.5"), ("GPU_OFFLOAD_MIN_SLAB_BYTES", "0.5KiB7")])
def test_other_arena_sizes_that_are_no_positive_whole_bytes_are_refused_naming_the_variable(monkeypatch, name, value):
    with pytest.raises(go.OffloadError, match=f"{name}={value!r}"):
        _default_arena_from(monkeypatch, **{name: value})


@pytest.mark.parametrize("value, expected", [("1.5GiB", 3 << 29), ("1.3GB", 1_300_000_000), ("8e9", 8_000_000_000),
                                             ("0.5KiB", 512), ("2.5e3", 2500)])
def test_decimal_sizes_that_are_whole_bytes_are_read_exactly(value, expected):
    from gpu_offload._bytes import parse_bytes

    assert parse_bytes(value, "X") == expected


@pytest.mark.parametrize("size", [2**63, 2**64 - 1, 2**64, 2**80])
def test_sizes_past_int64_are_refused_with_the_size(arena, size):
    # 2**64 - 1 wrapped to a tiny allocation in the core; 2**64 was a TypeError from the binding.
    with pytest.raises(go.OffloadError, match=str(size)):
        arena.reserve(size)
    with pytest.raises(go.OffloadError, match=str(size)):
        go.Arena(max_bytes=size)
    with pytest.raises(go.OffloadError, match=str(size)):
        go.Arena(min_slab_bytes=size)
    assert arena.capacity_bytes == 0 and arena.used_bytes == 0


def _conj_and_neg_views() -> dict[str, torch.Tensor]:
    z = torch.complex(torch.randn(6), torch.randn(6))
    return {"conj": z.conj(), "neg": z.conj().imag}


@pytest.mark.parametrize("kind, bit", [("conj", "is_conj"), ("neg", "is_neg")])
def test_conjugate_and_negative_views_are_refused_by_name(arena, kind, bit):
    # Their storages hold the values before the bit: copied as they are, tensors(), files and DCP checkpoints
    # held conj(value), and a plain snapshot restored into such a view as if the bit were not there.
    view = _conj_and_neg_views()[kind]
    for op in (go.snapshot, go.offload):
        with pytest.raises(go.OffloadError, match=rf"x: a .* view \({bit}\(\)\)"):
            op({"ok": torch.ones(2), "x": view}, arena=arena)
    plain = {"ok": torch.ones(2), "x": view.resolve_conj().resolve_neg() * 0}
    with go.snapshot(plain, arena=arena) as snap:
        with pytest.raises(go.OffloadError, match=rf"x: a .* view \({bit}\(\)\)"):
            go.restore({"ok": torch.ones(2), "x": view}, snap)
    assert arena.used_bytes == 0 and go.offloaded_bytes() == 0


def test_a_cached_plan_sees_a_tensor_become_a_conjugate_view(arena):
    z = torch.complex(torch.randn(6), torch.randn(6))
    state = {"z": z}
    for _ in range(3):  # cached, and its views checked at a hit
        go.snapshot(state, arena=arena).free()
    z.data = z.data.conj()  # same tensor, address, storage, shape, stride and dtype
    with pytest.raises(go.OffloadError, match=r"z: a conjugate view"):
        go.snapshot(state, arena=arena)
    assert arena.used_bytes == 0
# ------------------------------------------------------------------------------ layout errors that say what to do


class _LM(torch.nn.Module):
    def __init__(self, tied: bool, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 4, dtype=dtype)
        self.body = torch.nn.Sequential(*[torch.nn.Linear(4, 4, dtype=dtype) for _ in range(5)])
        self.lm_head = torch.nn.Linear(4, 16, bias=False, dtype=dtype)
        if tied:
            self.lm_head.weight = self.embed.weight


def _mismatch(snapshot_of: torch.nn.Module, target: torch.nn.Module) -> str:
    with go.snapshot(snapshot_of) as snap, pytest.raises(go.LayoutMismatchError) as err:
        go.restore(target, snap)
    return str(err.value)


def test_tied_into_untied_names_the_tensors_and_says_what_to_do():
    message = _mismatch(_LM(tied=True), _LM(tied=False))
    assert ("embed.weight and lm_head.weight share one storage in the snapshot (tied weights, or views of one "
            "tensor) but are separate in the target: tie them in the target as in the snapshot "
            "(e.g. target.lm_head.weight = target.embed.weight") in message, message
    message = _mismatch(_LM(tied=False), _LM(tied=True))
    assert "embed.weight and lm_head.weight share one storage in the target but are separate in the snapshot: untie" \
        in message, message


def test_a_dtype_mismatch_is_one_short_line():
    """A model built in another dtype differs in every tensor the same way: one line for all of them (the
    storage sizes that the dtype explains are not listed again)."""
    message = _mismatch(_LM(tied=False), _LM(tied=False, dtype=torch.bfloat16))
    lines = message.splitlines()
    assert lines == ["target layout differs from the snapshot:",
                     "  dtype torch.bfloat16 in target, torch.float32 in snapshot for 12 tensors: embed.weight, "
                     "body.0.weight, body.0.bias (+9 more)"], message


def test_one_line_per_kind_of_difference():
    snap_of = {"a": torch.zeros(4, 4), "b": torch.zeros(4, 4), "c": torch.zeros(3), "d": torch.zeros(2)}
    target = {"a": torch.zeros(4, 5), "b": torch.zeros(5, 4), "c": torch.zeros(3, dtype=torch.float64),
              "d": torch.zeros(2, dtype=torch.float64)}
    lines = _mismatch_dict(snap_of, target).splitlines()[1:]
    assert lines == ["  a: shape (4, 5) in target, (4, 4) in snapshot; 1 more tensor differs in shape: b",
                     "  dtype torch.float64 in target, torch.float32 in snapshot for 2 tensors: c, d"], lines


def _mismatch_dict(snapshot_of: dict, target: dict) -> str:
    with go.snapshot(snapshot_of) as snap, pytest.raises(go.LayoutMismatchError) as err:
        go.restore(target, snap)
    return str(err.value)


def test_torch_compile_names_get_a_hint():
    model = _LM(tied=False)
    compiled = torch.compile(model)  # an OptimizedModule: its parameters are model's, named `_orig_mod.<name>`
    assert next(iter(dict(compiled.named_parameters()))).startswith("_orig_mod.")
    message = _mismatch(compiled, _LM(tied=False))
    assert ("the snapshot is of a torch.compile'd module (its names have `_orig_mod.`) and the target is not: "
            "restore into the compiled module, or snapshot the original one (`compiled._orig_mod`)") in message
    message = _mismatch(model, torch.compile(_LM(tied=False)))
    assert ("the target is a torch.compile'd module (its names have `_orig_mod.`) and the snapshot is of the "
            "original module: restore into the original one (`compiled._orig_mod`), or snapshot the compiled one") \
        in message
    with go.snapshot(model) as snap:  # what the hint says works
        go.restore(compiled._orig_mod, snap)
