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
