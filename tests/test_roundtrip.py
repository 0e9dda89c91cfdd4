"""Bitwise round trips through snapshot/restore and offload/reload, on the CPU and (where present) CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

import gpu_offload as go
from conftest import assert_bitwise_equal, random_tensor

ALL_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64, torch.bool,
    torch.complex32, torch.complex64, torch.complex128,
]
if hasattr(torch, "float8_e8m0fnu"):
    ALL_DTYPES.append(torch.float8_e8m0fnu)

ODD_SHAPES = [(0,), (1,), (3,), (7, 5), (1023,), (4097,), (2, 0, 3), (), (33, 17, 3)]


def clobber(tensors: dict[str, torch.Tensor]) -> None:
    for t in tensors.values():
        if t.numel():
            t.reshape(-1).view(torch.uint8).fill_(0xA5)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips_bitwise(device, arena, dtype):
    state = {f"t{i}": random_tensor(shape, dtype, device, seed=i) for i, shape in enumerate(ODD_SHAPES)}
    expected = {k: v.clone() for k, v in state.items()}
    snap = go.snapshot(state, arena=arena)
    clobber(state)
    go.restore(state, snap)
    for k in state:
        assert_bitwise_equal(state[k], expected[k])
    host = snap.tensors()
    for k in state:
        assert_bitwise_equal(host[k].to(device), expected[k])
    go.offload(state, arena=arena)
    assert all(t.untyped_storage().nbytes() == 0 for t in state.values())
    go.reload(state)
    for k in state:
        assert_bitwise_equal(state[k], expected[k])
    snap.free()


def test_views_at_odd_offsets_share_one_storage(device, arena):
    base = torch.randn(1001, device=device)
    state = {"base": base, "a": base[3:10], "b": base[1::7], "c": base[500:].view(1, -1)[:, 5:9], "d": base[999:]}
    expected = {k: v.clone() for k, v in state.items()}
    snap = go.snapshot(state, arena=arena)
    assert snap.num_storages == 1 and snap.num_tensors == 5
    assert snap.nbytes == 1001 * 4
    base.fill_(0)
    go.restore(state, snap)
    for k in state:
        assert torch.equal(state[k], expected[k])
    go.offload(state, arena=arena)
    go.reload(state)
    # Views are still views of the same storage, with the right values.
    assert state["a"].untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    base[5] = 42.0
    assert state["a"][2].item() == 42.0
    for k in ("b", "c", "d"):
        assert torch.equal(state[k], expected[k])


class TiedLM(torch.nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight  # tied, as in Qwen2-0.5B
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.proj(self.norm(self.embed(x))) * self.scale)


def test_tied_weights_copied_once_and_stay_tied(device, arena):
    torch.manual_seed(0)
    model = TiedLM().to(device)
    snap = go.snapshot(model, arena=arena)
    assert "lm_head.weight" in snap.names and "embed.weight" in snap.names
    payload = sum(p.numel() * p.element_size() for p in model.parameters()) + 4  # unique params + buffer
    assert snap.nbytes == payload
    go.offload(model, arena=arena)
    go.reload(model)
    assert model.lm_head.weight is model.embed.weight
    go.restore(model, snap)


def test_restore_into_a_freshly_built_twin(device, arena):
    torch.manual_seed(1)
    model = TiedLM().to(device)
    torch.manual_seed(2)
    twin = TiedLM().to(device)
    snap = go.snapshot(model, arena=arena)
    go.restore(twin, snap)
    for (n, a), (_, b) in zip(model.state_dict().items(), twin.state_dict().items()):
        assert torch.equal(a, b), n


def test_several_versions_coexist(device, arena):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8).to(device)
    versions, snaps = [], []
    for step in range(4):
        with torch.no_grad():
            model.weight.add_(1.0)
        versions.append(model.weight.detach().clone())
        snaps.append(go.snapshot(model, arena=arena))
    for i in (2, 0, 3, 1):
        go.restore(model, snaps[i])
        assert torch.equal(model.weight, versions[i])
    for s in snaps:
        s.free()
    assert arena.used_bytes == 0


def test_a_target_offloaded_in_part_is_offloaded_and_reload_brings_that_part_back(device, arena):
    # is_offloaded answers whether reload has something to bring back: `if is_offloaded(m): reload(m)` leaves m
    # usable whether the target was offloaded whole, as a part of a list, or lost a tensor to a replacement.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).to(device)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4, device=device)).sum().backward()
    opt.step()
    expected = {n: t.detach().clone() for n, t in model.state_dict().items()}
    assert not go.is_offloaded(model) and not go.is_offloaded([model, opt])
    go.offload(model, arena=arena)
    assert go.is_offloaded(model) and go.is_offloaded([model, opt]) and not go.is_offloaded(opt)
    go.reload([model, opt])
    assert not go.is_offloaded([model, opt])
    del opt  # (it holds the parameter replaced below, which would stay offloaded while it lives)
    go.offload(model, arena=arena)
    model[0].weight = torch.nn.Parameter(torch.ones(4, 4, device=device))  # replaced while offloaded
    assert go.is_offloaded(model)
    with pytest.raises(go.OffloadError, match="offloaded"):
        model(torch.randn(2, 4, device=device))
    if go.is_offloaded(model):
        go.reload(model)
    assert not go.is_offloaded(model)
    model(torch.randn(2, 4, device=device))
    for name, t in model.state_dict().items():
        assert torch.equal(t, torch.ones(4, 4, device=device) if name == "0.weight" else expected[name]), name
    assert arena.used_bytes == 0


def test_offload_reload_keeps_objects_and_training_continues(device, arena):
    torch.manual_seed(0)
    model = TiedLM().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randint(0, 50, (4, 7), device=device)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        return loss.item()

    step()
    twin, twin_opt = copy.deepcopy((model, opt))  # one memo: the twin optimizer drives the twin's params

    params_before = [id(p) for p in model.parameters()]
    exp_avg = opt.state[model.proj.weight]["exp_avg"]
    opt.zero_grad(set_to_none=True)
    go.offload([model, opt], arena=arena)
    assert go.is_offloaded(model) and go.is_offloaded(opt) and go.is_offloaded([opt, model])
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert exp_avg.untyped_storage().nbytes() == 0
    go.reload([model, opt])  # a new list object: a list is its parts
    assert not go.is_offloaded(model)
    assert [id(p) for p in model.parameters()] == params_before
    assert opt.state[model.proj.weight]["exp_avg"] is exp_avg

    def twin_step() -> float:
        twin_opt.zero_grad(set_to_none=True)
        loss = twin(x).float().pow(2).mean()
        loss.backward()
        twin_opt.step()
        return loss.item()

    for _ in range(3):
        assert step() == twin_step()
    for (n, a), (_, b) in zip(model.state_dict().items(), twin.state_dict().items()):
        assert torch.equal(a, b), n


def test_optimizer_state_and_state_dicts(device, arena):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3).to(device)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 6, device=device)).sum().backward()
    opt.step()
    snap = go.snapshot(opt, arena=arena)
    assert sorted(snap.names) == sorted(f"state.{i}.{k}" for i in range(2) for k in ("exp_avg", "exp_avg_sq", "step"))
    before = {k: v.clone() for k, v in snap.tensors().items()}
    model(torch.randn(2, 6, device=device)).sum().backward()
    opt.step()
    go.restore(opt, snap)
    for i, p in enumerate(model.parameters()):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k].cpu(), before[f"state.{i}.{k}"].cpu())
    # A nested state dict is a Mapping target too (its numbers are skipped, its tensors copied).
    sd = opt.state_dict()
    snap2 = go.snapshot(sd, arena=arena)
    assert snap2.num_tensors == 6
    go.restore(sd, snap2)


def test_grads_with_include_grads(device, arena):
    model = torch.nn.Linear(4, 4).to(device)
    model(torch.randn(3, 4, device=device)).sum().backward()
    grad = model.weight.grad.clone()
    snap = go.snapshot(model, include_grads=True, arena=arena)
    assert "weight.grad" in snap.names and snap.num_storages == 4
    model.weight.grad.zero_()
    go.restore(model, snap)
    assert torch.equal(model.weight.grad, grad)
    go.offload(model, include_grads=True, arena=arena)
    assert model.weight.grad.untyped_storage().nbytes() == 0
    go.reload(model)
    assert torch.equal(model.weight.grad, grad)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, device: torch.device,
           finish: bool = True) -> None:
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step)).to(device)
    model(x).pow(2).mean().backward()
    if finish:
        opt.step()
        opt.zero_grad(set_to_none=False)


def _grad_storages(model: torch.nn.Module) -> list[torch.UntypedStorage]:
    return [p.grad.untyped_storage() for p in model.parameters() if p.grad is not None]


def test_offload_grads_drop_frees_them_without_a_copy(device, arena):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(device)
    twin = copy.deepcopy(model)
    opt, twin_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, twin))
    for m, o in ((model, opt), (twin, twin_opt)):
        _train(m, o, 0, device)
        _train(m, o, 1, device, finish=False)  # gradients of a backward whose step never comes
    grads = [p.grad for p in model.parameters()]
    assert all(g.abs().sum() > 0 for g in grads)
    state_bytes = go.snapshot([model, opt], arena=arena).nbytes  # what a copy of the state takes
    go.offload([model, opt], grads="drop", arena=arena)
    assert all(st.nbytes() == 0 for st in _grad_storages(model)), "a gradient still holds memory"
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert go.offloaded_bytes() == state_bytes, "bytes were written to host memory for the gradients"
    assert not go.is_offloaded(twin)
    go.reload([model, opt])
    # The same gradient tensors, re-allocated and zeroed: as the twin's after zero_grad().
    assert [p.grad for p in model.parameters()] == grads
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    twin_opt.zero_grad(set_to_none=False)
    for step in range(2, 5):
        _train(model, opt, step, device)
        _train(twin, twin_opt, step, device)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert go.offloaded_bytes() == 0


def test_grads_keep_copy_and_the_words(device, arena, caplog):
    import logging

    model = torch.nn.Linear(4, 4).to(device)
    model(torch.randn(3, 4, device=device)).sum().backward()
    grad = model.weight.grad.clone()
    with caplog.at_level(logging.INFO, logger="gpu_offload"):
        go.offload(model, arena=arena)  # grads="keep": they stay, and the log says how much
    assert model.weight.grad.untyped_storage().nbytes() == grad.numel() * grad.element_size()
    assert f"{(16 + 4) * 4} bytes of gradients" in caplog.text and "grads='drop'" in caplog.text
    go.reload(model)
    go.offload(model, grads="copy", arena=arena)  # include_grads=True under its new name
    assert model.weight.grad.untyped_storage().nbytes() == 0
    go.reload(model)
    assert torch.equal(model.weight.grad, grad)
    with pytest.raises(go.OffloadError, match="expected one of 'keep', 'copy', 'drop'"):
        go.offload(model, grads="free", arena=arena)
    with pytest.raises(go.OffloadError, match="pass one"):
        go.offload(model, grads="drop", include_grads=True, arena=arena)
    assert not go.is_offloaded(model)
    # With checksums, the copied state verifies on reload; the dropped gradients have nothing to verify.
    go.offload(model, grads="drop", checksum=True, arena=arena)
    go.reload(model, verify=True)
    assert torch.equal(model.weight.grad, torch.zeros_like(grad))
    # Offloaded twice with the gradients already dropped (a reload of the weights alone in between).
    go.offload(model, grads="drop", arena=arena)
    go.reload({"weight": model.weight, "bias": model.bias})
    go.offload(model, grads="drop", arena=arena)
    go.reload(model)
    # discard: a dropped gradient has no host copy to give back, and comes back empty.
    go.offload(model, grads="drop", arena=arena)
    go.discard(model)
    assert model.weight.grad.untyped_storage().nbytes() == 0 and go.offloaded_bytes() == 0


def test_swap_drops_the_outgoing_gradients(device, arena):
    policy, ref = torch.nn.Linear(4, 4).to(device), torch.nn.Linear(4, 4).to(device)
    policy(torch.randn(2, 4, device=device)).sum().backward()
    want = ref.weight.detach().clone()
    go.offload(ref, arena=arena)
    go.swap(policy, ref, grads="drop", arena=arena)
    assert policy.weight.grad.untyped_storage().nbytes() == 0 and go.is_offloaded(policy)
    assert torch.equal(ref.weight, want)
    go.reload(policy)
    assert torch.equal(policy.weight.grad, torch.zeros_like(policy.weight))


def test_context_manager_and_drop_free_the_space(arena):
    state = {"w": torch.randn(1000)}
    with go.snapshot(state, arena=arena) as snap:
        assert arena.used_bytes > 0
        assert snap.done()
    assert arena.used_bytes == 0 and snap.freed
    snap.free()  # a second free is a no-op
    go.snapshot(state, arena=arena)  # dropped at once: the space comes back
    assert arena.used_bytes == 0


def test_zero_size_and_empty_targets(device, arena):
    state = {"empty": torch.empty(0, device=device), "also": torch.empty(3, 0, device=device)}
    snap = go.snapshot(state, arena=arena)
    assert snap.nbytes == 0
    go.restore(state, snap)
    with pytest.raises(go.OffloadError, match="nothing to offload"):
        go.offload(state, arena=arena)
    assert go.snapshot({}, arena=arena).nbytes == 0


def test_large_storage_takes_the_parallel_host_path(arena):
    # 24 MiB: above the threshold where the host path splits copies over threads.
    state = {"big": random_tensor((6 << 20,), torch.float32, torch.device("cpu"), seed=3)}
    expected = state["big"].clone()
    snap = go.snapshot(state, arena=arena)
    state["big"].zero_()
    go.restore(state, snap)
    assert_bitwise_equal(state["big"], expected)
