"""megatron-core DDP chunks and Megatron optimizers on the CPU (see megatron_fixtures for the patches).

Targets are lists like a Megatron trainer holds: DDP-wrapped GPT chunks, a plain (non-DDP) module chunk,
the Megatron optimizer and the plain module's torch optimizer.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("megatron.core")

# megatron-core warns at import and build about missing Apex / Transformer Engine and deprecated modules.
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

import gpu_offload as go  # noqa: E402
from gpu_offload.adapters import megatron as meg  # noqa: E402
from helpers_dist import run_ranks  # noqa: E402
from megatron_fixtures import (  # noqa: E402,F401
    backward,
    build_chunk,
    build_optimizer,
    logits,
    megatron_parallel,
    megatron_world,
    optimizer_step,
    train_step,
)

# (use_distributed_optimizer, bf16): bf16 adds fp32 master params (Float16 / DistributedOptimizer).
CONFIGS = [(False, False), (False, True), (True, False), (True, True)]
IDS = ["ddp-fp32", "ddp-bf16", "distopt-fp32", "distopt-bf16"]


def _make(dist_opt: bool, bf16: bool, seed: int = 0) -> tuple[list, object]:
    chunks = [build_chunk(seed=seed + i, use_distributed_optimizer=dist_opt, bf16=bf16) for i in range(2)]
    return chunks, build_optimizer(chunks, use_distributed_optimizer=dist_opt, bf16=bf16)


def _storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _params(chunks: list) -> dict[str, torch.Tensor]:
    return {f"{i}.{n}": p.detach().clone() for i, c in enumerate(chunks) for n, p in c.named_parameters()}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _views(chunks: list) -> list[tuple[int, int, int, int]]:
    """(param storage, offset into param_data or -1, main_grad storage, offset into grad_data) per param."""
    out = []
    for c in chunks:
        for buf in c.buffers:
            for p in buf.params:
                pd = buf.param_data
                out.append((
                    _storage_id(p),
                    p.data_ptr() - pd.data_ptr() if pd is not None else -1,
                    _storage_id(p.main_grad),
                    p.main_grad.data_ptr() - buf.grad_data.data_ptr(),
                ))
    return out


@pytest.mark.parametrize("dist_opt,bf16", CONFIGS, ids=IDS)
def test_offload_reload_then_training_matches_twin(megatron_world, dist_opt, bf16):
    a_chunks, a_opt = _make(dist_opt, bf16)
    b_chunks, b_opt = _make(dist_opt, bf16)
    assert all(meg.is_megatron_ddp(c) for c in a_chunks) and meg.is_megatron_optimizer(a_opt)
    for i in range(2):
        assert torch.equal(train_step(a_chunks, a_opt, i), train_step(b_chunks, b_opt, i))

    for c in a_chunks:
        for buf in c.buffers:
            if dist_opt:  # every trainable param is a view into the flat param buffer
                assert all(_storage_id(p) == _storage_id(buf.param_data) for p in buf.params)
            else:
                assert buf.param_data is None
    views = _views(a_chunks)

    # Interrupt a step after backward: offload everything with grads, reload, finish the step.
    backward(a_chunks, a_opt, 2, 0)
    backward(b_chunks, b_opt, 2, 0)
    target = [*a_chunks, a_opt]
    go.offload(target, include_grads=True)
    assert go.is_offloaded(a_chunks[0]) and go.is_offloaded(a_opt)
    for c in a_chunks:
        for buf in c.buffers:
            assert buf.grad_data.untyped_storage().nbytes() == 0
            assert all(p.untyped_storage().nbytes() == 0 for p in buf.params)
    masters = [t for n, t in meg.megatron_optimizer_named_tensors(a_opt) if ".main_params." in n]
    assert bool(masters) == bf16
    assert all(t.untyped_storage().nbytes() == 0 for t in masters)
    go.reload(target)
    assert not go.is_offloaded(a_opt)
    assert _views(a_chunks) == views, "params / main_grads are no longer views into param_data / grad_data"
    for ca, cb in zip(a_chunks, b_chunks):
        for ba, bb in zip(ca.buffers, cb.buffers):
            assert torch.equal(ba.grad_data, bb.grad_data)
    optimizer_step(a_opt)
    optimizer_step(b_opt)

    # grads="drop" between backward and step, as verl and Megatron's own offload_grad_buffers() do: the fp32
    # grad buffers are released without a copy and come back zeroed, main_grad still views into them; the
    # step matches a twin that zeroed its buffers.
    backward(a_chunks, a_opt, 5, 0)
    backward(b_chunks, b_opt, 5, 0)
    state_bytes = go.snapshot(target).nbytes
    go.offload(target, grads="drop")
    grad_buffers = [buf.grad_data for c in a_chunks for buf in c.buffers]
    assert all(g.untyped_storage().nbytes() == 0 for g in grad_buffers), "a grad buffer still holds memory"
    assert go.offloaded_bytes() == state_bytes, "grad buffer bytes went to host memory"
    go.reload(target)
    assert _views(a_chunks) == views
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grad_buffers)
    for c in b_chunks:
        c.zero_grad_buffer()
    optimizer_step(a_opt)
    optimizer_step(b_opt)
    _assert_same(_params(a_chunks), _params(b_chunks))

    # Offload without grads between steps (grad buffers stay), and keep training.
    go.offload(target)
    go.reload(target)
    for i in range(3, 5):
        assert torch.equal(train_step(a_chunks, a_opt, i), train_step(b_chunks, b_opt, i)), f"step {i}"
    _assert_same(_params(a_chunks), _params(b_chunks))


@pytest.mark.parametrize("dist_opt,bf16", CONFIGS, ids=IDS)
def test_mis_v1_v2_with_a_non_ddp_chunk(megatron_world, dist_opt, bf16):
    chunks, opt = _make(dist_opt, bf16)
    twin_chunks, twin_opt = _make(dist_opt, bf16)
    torch.manual_seed(5)
    head = nn.Linear(8, 1)  # a chunk no DDP wraps, with its own torch optimizer
    head.register_buffer("calls", torch.zeros(()))
    head_opt = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)

    def head_step(step: int) -> None:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        head(x).pow(2).mean().backward()
        head_opt.step()
        head_opt.zero_grad()
        head.calls += 1

    target = [*chunks, head, opt, head_opt]
    for i in range(2):
        train_step(chunks, opt, i), train_step(twin_chunks, twin_opt, i), head_step(i)
    v1 = go.snapshot(target)
    ref_v1 = logits(chunks) + [head.weight.detach().clone(), head.calls.clone()]
    replay = [train_step(chunks, opt, i) for i in range(2, 4)]
    for i in range(2, 4):
        train_step(twin_chunks, twin_opt, i), head_step(i)
    v2 = go.snapshot(target)
    ref_v2 = logits(chunks) + [head.weight.detach().clone(), head.calls.clone()]

    go.restore(target, v1)  # compute at v1 ...
    now = logits(chunks) + [head.weight.detach(), head.calls]
    assert all(torch.equal(x, y) for x, y in zip(now, ref_v1)), "restored v1 computes like v1"
    assert not torch.equal(ref_v1[0], ref_v2[0])
    go.restore(target, v2)  # ... and back to v2
    now = logits(chunks) + [head.weight.detach(), head.calls]
    assert all(torch.equal(x, y) for x, y in zip(now, ref_v2)), "restored v2 computes like v2"

    # Completeness: from v1 the optimizer replays the same steps bitwise (master params, Adam state).
    go.restore(target, v1)
    assert all(torch.equal(train_step(chunks, opt, i), x) for i, x in zip(range(2, 4), replay)), "replay"
    go.restore(target, v2)
    for i in range(4, 6):
        assert torch.equal(train_step(chunks, opt, i), train_step(twin_chunks, twin_opt, i)), f"step {i}"
    _assert_same(_params(chunks), _params(twin_chunks))
    v1.free()
    v2.free()


@pytest.mark.parametrize("dist_opt,bf16", [(False, True), (True, True)], ids=["ddp-bf16", "distopt-bf16"])
def test_snapshot_names_bytes_and_fresh_twin(megatron_world, dist_opt, bf16):
    chunks, opt = _make(dist_opt, bf16)
    for i in range(2):
        train_step(chunks, opt, i)
    names = [n for n, _ in meg.megatron_ddp_named_tensors(chunks[0], include_grads=True)]
    assert ("buffers.0.param_data" in names) == dist_opt
    assert "buffers.0.grad_data" in names
    assert "module.embedding.word_embeddings.weight" in names
    without_grads = meg.megatron_ddp_named_tensors(chunks[0], include_grads=False)
    assert not any(n.endswith("grad_data") for n, _ in without_grads)

    # Bytes: the model is its param buffers (or its params), grads add exactly the grad buffers. (bf16
    # chunks have two buffers: bf16 weights and the fp32 norm weights.)
    c = chunks[0]
    assert len(c.buffers) == 2
    model_bytes = (
        sum(buf.param_data.untyped_storage().nbytes() for buf in c.buffers)
        if dist_opt
        else sum(p.untyped_storage().nbytes() for p in c.parameters())
    )
    snap = go.snapshot(c)
    assert snap.nbytes == model_bytes
    with pytest.raises(go.OffloadError, match="megatron_ddp.*flat shards"):  # no state dict
        snap.state_dict()
    snap.free()
    snap = go.snapshot(c, include_grads=True)
    assert snap.nbytes == model_bytes + sum(buf.grad_data.untyped_storage().nbytes() for buf in c.buffers)
    snap.free()

    # A freshly built twin with another init takes the whole state by names and then trains identically.
    snap = go.snapshot([*chunks, opt])
    other_chunks, other_opt = _make(dist_opt, bf16, seed=10)
    train_step(other_chunks, other_opt, 0)  # creates the optimizer state, so the layouts match
    assert not torch.equal(logits(other_chunks)[0], logits(chunks)[0])
    go.restore([*other_chunks, other_opt], snap)
    assert all(torch.equal(x, y) for x, y in zip(logits(other_chunks), logits(chunks)))
    for i in range(2, 4):
        assert torch.equal(train_step(other_chunks, other_opt, i), train_step(chunks, opt, i))
    snap.free()

    info = meg.megatron_shard_info(chunks[0])
    assert info["dp_world_size"] == 1 and info["use_distributed_optimizer"] == dist_opt
    assert info == meg.megatron_shard_info(other_chunks[0])
    assert meg.megatron_shard_info(opt) == meg.megatron_shard_info(other_opt)


def _two_rank_distopt(rank: int, world_size: int) -> dict[str, int]:
    with megatron_parallel():
        a_chunks, a_opt = _make(True, True)
        b_chunks, b_opt = _make(True, True)
        for i in range(2):
            assert torch.equal(train_step(a_chunks, a_opt, i, rank), train_step(b_chunks, b_opt, i, rank))
        masters = [t for n, t in meg.megatron_optimizer_named_tensors(a_opt) if ".main_params." in n]
        master_numel = sum(t.numel() for t in masters)
        padded = sum(buf.numel for c in a_chunks for buf in c.buffers)
        go.offload([*a_chunks, a_opt])
        go.reload([*a_chunks, a_opt])
        for i in range(2, 4):
            assert torch.equal(train_step(a_chunks, a_opt, i, rank), train_step(b_chunks, b_opt, i, rank))
        _assert_same(_params(a_chunks), _params(b_chunks))
        info = meg.megatron_shard_info(a_opt)["optimizers"][0]
        assert (info["dp_world_size"], info["dp_rank"]) == (world_size, rank)
        return {"master_numel": master_numel, "padded": padded}


@pytest.mark.slow
def test_two_ranks_distributed_optimizer_shards_master_params():
    results = run_ranks(_two_rank_distopt, 2)
    # Each rank's fp32 masters cover its half of the padded buffers, and the halves add up to all of it.
    assert results[0]["padded"] == results[1]["padded"]
    assert sum(r["master_numel"] for r in results) <= results[0]["padded"]
    assert all(r["master_numel"] <= r["padded"] // 2 for r in results)
    assert all(r["master_numel"] > r["padded"] // 2 - 1024 for r in results)


def test_detection_and_errors(megatron_world):
    chunk = build_chunk(seed=0, use_distributed_optimizer=False)
    plain = nn.Linear(2, 2)
    assert meg.is_megatron_ddp(chunk) and not meg.is_megatron_ddp(chunk.module) and not meg.is_megatron_ddp(plain)
    torch_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    assert not meg.is_megatron_optimizer(torch_opt) and not meg.is_megatron_optimizer(chunk)
    with pytest.raises(go.OffloadError):
        meg.megatron_ddp_named_tensors(plain, include_grads=False)
    with pytest.raises(go.OffloadError):
        meg.megatron_optimizer_named_tensors(torch_opt)
    with pytest.raises(go.OffloadError):
        meg.megatron_shard_info(plain)


def test_detection_never_imports_megatron():
    code = (
        "import sys, torch\n"
        "from gpu_offload.adapters import megatron as m\n"
        "assert not m.is_megatron_ddp(torch.nn.Linear(1, 1)) and not m.is_megatron_optimizer(object())\n"
        "assert not any(k.startswith('megatron') for k in sys.modules), 'megatron was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_calling_an_offloaded_megatron_ddp_chunk_says_to_reload(megatron_world):
    chunks, opt = _make(False, False)
    want = logits(chunks)
    go.offload([*chunks, opt])
    with pytest.raises(go.OffloadError, match=r"cannot run DistributedDataParallel.*gpu_offload\.reload\(\)"):
        logits(chunks)
    go.reload([*chunks, opt])
    for a, b in zip(logits(chunks), want):
        assert torch.equal(a, b)
