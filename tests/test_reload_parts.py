"""A reload in parts (plan.reload_parts): each part's storages allocated, then its copies enqueued, before the
next part is allocated, so that the link works while the host allocates. On by default for a recorded CUDA
target of more than twice plan.RELOAD_FIRST_PART_BYTES; turned on here for the CPU too, with small parts, so
that its steps and every way they can fail run in CI."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

import gpu_offload as go
import conftest
from conftest import assert_bitwise_equal, count_points, inject_failure, inject_resize_failure, interrupt_at, random_tensor
from gpu_offload import plan as _plan
from gpu_offload import torch_ext


_SETTINGS = ("RELOAD_IN_PARTS_ON_CPU", "RELOAD_FIRST_PART_BYTES", "RELOAD_MAX_PARTS")


@pytest.fixture
def parts() -> Iterator[None]:
    """Parts of 256, 512, 1024, ... bytes, on the CPU too. (Set and put back here, not with the test's
    monkeypatch, whose undo() the tests call to lift an injected failure.)"""
    if torch_ext.ext is None:
        pytest.skip(f"gpu_offload._torch_ext {torch_ext.status()}: a reload in parts needs the helper's record")
    saved = [getattr(_plan, name) for name in _SETTINGS]
    _plan.RELOAD_IN_PARTS_ON_CPU, _plan.RELOAD_FIRST_PART_BYTES = True, 256
    _plan.clear_cache()
    try:
        yield
    finally:
        for name, value in zip(_SETTINGS, saved):
            setattr(_plan, name, value)
        _plan.clear_cache()


def _state(device: torch.device) -> dict[str, torch.Tensor]:
    base = random_tensor((500,), torch.float32, device, seed=1)  # 2000 bytes
    return {
        "a": random_tensor((40, 7), torch.float16, device, seed=2),  # 560 bytes: the first part
        "empty": torch.empty(0, device=device),  # holds no memory: not live, copies nothing
        "base": base,  # the second part (it wants 512 bytes: this one storage)
        "view": base[100:150],
        "b": random_tensor((33,), torch.int32, device, seed=3),  # b and c: the last part
        "c": random_tensor((3, 5), torch.bfloat16, device, seed=4),
    }


def _expected(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
    return {n: (t.clone(), t.untyped_storage().nbytes()) for n, t in state.items()}


def _assert_live_and_equal(state: dict[str, torch.Tensor], expected: dict[str, tuple[torch.Tensor, int]]) -> None:
    assert not go.is_offloaded(state)
    for name, (value, nbytes) in expected.items():
        assert state[name].untyped_storage().nbytes() == nbytes, name
        assert_bitwise_equal(state[name], value)
    assert state["view"].untyped_storage()._cdata == state["base"].untyped_storage()._cdata


def _assert_still_offloaded_and_reloadable(state: dict[str, torch.Tensor], expected: dict[str, tuple[torch.Tensor, int]],
                                           arena: go.Arena, used_and_offloaded: tuple[int, int]) -> None:
    """As the offload left it, whichever part the failed reload was in; and the next reload brings it back."""
    assert go.is_offloaded(state)
    assert all(t.untyped_storage().nbytes() == 0 for t in state.values())
    assert (arena.used_bytes, go.offloaded_bytes()) == used_and_offloaded
    go.reload(state)
    _assert_live_and_equal(state, expected)
    assert arena.used_bytes == 0 and go.offloaded_bytes() == 0


def _plan_of(state: dict[str, torch.Tensor]) -> _plan.TargetPlan:
    plan = _plan.lookup(list(state), list(state.values()))
    assert plan is not None and plan.record is not None
    return plan


def test_parts_are_ranges_of_the_live_storages_growing_twice_each_time(parts, device):
    state = _state(device)
    go.snapshot(state).free()
    plan = _plan_of(state)
    assert len(plan.live) == 4  # a, base (with its view), b, c; not the empty one
    assert plan.reload_parts() == [(0, 1), (1, 2), (2, 4)]
    assert plan.reload_parts() is plan.reload_parts()  # kept
    _plan.RELOAD_FIRST_PART_BYTES = 1 << 20  # (the fixture puts it back) one part: not in parts
    assert plan.reload_parts() is None


def test_parts_at_most_max_the_last_taking_the_rest(parts):
    _plan.RELOAD_FIRST_PART_BYTES, _plan.RELOAD_MAX_PARTS = 64, 3
    state = {f"t{i}": torch.full((64,), float(i)) for i in range(20)}  # 256 bytes each
    go.snapshot(state).free()
    assert _plan_of(state).reload_parts() == [(0, 1), (1, 2), (2, 20)]


def test_reload_in_parts_round_trips_and_keeps_every_view(parts, device, arena):
    state = _state(device)
    expected = _expected(state)
    for _ in range(3):  # the first builds each part's copies, the next ones move them to the new addresses
        go.offload(state, arena=arena)
        assert go.is_offloaded(state)
        go.reload(state)
        _assert_live_and_equal(state, expected)
        assert arena.used_bytes == 0 and go.offloaded_bytes() == 0
    plan = _plan_of(state)
    assert len(plan._part_copies) == 3
    # The plan follows the reloaded storages: a snapshot and a restore through it see the new addresses.
    snap = go.snapshot(state, arena=arena).wait()
    with torch.no_grad():
        for t in state.values():
            t.zero_()
    go.restore(state, snap)
    snap.free()
    _assert_live_and_equal(state, expected)


def test_reload_in_parts_of_a_module_with_its_optimizer(parts, device, arena):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)).to(device)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 16, device=device)).sum().backward()
    opt.step()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = [s["exp_avg"].clone() for s in opt.state.values()]
    go.offload([model, opt], arena=arena)
    go.reload([model, opt])
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())
    assert all(torch.equal(s["exp_avg"], v) for s, v in zip(opt.state.values(), want_opt))
    model(torch.randn(4, 16, device=device)).sum().backward()
    opt.step()  # usable: the optimizer's state is where its parameters are


@pytest.mark.parametrize("exc", [KeyboardInterrupt, MemoryError])
@pytest.mark.parametrize("k", range(1, 5))
def test_an_allocation_failing_in_any_part_keeps_the_target_offloaded(parts, device, arena, monkeypatch, k, exc):
    state = _state(device)
    expected = _expected(state)
    go.offload(state, arena=arena)
    used, offloaded = arena.used_bytes, go.offloaded_bytes()
    inject_resize_failure(monkeypatch, k, exc, when=lambda size: size > 0)
    with pytest.raises(go.OffloadError if exc is MemoryError else exc, match="injected"):
        go.reload(state)
    monkeypatch.undo()
    _assert_still_offloaded_and_reloadable(state, expected, arena, (used, offloaded))


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_copy_failing_in_any_part_keeps_the_target_offloaded(parts, device, arena, monkeypatch, k, exc):
    state = _state(device)
    expected = _expected(state)
    go.offload(state, arena=arena)
    used, offloaded = arena.used_bytes, go.offloaded_bytes()
    inject_failure(monkeypatch, _plan.CopyPlans, "run", k, exc)
    with pytest.raises(exc, match="injected"):
        go.reload(state)
    monkeypatch.undo()
    _assert_still_offloaded_and_reloadable(state, expected, arena, (used, offloaded))


def test_an_interrupt_anywhere_in_a_reload_in_parts_loses_nothing(parts, arena):
    state = _state(torch.device("cpu"))
    expected = _expected(state)

    def check(k: int) -> None:
        where = f"interrupt {k} ({conftest.last_point})"
        if go.is_offloaded(state):
            # Still offloaded: empty, whatever part it was in (never some parts grown), or, in the reload's
            # last step (copied back, not yet out of the registry), whole; a reload finishes it.
            held = [t.untyped_storage().nbytes() != 0 for name, t in state.items() if name != "empty"]
            assert not any(held) or all(held), f"{where}: {held}"
            go.reload(state)
        _assert_live_and_equal(state, expected)
        assert arena.used_bytes == 0 and go.offloaded_bytes() == 0, where

    reload = lambda: go.reload(state)  # noqa: E731
    go.offload(state, arena=arena)
    points = count_points(reload)
    assert _plan_of(state).reload_parts() == [(0, 1), (1, 2), (2, 4)]
    assert points > 30
    for k in range(1, points + 1):
        go.offload(state, arena=arena)
        interrupt_at(k, reload)
        check(k)


def test_held_storages_serve_the_parts_in_order_only(parts):
    state = _state(torch.device("cpu"))
    go.snapshot(state).free()
    plan = _plan_of(state)
    record, tensors = plan.record, list(state.values())
    record.resize_live(tensors, True)  # released (as an offload leaves them)
    record.refresh(tensors)
    held = record.check_held(tensors)
    assert held is not None and held.num_held == 4
    record.resize_live(tensors, False, False, held, 0, 1)
    assert not held.spent and held.num_held == 4  # (the storages from 1 on still held, for the next part)
    with pytest.raises(ValueError, match=r"the part \[3, 2\) is not within the 4 live storages"):
        record.resize_live(tensors, False, False, held, 3, 2)
    # Out of order: not served by `held` (reached through the tensors), and `held` stays where it was.
    record.resize_live(tensors, False, False, held, 2, 4)
    assert not held.spent
    record.resize_live(tensors, False, False, held, 1, 2)
    assert not held.spent  # (it serves the part from 2 on, grown already: to the same sizes again)
    assert [t.untyped_storage().nbytes() for t in tensors] == [560, 0, 2000, 2000, 132, 30]
    for i, t in enumerate(tensors):
        t.fill_(i)  # (grown memory holds anything, NaNs included)
    values = [t.clone() for t in tensors]
    record.resize_live(tensors, False, False, held, 2, 4)
    assert held.spent and held.num_held == 0
    assert all(torch.equal(t, v) for t, v in zip(tensors, values))


def test_without_the_helper_a_reload_is_one_step(parts, arena, monkeypatch):
    monkeypatch.setattr(_plan, "_ext", None)
    state = _state(torch.device("cpu"))
    expected = _expected(state)
    go.offload(state, arena=arena)
    go.reload(state)
    _assert_live_and_equal(state, expected)
    plan = _plan.lookup(list(state), list(state.values()))
    assert plan is not None and plan.reload_parts() is None
