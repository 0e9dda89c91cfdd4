"""The cached copy plan: reused while the target is unchanged, rebuilt when it changes."""

from __future__ import annotations

import pytest
import torch

import gpu_offload as go
from gpu_offload import plan

# Every test runs with the torch-aware helper and with the pure-Python path (conftest.checks).
pytestmark = pytest.mark.usefixtures("checks")


def _hits() -> int:
    return plan.cache_info()["hits"]


def test_plan_is_reused_and_rebuilt_on_change(arena):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    go.snapshot(model, arena=arena).free()
    hits = _hits()
    snap = go.snapshot(model, arena=arena)
    assert _hits() == hits + 1  # same tensors at the same addresses: cached

    # A parameter replaced by a new one of the same shape: a new plan, and the restore goes into it.
    new_weight = torch.nn.Parameter(torch.zeros(4, 4))
    model[0].weight = new_weight
    hits = _hits()
    go.restore(model, snap)
    assert _hits() == hits
    assert torch.equal(new_weight, snap.tensors()["0.weight"])

    # In-place .data swap to another shape: the layout differs and restore says so.
    model[1].weight.data = torch.zeros(3, 4)
    try:
        go.restore(model, snap)
        raise AssertionError("expected a LayoutMismatchError")
    except go.LayoutMismatchError as exc:
        assert "1.weight: shape" in str(exc)


def test_plan_follows_storages_that_moved_after_reload(arena):
    state = {"a": torch.randn(1000), "b": torch.randn(10)}
    expected = {k: v.clone() for k, v in state.items()}
    snap = go.snapshot(state, arena=arena)
    go.offload(state, arena=arena)
    keep = torch.randn(1000)  # likely takes the freed addresses
    go.reload(state)
    for v in state.values():
        v.zero_()
    go.restore(state, snap)  # must write where the storages are now
    for k in state:
        assert torch.equal(state[k], expected[k])
    del keep


def test_cache_holds_no_tensors_alive(arena):
    import gc
    import weakref

    t = torch.randn(100)
    ref = weakref.ref(t)
    go.snapshot({"t": t}, arena=arena).free()
    del t
    gc.collect()
    assert ref() is None


def _view_changes():
    # Each changes how a tensor views its storage while keeping the tensor, its address and its storage.
    def transpose(m: dict) -> None:
        m["w"].t_()

    def reinterpret(m: dict) -> None:
        m["buf"].data = m["buf"].data.view(torch.int32)

    def narrow(m: dict) -> None:
        m["p"].data = m["p"].data[:5]

    return [("transpose", transpose, "w", "stride"), ("dtype", reinterpret, "buf", "dtype"),
            ("narrow", narrow, "p", "shape")]


@pytest.mark.parametrize("check", ["torch-guard", "plain"])
@pytest.mark.parametrize("name,change,tensor,field", _view_changes(), ids=[c[0] for c in _view_changes()])
def test_a_changed_view_of_the_same_storage_is_not_served_from_the_cache(arena, monkeypatch, name, change, tensor,
                                                                         field, check):
    if check == "plain":  # the check used where torch's TensorGuards is missing or behaves otherwise
        monkeypatch.setattr(plan, "_guards_ok", False)
    target = {"w": torch.randn(3, 4), "buf": torch.randn(6), "p": torch.nn.Parameter(torch.randn(10))}
    go.snapshot(target, arena=arena).free()  # plan cached
    go.snapshot(target, arena=arena).free()  # first hit: its view check made
    hits = _hits()
    old = go.snapshot(target, arena=arena)
    assert _hits() == hits + 1
    ptr = target[tensor].data_ptr()
    change(target)
    assert target[tensor].data_ptr() == ptr  # same tensor, same address, same storage

    new = go.snapshot(target, arena=arena)
    spec = {t.name: t for t in new.layout.tensors}[tensor]
    live = target[tensor]
    assert (spec.shape, spec.stride, spec.dtype) == (tuple(live.shape), live.stride(), live.dtype)
    assert torch.equal(new.tensors()[tensor].contiguous().view(torch.uint8), live.detach().contiguous().view(torch.uint8))
    with pytest.raises(go.LayoutMismatchError, match=f"{tensor}: {field}"):
        go.restore(target, old)
    go.restore(target, new)  # and the new layout's plan is cached and usable
    old.free()
    new.free()


def test_a_guard_that_answers_false_falls_back_to_the_plain_check(arena):
    # Guards also see the thread's dispatch state: a plan first hit under inference_mode and used outside it
    # must stay a hit (not be rebuilt on every call).
    target = {"w": torch.randn(3, 4)}
    go.snapshot(target, arena=arena).free()
    with torch.inference_mode():
        go.snapshot(target, arena=arena).free()
    hits = _hits()
    for _ in range(3):
        go.snapshot(target, arena=arena).free()
    assert _hits() == hits + 3
