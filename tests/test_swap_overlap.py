"""swap() and snapshot(..., overlap=True): semantics on every device; the concurrency itself on a GPU."""

from __future__ import annotations

import pytest
import torch

import gpu_offload as go
from conftest import assert_bitwise_equal, inject_resize_failure
from gpu_offload.storages import bind
from cuda_gates import engine_stream, hold, recorded, settle


def _model(device: torch.device, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).to(device)


def _values(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def test_swap_moves_one_out_and_the_other_in(device, arena):
    policy, ref = _model(device, 0), _model(device, 1)
    policy_values, ref_values = _values(policy), _values(ref)
    go.offload(ref, arena=arena)
    go.swap(policy, ref, arena=arena)
    assert go.is_offloaded(policy) and not go.is_offloaded(ref)
    for p, v in zip(ref.parameters(), ref_values):
        assert_bitwise_equal(p, v)
    go.swap(ref, policy, arena=arena)  # and back
    assert go.is_offloaded(ref) and not go.is_offloaded(policy)
    for p, v in zip(policy.parameters(), policy_values):
        assert_bitwise_equal(p, v)
    go.reload(ref)
    for p, v in zip(ref.parameters(), ref_values):
        assert_bitwise_equal(p, v)
    assert arena.used_bytes == 0


def test_swap_validates_both_before_anything_moves(device, arena):
    policy, ref = _model(device, 0), _model(device, 1)
    with pytest.raises(go.OffloadError, match="nothing in in_target is offloaded"):
        go.swap(policy, ref, arena=arena)
    assert not go.is_offloaded(policy)
    go.offload(ref, arena=arena)
    go.offload(policy, arena=arena)
    with pytest.raises(go.OffloadError, match="is offloaded"):  # the outgoing one is already out
        go.swap(policy, ref, arena=arena)
    assert go.is_offloaded(ref) and go.is_offloaded(policy)


def test_swap_puts_things_back_when_the_outgoing_half_fails(device):
    arena = go.Arena(max_bytes=64 << 10, min_slab_bytes=64 << 10)
    small = {"w": torch.randn(1000, device=device)}  # 4 KB: fits
    big = {"w": torch.randn(32 << 10, device=device)}  # 128 KiB: over the cap
    small_values = small["w"].clone()
    go.offload(small, arena=arena)
    with pytest.raises(go.OffloadError, match="arena cap"):
        go.swap(big, small, arena=arena)
    assert go.is_offloaded(small) and not go.is_offloaded(big)  # as before the call
    go.reload(small)
    assert_bitwise_equal(small["w"], small_values)


@pytest.mark.parametrize("checks_of", ["plan", "each tensor", "a gradient apart"])
def test_swap_puts_back_dropped_gradients_and_a_partial_offload_when_the_outgoing_half_fails(device, checks_of,
                                                                                            monkeypatch):
    # The incoming model was offloaded with its gradients dropped (what swap reads from the plan its offload
    # left, binding nothing), or only part of it is offloaded, or a gradient of it apart from its state (each
    # read tensor by tensor): either way, as before the call after.
    from gpu_offload import api

    arena = go.Arena(max_bytes=64 << 10, min_slab_bytes=64 << 10)
    model = _model(device, 0)
    model(torch.randn(4, 32, device=device)).sum().backward()
    values = _values(model)
    big = {"w": torch.randn(32 << 10, device=device)}  # 128 KiB: over the cap
    grad_values = [p.grad.clone() for p in model.parameters()]
    bound = []
    monkeypatch.setattr(api, "bind", lambda *a, **kw: bound.append(1) or bind(*a, **kw))
    if checks_of == "plan":
        go.offload(model, arena=arena, grads="drop")
        target = model
    elif checks_of == "each tensor":
        go.offload({"first": model[0].weight}, arena=arena)  # part of it; its gradients stay
        target = {"first": model[0].weight, "last": model[2].weight, "last.grad": model[2].weight.grad}
    else:
        go.offload(model, arena=arena)  # its gradients stay ...
        go.offload({"g": model[2].bias.grad}, arena=arena)  # ... but for one, offloaded apart
        target = model
    with pytest.raises(go.OffloadError, match="arena cap"):
        go.swap(big, target, arena=arena)
    assert bool(bound) == (checks_of != "plan")  # the plan's shortcut (no bind) only where it says it all
    assert not go.is_offloaded(big)
    if checks_of == "a gradient apart":
        assert go.is_offloaded(model) and model[2].bias.grad.untyped_storage().nbytes() == 0
        assert model[0].weight.grad.untyped_storage().nbytes() != 0  # kept, as before
        go.reload(model)
        if go.is_offloaded({"g": model[2].bias.grad}):  # (put back with the state's set, or apart)
            go.reload({"g": model[2].bias.grad})
        for p, g in zip(model.parameters(), grad_values):
            assert_bitwise_equal(p.grad, g)
    elif checks_of == "plan":
        assert go.is_offloaded(model)
        assert all(p.untyped_storage().nbytes() == 0 and p.grad.untyped_storage().nbytes() == 0
                    for p in model.parameters())
        go.reload(model)
        assert all(bool((p.grad == 0).all()) for p in model.parameters())  # dropped: back zeroed
    else:
        assert model[0].weight.untyped_storage().nbytes() == 0  # offloaded again
        assert model[2].weight.untyped_storage().nbytes() != 0 and model[2].weight.grad is not None
        go.reload({"first": model[0].weight})
    for p, v in zip(model.parameters(), values):
        assert_bitwise_equal(p, v)
    assert go.offloaded_bytes() == 0 and arena.used_bytes == 0


def test_overlap_snapshot_is_the_state_as_of_the_call(device, arena):
    model = _model(device, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = _values(model)
    snap = go.snapshot(model, overlap=True, arena=arena)
    loss = model(torch.randn(16, 32, device=device)).pow(2).sum()  # forward/backward alongside the copy
    loss.backward()
    opt.step()  # waits for the copy first (optimizer step pre-hook)
    after = _values(model)
    assert any(not torch.equal(a, b) for a, b in zip(after, before))
    for host, expected in zip(snap.wait().tensors().values(), before):
        assert_bitwise_equal(host.to(device), expected)
    go.restore(model, snap)
    for p, v in zip(model.parameters(), before):
        assert_bitwise_equal(p, v)


@pytest.mark.cuda
def test_overlap_step_issued_early_does_not_corrupt_the_snapshot(arena):
    # The copy is held back by a gate; the step is enqueued at once. Without the pre-hook the step's
    # writes would run ahead of the copy.
    w = torch.nn.Parameter(torch.ones(64 << 20, device="cuda"))
    opt = torch.optim.SGD([w], lr=1.0)
    w.grad = torch.zeros_like(w)
    opt.step()  # its kernels loaded (a zero gradient changes nothing)
    w.grad = torch.ones_like(w)
    go.snapshot({"x": torch.ones(16, device="cuda")}, arena=arena).wait().free()
    arena.reserve(256 << 20)
    torch.cuda.synchronize()
    with hold(engine_stream(0, to_host=True)) as gate:
        snap = go.snapshot([w], overlap=True, arena=arena)
        opt.step()
        assert not settle(recorded()), "the optimizer step ran before the overlapped copy had read the weights"
        gate.release()
    assert bool((snap.wait().tensors()["0"] == 1.0).all())
    torch.cuda.synchronize()
    assert bool((w == 0.0).all())


@pytest.mark.cuda
def test_swap_runs_both_directions_at_once(arena):
    # Both batches are enqueued before the current stream waits for either: check the results and that
    # swap returned before the copies finished (nothing blocked the CPU).
    out = {"w": torch.randn(128 << 20, device="cuda")}
    inc = {"w": torch.randn(128 << 20, device="cuda")}
    inc_values = inc["w"].clone()
    go.offload(inc, arena=arena)
    torch.cuda.synchronize()
    go.swap(out, inc, arena=arena)
    assert bool(torch.equal(inc["w"], inc_values))
    assert go.is_offloaded(out)


def test_swap_without_room_for_both_falls_back_to_one_after_the_other(arena, monkeypatch):
    policy, ref = _model(torch.device("cpu"), 0), _model(torch.device("cpu"), 1)
    ref_values = _values(ref)
    go.offload(ref, arena=arena)
    # The first allocation fails: the device is full while both would be resident.
    calls = inject_resize_failure(monkeypatch, 1, torch.OutOfMemoryError, when=lambda size: size > 0)
    go.swap(policy, ref, arena=arena)
    assert calls["n"] > 1  # the fallback allocated again after offloading the policy
    assert go.is_offloaded(policy) and not go.is_offloaded(ref)
    for p, v in zip(ref.parameters(), ref_values):
        assert_bitwise_equal(p, v)
