"""The seed-compatible drop-ins: verl's numbered CPU slots and Megatron's copy/restore helpers."""

from __future__ import annotations

import logging

import pytest
import torch

import gpu_offload as go
from gpu_offload.integrations.megatron import copy_megatron_model_to_cpu, restore_megatron_model_from_cpu
from gpu_offload.integrations.verl import GpuOffloadSlotsMixin
from megatron_fixtures import megatron_world  # noqa: F401  (fixture)


class _Actor:
    def __init__(self, module: torch.nn.Module) -> None:
        self.actor_module = module


class FsdpStyleWorker(GpuOffloadSlotsMixin):
    def __init__(self, module: torch.nn.Module, arena: go.Arena) -> None:
        self.actor_module_fsdp = module
        self.gpu_offload_arena = arena


class MegatronStyleWorker(GpuOffloadSlotsMixin):
    def __init__(self, chunks: list[torch.nn.Module]) -> None:
        self.actor = _Actor(chunks)  # verl's megatron worker keeps the chunk list at actor.actor_module


def _weights(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _bump(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)


def test_verl_slots_save_restore_clear(arena, caplog):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    worker = FsdpStyleWorker(model, arena)
    v1 = _weights(model)
    worker.save_model_to_cpu(1)
    _bump(model)
    v2 = _weights(model)
    worker.save_model_to_cpu(2)
    worker.restore_model_from_cpu(1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), v1))
    worker.restore_model_from_cpu(2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), v2))
    worker.restore_model_from_cpu(1)  # slots survive a restore
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), v1))
    used = arena.used_bytes
    worker.save_model_to_cpu(1)  # overwriting a slot frees the old copy
    assert arena.used_bytes == used
    worker.clear_cpu_model(1)
    worker.clear_cpu_model(2)
    worker.clear_cpu_model(3)  # unknown: no-op, as in verl
    assert arena.used_bytes == 0 and worker.cpu_saved_models == {}
    with caplog.at_level(logging.WARNING, logger="gpu_offload"):
        worker.restore_model_from_cpu(7)
    assert "no such slot" in caplog.text


def test_verl_slots_can_be_reset_like_verl_does(arena):
    worker = FsdpStyleWorker(torch.nn.Linear(4, 4), arena)
    worker.save_model_to_cpu(0)
    worker.save_model_to_cpu(1)
    assert arena.used_bytes > 0
    worker.cpu_saved_models = {}  # what verl's workers do to drop every slot
    assert worker.cpu_saved_models == {} and arena.used_bytes == 0
    with pytest.raises(go.OffloadError, match="Snapshots"):
        worker.cpu_saved_models = {0: {"weight": torch.zeros(4, 4)}}


def test_verl_slots_need_a_module():
    class Empty(GpuOffloadSlotsMixin):
        pass

    with pytest.raises(go.OffloadError, match="override gpu_offload_target"):
        Empty().save_model_to_cpu(0)


def test_megatron_helpers_on_plain_chunks_mis_pattern(arena):
    # Chunks that are not DDP-wrapped (a reference model) go by their parameters.
    torch.manual_seed(0)
    chunks = [torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)]
    x = torch.randn(4, 6)

    def log_prob() -> torch.Tensor:
        return torch.log_softmax(chunks[1](chunks[0](x)), dim=-1)

    v1 = copy_megatron_model_to_cpu(chunks, arena=arena)
    lp1 = log_prob()
    for c in chunks:
        _bump(c)
    lp2 = log_prob()
    v2 = copy_megatron_model_to_cpu(chunks, arena=arena)  # save v2
    restore_megatron_model_from_cpu(chunks, v1)  # restore v1
    assert torch.equal(log_prob(), lp1)  # old log-probs from v1
    restore_megatron_model_from_cpu(chunks, v2)  # back to v2
    assert torch.equal(log_prob(), lp2)
    with pytest.raises(go.OffloadError, match="cpu_state must come from"):
        restore_megatron_model_from_cpu(chunks, {"model_chunk_0": {}})
    with pytest.raises(go.LayoutMismatchError):
        restore_megatron_model_from_cpu(chunks[:1], v1)


def _param_bytes(chunk) -> int:
    """Device bytes of a DDP chunk's parameters: each buffer's flat param_data where it exists (distributed
    optimizer), else the parameters' own storages."""
    total = 0
    for buf in chunk.buffers:
        if buf.param_data is not None:
            total += buf.param_data.untyped_storage().nbytes()
        else:
            total += sum({p.untyped_storage()._cdata: p.untyped_storage().nbytes() for p in buf.params}.values())
    return total


def test_megatron_helpers_on_ddp_chunks_mis_pattern(megatron_world):
    from megatron_fixtures import build_chunk, build_optimizer, logits, train_step

    for distributed_optimizer in (False, True):
        chunks = [build_chunk(seed=3, use_distributed_optimizer=distributed_optimizer)]
        opt = build_optimizer(chunks, use_distributed_optimizer=distributed_optimizer)
        train_step(chunks, opt, step=0)
        v1 = copy_megatron_model_to_cpu(chunks)
        assert v1.nbytes == _param_bytes(chunks[0])
        out_v1 = logits(chunks)
        train_step(chunks, opt, step=1)
        out_v2 = logits(chunks)
        assert not torch.equal(out_v1[0], out_v2[0])
        v2 = copy_megatron_model_to_cpu(chunks)
        restore_megatron_model_from_cpu(chunks, v1)
        assert torch.equal(logits(chunks)[0], out_v1[0])
        restore_megatron_model_from_cpu(chunks, v2)
        assert torch.equal(logits(chunks)[0], out_v2[0])
        if distributed_optimizer:  # the parameters are still views into the flat buffer
            buf = chunks[0].buffers[0]
            p = next(iter(buf.params))
            assert p.untyped_storage().data_ptr() == buf.param_data.untyped_storage().data_ptr()
        v1.free()
        v2.free()


def test_verl_slots_with_megatron_chunks(megatron_world):
    from megatron_fixtures import build_chunk, logits

    chunks = [build_chunk(seed=5, use_distributed_optimizer=False)]
    worker = MegatronStyleWorker(chunks)
    before = logits(chunks)
    worker.save_model_to_cpu("v1")
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.mul_(0.5)
    assert not torch.equal(logits(chunks)[0], before[0])
    worker.restore_model_from_cpu("v1")
    assert torch.equal(logits(chunks)[0], before[0])
    worker.clear_cpu_model("v1")


# ------------------------------------------------------------------- verl's offload helpers, FSDP


def _fsdp_model(kind: str, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from helpers_dist import build_qwen2

    model = build_qwen2(seed=seed)
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (1,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(model, device_id=torch.device("cpu"))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)


def _lm_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, finish: bool = True) -> torch.Tensor:
    from helpers_dist import batch, lm_loss

    ids = batch(step)
    loss = lm_loss(model(ids), ids)
    loss.backward()
    if finish:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.detach()


def _state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter (its local shard), buffer and optimizer state tensor, read from torch's own objects."""
    out = [_local(p) for p in model.parameters()] + list(model.buffers())
    out += [_local(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return out


def _grad_list(model: torch.nn.Module) -> list[torch.Tensor]:
    return [_local(p.grad) for p in model.parameters() if p.grad is not None]


def _check_verl_fsdp(rank: int, world_size: int, kind: str) -> None:
    from gpu_offload.integrations import verl

    (a, oa), (b, ob) = _fsdp_model(kind), _fsdp_model(kind)
    offload_model = verl.offload_fsdp2_model_to_cpu if kind == "fsdp2" else verl.offload_fsdp_model_to_cpu
    load_model = verl.load_fsdp2_model_to_gpu if kind == "fsdp2" else verl.load_fsdp_model_to_gpu
    verl.offload_fsdp_optimizer(oa)  # no state yet: a no-op, as verl's
    verl.load_fsdp_model_to_gpu(a)  # nothing offloaded: a no-op, as verl's
    for i in range(2):
        assert torch.equal(_lm_step(a, oa, i), _lm_step(b, ob, i))
    want = [t.clone() for t in _state_tensors(a, oa)]
    device_bytes = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in _state_tensors(a, oa)}.values())

    # What verl's trainers do around generation: model and optimizer out, then back.
    offload_model(a)
    verl.offload_fsdp_optimizer(oa)
    offload_model(a)  # twice: a no-op, as verl's
    assert all(t.untyped_storage().nbytes() == 0 for t in _state_tensors(a, oa)), "device memory still held"
    assert go.offloaded_bytes() == device_bytes, "the host copy is not exactly what the device held"
    load_model(a)
    verl.load_fsdp_optimizer(oa, torch.device("cpu"))
    assert all(torch.equal(x, y) for x, y in zip(_state_tensors(a, oa), want)), "values after load"
    for i in range(2, 4):
        assert torch.equal(_lm_step(a, oa, i), _lm_step(b, ob, i)), f"step {i} after load"

    # Gradients, as verl: FSDP1's helper leaves them on the device, FSDP2's (model.to) moves them.
    for m, o in ((a, oa), (b, ob)):
        _lm_step(m, o, 4, finish=False)
    grads = [g.clone() for g in _grad_list(a)]
    offload_model(a)
    kept = all(g.untyped_storage().nbytes() > 0 for g in _grad_list(a))
    assert kept == (kind == "fsdp1"), "default gradient handling differs from verl's"
    load_model(a)
    assert all(torch.equal(x, y) for x, y in zip(_grad_list(a), grads))
    # grads="drop": freed without a copy, zeroed on load; the step matches a twin that zeroed its gradients.
    offload_model(a, grads="drop")
    assert all(g.untyped_storage().nbytes() == 0 for g in _grad_list(a))
    load_model(a)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in _grad_list(a))
    ob.zero_grad(set_to_none=False)
    oa.step(), ob.step()
    oa.zero_grad(set_to_none=True), ob.zero_grad(set_to_none=True)
    for i in range(5, 7):
        assert torch.equal(_lm_step(a, oa, i), _lm_step(b, ob, i)), f"step {i} after dropping the gradients"


@pytest.mark.parametrize("kind", ["plain", "fsdp1", "fsdp2"])
def test_verl_fsdp_helpers_against_a_twin(kind: str) -> None:
    from helpers_dist import run_ranks

    run_ranks(_check_verl_fsdp, 1, kind)


def test_verl_helpers_match_verls_signatures() -> None:
    # The parameters (names, order, defaults) of verl 0.9.1's verl/utils/{fsdp,megatron}_utils.py; extras
    # are keyword-only.
    import inspect

    from gpu_offload.integrations import verl

    theirs = {
        "offload_fsdp_model_to_cpu": "(model, empty_cache=True)",
        "offload_fsdp2_model_to_cpu": "(model, empty_cache=True)",
        "load_fsdp_model_to_gpu": "(model)",
        "load_fsdp2_model_to_gpu": "(model)",
        "offload_fsdp_optimizer": "(optimizer)",
        "load_fsdp_optimizer": "(optimizer, device_id)",
        "offload_megatron_model_to_cpu": "(models)",
        "load_megatron_model_to_gpu": "(models, load_grad=True, load_frozen_params=True)",
        "offload_megatron_copy_params": "(optimizers)",
        "load_megatron_copy_params": "(optimizers)",
        "offload_megatron_optimizer": "(optimizers)",
        "load_megatron_optimizer": "(optimizers)",
    }
    for name, sig in theirs.items():
        params = inspect.signature(getattr(verl, name)).parameters.values()
        positional = [p for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        ours = "(" + ", ".join(p.name if p.default is inspect.Parameter.empty or p.name == "device_id"
                               else f"{p.name}={p.default!r}" for p in positional) + ")"
        assert ours == sig, (name, ours, sig)
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params if p not in positional), name


# ---------------------------------------------------------------- verl's offload helpers, Megatron


def _grad_data(chunks: list) -> list[torch.Tensor]:
    return [buf.grad_data for c in chunks for buf in c.buffers]


def _main_grad_views(chunks: list) -> list[tuple[bool, int, bool, int]]:
    """Per parameter: whether it views param_data and where, whether main_grad views grad_data and where."""
    out = []
    for c in chunks:
        for buf in c.buffers:
            for p in buf.params:
                pd, gd = buf.param_data, buf.grad_data
                out.append((pd is not None and p.untyped_storage()._cdata == pd.untyped_storage()._cdata,
                            p.data_ptr() - pd.data_ptr() if pd is not None else 0,
                            p.main_grad.untyped_storage()._cdata == gd.untyped_storage()._cdata,
                            p.main_grad.data_ptr() - gd.data_ptr()))
    return out


def _model_storages(chunks: list) -> list[torch.Tensor]:
    """What a chunk's weights live in: each buffer's param_data (distributed optimizer) or the parameters."""
    out = []
    for c in chunks:
        out += [buf.param_data for buf in c.buffers if buf.param_data is not None]
        out += list(c.parameters())
    return out


@pytest.mark.parametrize("dist_opt", [False, True], ids=["ddp-bf16", "distopt-bf16"])
def test_verl_megatron_helpers_against_a_twin(megatron_world, dist_opt):
    from gpu_offload.integrations import verl
    from megatron_fixtures import backward, build_chunk, build_optimizer, logits, optimizer_step, train_step

    frozen = ("decoder.layers.0.mlp.linear_fc1.weight",)  # a frozen parameter, outside DDP's buffers (LoRA)

    def make() -> tuple[list, object]:
        chunks = [build_chunk(seed=3, use_distributed_optimizer=dist_opt, bf16=True, frozen=frozen)]
        return chunks, build_optimizer(chunks, use_distributed_optimizer=dist_opt, bf16=True)

    (a, a_opt), (b, b_opt) = make(), make()
    frozen_param = a[0].module.decoder.layers[0].mlp.linear_fc1.weight
    assert not frozen_param.requires_grad
    for i in range(2):
        assert torch.equal(train_step(a, a_opt, i), train_step(b, b_opt, i))
    # After a step the grad buffers hold that step's gradients, which the next step recomputes.
    assert any(g.abs().sum() > 0 for g in _grad_data(a))
    state_bytes = go.snapshot([*a, a_opt]).nbytes
    views = _main_grad_views(a)
    assert views and all(v[2] for v in views) and all(v[0] == dist_opt for v in views)

    verl.offload_megatron_model_to_cpu(a)
    verl.offload_megatron_optimizer(a_opt)
    assert all(t.untyped_storage().nbytes() == 0 for t in _model_storages(a)), "weights still on the device"
    assert all(g.untyped_storage().nbytes() == 0 for g in _grad_data(a)), "grad buffers still on the device"
    masters = [t for n, t in go.adapters.megatron.megatron_optimizer_named_tensors(a_opt)]
    assert masters and all(t.untyped_storage().nbytes() == 0 for t in masters), "optimizer state still held"
    # The grad buffers were released without a copy: the host holds the weights and optimizer state only.
    assert go.offloaded_bytes() == state_bytes

    # Inference first (verl's compute_log_prob): weights back, gradients left released.
    verl.load_megatron_model_to_gpu(a, load_grad=False)
    assert all(g.untyped_storage().nbytes() == 0 for g in _grad_data(a))
    assert all(torch.equal(x, y) for x, y in zip(logits(a), logits(b))), "logits after load_grad=False"
    verl.offload_megatron_model_to_cpu(a)  # and out again, the gradients still released
    # Then without the frozen parameters, and out again (what is on the host already is skipped).
    verl.load_megatron_model_to_gpu(a, load_frozen_params=False)
    assert frozen_param.untyped_storage().nbytes() == 0
    assert all(t.untyped_storage().nbytes() > 0 for t in _model_storages(a) if t is not frozen_param)
    verl.offload_megatron_model_to_cpu(a)
    assert all(t.untyped_storage().nbytes() == 0 for t in _model_storages(a))
    verl.load_megatron_model_to_gpu(a)
    verl.load_megatron_optimizer(a_opt)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in _grad_data(a)), "grad buffers not zeroed on load"
    assert _main_grad_views(a) == views, "main_grad (or the parameters) no longer view the flat buffers"
    for c in b:
        c.zero_grad_buffer()
    for i in range(2, 4):
        assert torch.equal(train_step(a, a_opt, i), train_step(b, b_opt, i)), f"step {i} after load"

    # The fp32 master shards alone (the distributed optimizer's; the Float16 optimizer has none there).
    copies = [t for opt in a_opt.chained_optimizers for g in getattr(opt, "shard_fp32_from_float16_groups", [])
              for t in g]
    assert bool(copies) == dist_opt
    want = [t.clone() for t in copies]
    verl.offload_megatron_copy_params(a_opt)
    assert all(t.untyped_storage().nbytes() == 0 for t in copies)
    verl.offload_megatron_optimizer(a_opt)  # the rest of the state; the copies are out already
    verl.load_megatron_copy_params(a_opt)
    assert all(torch.equal(x, y) for x, y in zip(copies, want))
    verl.load_megatron_optimizer(a_opt)
    # Interrupted between backward and step (the gradients are then dropped, and zeroed on load).
    backward(a, a_opt, 4, 0)
    backward(b, b_opt, 4, 0)
    verl.offload_megatron_model_to_cpu(a)
    verl.load_megatron_model_to_gpu(a)
    for c in b:
        c.zero_grad_buffer()
    optimizer_step(a_opt)
    optimizer_step(b_opt)
    for i in range(5, 7):
        assert torch.equal(train_step(a, a_opt, i), train_step(b, b_opt, i)), f"step {i}"
    # A chunk that is not DDP-wrapped (a reference model): parameters and gradients move, as in verl.
    ref = torch.nn.Linear(4, 4)
    ref(torch.randn(2, 4)).sum().backward()
    grad = ref.weight.grad.clone()
    verl.offload_megatron_model_to_cpu([ref])
    assert ref.weight.untyped_storage().nbytes() == 0 and ref.weight.grad.untyped_storage().nbytes() == 0
    verl.load_megatron_model_to_gpu([ref], load_grad=False)
    assert torch.equal(ref.weight.grad, grad)
