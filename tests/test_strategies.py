"""The strategy table (gpu_offload.adapters.STRATEGIES): every target is asked of it, a strategy is one row,
and recognizing an object imports no framework."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import torch

import gpu_offload as go
from gpu_offload import adapters
from gpu_offload.adapters.strategy import Strategy


class FlatWrapper(torch.nn.Module):
    """A toy data-parallel wrapper in the manner of Megatron's DDP: its module's parameters are views into
    one flat buffer, and so are their gradients (into a flat gradient buffer)."""

    def __init__(self, module: torch.nn.Module, rank: int = 0) -> None:
        super().__init__()
        self.module = module
        self.rank = rank
        params = list(module.parameters())
        self.flat = torch.zeros(sum(p.numel() for p in params))
        self.flat_grad = torch.zeros_like(self.flat)
        offset = 0
        for p in params:
            n = p.numel()
            self.flat[offset:offset + n].copy_(p.detach().reshape(-1))
            p.data = self.flat[offset:offset + n].view_as(p)
            p.grad = self.flat_grad[offset:offset + n].view_as(p)
            offset += n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def _flat_named(obj: FlatWrapper, *, include_grads: bool, reshard: bool = True) -> tuple[list, list]:
    return [("flat", obj.flat)], ([("flat_grad", obj.flat_grad)] if include_grads else [])


FLAT = Strategy("flat_wrapper", lambda obj: isinstance(obj, FlatWrapper), _flat_named,
                lambda obj: {"kind": "flat_wrapper", "rank": obj.rank})


@pytest.fixture
def with_flat_strategy(monkeypatch: pytest.MonkeyPatch) -> None:
    # A new strategy is one row of the table, ahead of the plain module that its object also is.
    monkeypatch.setattr(adapters, "STRATEGIES", (FLAT, *adapters.STRATEGIES))


def test_a_strategy_is_one_row_of_the_table(with_flat_strategy: None, arena: go.Arena) -> None:
    torch.manual_seed(0)
    model = FlatWrapper(torch.nn.Linear(3, 2))
    model.flat_grad.fill_(1.0)
    assert adapters.strategy_of(model) is FLAT and adapters.strategy_of(model.module) is adapters.PLAIN_MODULE
    assert [n for n, _ in adapters.named_tensors(model, include_grads=True)] == ["flat", "flat_grad"]
    assert [n for n, _ in adapters.gradient_tensors([model])] == ["0.flat_grad"]
    assert json.loads(adapters.shard_info([model, model.module]) or "") == {"0": {"kind": "flat_wrapper", "rank": 0}}
    want = model(torch.ones(1, 3)).detach()
    snap = go.snapshot(model, arena=arena)
    assert snap.names == ["flat"] and snap.layout.shard_info is not None
    with pytest.raises(go.OffloadError, match="flat_wrapper"):  # not a state dict: the table says so
        snap.state_dict()
    with torch.no_grad():
        model.flat.zero_()
    go.restore(model, snap)
    assert torch.equal(model(torch.ones(1, 3)), want)
    # The table's gradients are what grads="drop" releases: the flat gradient buffer, without a copy.
    go.offload(model, grads="drop", arena=arena)
    assert model.flat.untyped_storage().nbytes() == 0 and model.flat_grad.untyped_storage().nbytes() == 0
    assert go.offloaded_bytes() == model.flat.numel() * 4
    go.reload(model)
    assert torch.equal(model(torch.ones(1, 3)), want)
    assert torch.equal(model.module.weight.grad, torch.zeros(2, 3))  # still a view, zeroed
    assert model.module.weight.grad.untyped_storage()._cdata == model.flat_grad.untyped_storage()._cdata
    # Restoring into another rank's object is refused: its shard info differs.
    other = FlatWrapper(torch.nn.Linear(3, 2), rank=1)
    with pytest.raises(go.LayoutMismatchError, match="rank"):
        go.restore(other, snap)
    snap.free()


def test_plain_objects_are_the_last_rows() -> None:
    linear = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(linear.parameters(), lr=0.1)
    assert adapters.strategy_of(linear) is adapters.PLAIN_MODULE
    assert adapters.strategy_of(opt) is adapters.TORCH_OPTIMIZER
    assert adapters.strategy_of({"w": torch.zeros(1)}) is None and adapters.strategy_of(3) is None
    assert adapters.STRATEGIES[-2:] == (adapters.PLAIN_MODULE, adapters.TORCH_OPTIMIZER)
    assert len({s.name for s in adapters.STRATEGIES}) == len(adapters.STRATEGIES)
    assert adapters.state_dict_kinds() == {"fsdp2"}
    with pytest.raises(go.OffloadError, match="unsupported target builtins.object"):
        adapters.named_tensors(object())


def test_a_plain_module_imports_no_framework() -> None:
    # Recognizing an object looks for FSDP, DeepSpeed and Megatron in sys.modules: a model that uses none of
    # them does not load them (torch.distributed.fsdp brings sympy, about 47 MiB of RSS). (No optimizer here:
    # torch 2.13 builds its first one through torch._dynamo, which loads both by itself.)
    code = (
        "import sys, torch\n"
        "import gpu_offload as go\n"
        "m = torch.nn.Linear(4, 4)\n"
        "snap = go.snapshot(m)\n"
        "go.restore(m, snap)\n"
        "snap.state_dict()\n"
        "go.offload(m, grads='drop')\n"
        "go.reload(m)\n"
        "assert not go.is_offloaded(m)\n"
        "bad = sorted(k for k in sys.modules if k == 'sympy' or k.startswith(\n"
        "    ('torch.distributed.fsdp', 'torch.distributed._composable', 'deepspeed', 'megatron')))\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _names(target: Any) -> list[str]:
    return [n for n, _ in adapters.named_tensors(target, include_grads=True)]


def test_state_then_gradients_in_a_list() -> None:
    # A list is its parts: each part's state, then every part's gradients.
    a, b = torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 2, bias=False)
    for m in (a, b):
        m(torch.ones(1, 2)).sum().backward()
    assert _names([a, {"x": torch.zeros(1)}, b]) == ["0.weight", "1.x", "2.weight", "0.weight.grad", "2.weight.grad"]
    assert [n for n, _ in adapters.gradient_tensors([a, b])] == ["0.weight.grad", "1.weight.grad"]
    assert len(adapters.gradient_tensors({"x": torch.zeros(1)})) == 0
