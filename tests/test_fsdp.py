"""FSDP1 and FSDP2 targets on gloo (CPU): each rank snapshots/offloads only its own shards, and training
after a round trip is bitwise identical to an untouched twin.

World size 1 runs in this process (FSDP1 then uses NO_SHARD); world size 2 spawns two ranks (FULL_SHARD).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gpu_offload as go
from gpu_offload import torch_ext
from gpu_offload.adapters import fsdp as fsdp_adapter
from helpers_dist import DecoderLayer, batch, build_qwen2, lm_loss, param_bytes, run_ranks

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable"),
    pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

KINDS = ["fsdp1", "fsdp1_orig_params", "fsdp2"]


def _wrap(model: nn.Module, kind: str, world_size: int) -> nn.Module:
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    # Decoder layers are their own units; the root keeps the tied embedding / lm_head and the norm.
    return FSDP(
        model,
        device_id=torch.device("cpu"),
        auto_wrap_policy=ModuleWrapPolicy({DecoderLayer}),
        use_orig_params=kind == "fsdp1_orig_params",
    )


def _make(kind: str, world_size: int, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _wrap(build_qwen2(seed=seed), kind, world_size)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> torch.Tensor:
    ids = batch(step, rank)
    loss = lm_loss(model(ids), ids)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _probe(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(batch(999, 0)).clone()


def _full_params(model: nn.Module, kind: str) -> dict[str, torch.Tensor]:
    """Unsharded parameters (a collective: every rank calls it)."""
    if kind == "fsdp2":
        # The root stays unsharded after a no_grad forward: its parameters are plain tensors then.
        return {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()
        }
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: _local(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def _grad_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every gradient on this rank: the parameters' (FSDP2: their local shards) and FSDP1's flat ones."""
    out = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    for m in model.modules():
        flat = getattr(getattr(m, "_handle", None), "flat_param", None)
        if flat is not None and flat.grad is not None:
            out.append(flat.grad)
    return out


def _released(model: nn.Module, grads: bool = False) -> bool:
    """Whether every parameter (its local shard), buffer and, if asked, gradient holds no memory."""
    tensors = [_local(p) for p in model.parameters()] + list(model.buffers())
    if grads:
        tensors += [_local(p.grad) for p in model.parameters() if p.grad is not None]
    return all(t.untyped_storage().nbytes() == 0 for t in tensors)


def _accumulate_without_sync(model: nn.Module, kind: str, rank: int) -> None:
    if kind == "fsdp2":
        model.set_requires_gradient_sync(False)
        sync_off = contextlib.nullcontext()
    else:
        sync_off = model.no_sync()
    with sync_off:
        for i in range(2):
            ids = batch(30 + i, rank)
            lm_loss(model(ids), ids).backward()


def _check_rank(rank: int, world_size: int, kind: str) -> dict[str, int]:
    """Everything one rank checks; returns byte counts for cross-rank checks in the parent."""
    a, oa = _make(kind, world_size)
    b, ob = _make(kind, world_size)
    assert fsdp_adapter.is_fsdp2(a) == (kind == "fsdp2") and fsdp_adapter.is_fsdp1(a) == (kind != "fsdp2")

    # Offload before FSDP's lazy init (the flat parameter itself is the shard then), and back.
    go.offload(a)
    assert go.is_offloaded(a)
    assert _released(a)
    go.reload(a)
    assert not go.is_offloaded(a)

    losses_a = [_step(a, oa, i, rank) for i in range(2)]
    losses_b = [_step(b, ob, i, rank) for i in range(2)]
    assert all(torch.equal(x, y) for x, y in zip(losses_a, losses_b))

    # Per-rank size: this rank's shards plus the replicated buffers, not the whole model.
    snap = go.snapshot(a)
    buffer_bytes = sum(t.numel() * t.element_size() for _, t in a.named_buffers())
    shard_bytes = snap.nbytes - buffer_bytes
    full = param_bytes(build_qwen2())
    assert full // world_size <= shard_bytes, (shard_bytes, full)
    assert shard_bytes <= full // world_size + 1024, (shard_bytes, full)  # padding: < 1 row per param/unit
    snap.free()

    # Gradients: offload with include_grads between backward and step, then the step must match the twin.
    for m in (a, b):
        ids = batch(10, rank)
        lm_loss(m(ids), ids).backward()
    grads_before = _grads(a)
    assert grads_before, "backward produced no gradients"
    go.offload([a, oa], include_grads=True)
    assert _released(a, grads=True)
    go.reload([a, oa])
    _assert_same(_grads(a), grads_before, "grads after reload")
    _assert_same(_grads(a), _grads(b), "grads vs twin")
    for opt in (oa, ob):
        opt.step()
        opt.zero_grad(set_to_none=True)

    # grads="drop" between backward and step: every gradient storage (FSDP1's flat gradients, the original
    # parameters' views into them, FSDP2's sharded gradients) released without a copy, zeroed on reload;
    # the step and the training after it match a twin whose gradients were zeroed.
    for m in (a, b):
        ids = batch(11, rank)
        lm_loss(m(ids), ids).backward()
    grads = _grad_tensors(a)
    assert grads and any(g.abs().sum() > 0 for g in grads)
    state_bytes = go.snapshot([a, oa]).nbytes
    go.offload([a, oa], grads="drop")
    assert all(g.untyped_storage().nbytes() == 0 for g in grads), "a gradient still holds memory"
    assert _released(a) and go.offloaded_bytes() == state_bytes, "gradient bytes went to host memory"
    go.reload([a, oa])
    assert all(torch.equal(g, torch.zeros_like(g)) for g in _grad_tensors(a)), "gradients not zeroed"
    ob.zero_grad(set_to_none=False)
    _assert_same(_grads(a), _grads(b), "zeroed grads vs twin")
    for opt in (oa, ob):
        opt.step()
        opt.zero_grad(set_to_none=True)

    # A no_grad forward leaves the root unit unsharded; offload must still release (and restore) it all.
    _probe(a), _probe(b)
    go.offload([a, oa])
    assert _released(a)
    state = [_local(v) for s in oa.state.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1]
    assert state and all(t.untyped_storage().nbytes() == 0 for t in state), "optimizer state not released"
    go.reload([a, oa])
    for i in range(2, 4):
        assert torch.equal(_step(a, oa, i, rank), _step(b, ob, i, rank)), f"loss at step {i}"

    # MIS pattern: save v1, train to v2, save v2, restore v1, compute, restore v2, compute, keep training.
    v1 = go.snapshot([a, oa])
    ref_v1 = _probe(a)
    replay = [_step(a, oa, i, rank) for i in range(4, 6)]
    for i in range(4, 6):
        _step(b, ob, i, rank)
    ref_v2 = _probe(a)
    v2 = go.snapshot([a, oa])
    go.restore([a, oa], v1)
    assert torch.equal(_probe(a), ref_v1), "restored v1 computes like v1"
    assert not torch.equal(ref_v1, ref_v2)
    go.restore([a, oa], v2)
    assert torch.equal(_probe(a), ref_v2), "restored v2 computes like v2"
    # Completeness: from v1 the same steps replay to the same losses.
    go.restore([a, oa], v1)
    assert all(torch.equal(_step(a, oa, i, rank), x) for i, x in zip(range(4, 6), replay)), "replay from v1"
    go.restore([a, oa], v2)
    for i in range(6, 8):
        assert torch.equal(_step(a, oa, i, rank), _step(b, ob, i, rank)), f"loss at step {i} after MIS"
    v1.free()
    v2.free()

    # A freshly built twin (other init) takes a snapshot by names and then computes like the original.
    c, _ = _make(kind, world_size, seed=1)
    assert not torch.equal(_probe(c), _probe(a))
    snap = go.snapshot(a)
    go.restore(c, snap)
    assert torch.equal(_probe(c), _probe(a))
    snap.free()

    if kind != "fsdp2" and world_size > 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(a):
            with pytest.raises(go.OffloadError, match="summon_full_params|forward"):
                go.snapshot(a)

    # Gradient accumulation without sync (FSDP1 no_sync: unsharded flat grads; FSDP2: unsharded grads kept
    # on the side) survives an offload with grads; the synced step after it matches the twin.
    for m in (a, b):
        _accumulate_without_sync(m, kind, rank)
    go.offload([a, oa], include_grads=True)
    assert _released(a, grads=True)
    go.reload([a, oa])
    for m, opt in ((a, oa), (b, ob)):
        if kind == "fsdp2":
            m.set_requires_gradient_sync(True)
        _step(m, opt, 20, rank)

    _assert_same(_full_params(a, kind), _full_params(b, kind), "full parameters")
    info = fsdp_adapter.fsdp_shard_info(a)
    assert info["world_size"] == world_size and info["rank"] == rank
    assert info == fsdp_adapter.fsdp_shard_info(b)
    return {"shard_bytes": shard_bytes, "full": full}


@pytest.mark.parametrize("kind", KINDS)
def test_single_rank(kind: str) -> None:
    (result,) = run_ranks(_check_rank, 1, kind)
    assert result["shard_bytes"] == result["full"]  # one rank holds everything (FSDP1: NO_SHARD)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks(kind: str) -> None:
    results = run_ranks(_check_rank, 2, kind)
    # Every rank holds an equal padded shard: about half the model each.
    assert results[0]["shard_bytes"] == results[1]["shard_bytes"]
    assert results[0]["shard_bytes"] < 0.6 * results[0]["full"]


def _check_mixed(rank: int, world_size: int) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard

    model = build_qwen2()
    model.model.layers[0] = FSDP(model.model.layers[0], device_id=torch.device("cpu"))
    fully_shard(model.model.layers[1])
    with pytest.raises(go.OffloadError, match="mixes"):
        go.snapshot(model)
    with pytest.raises(go.OffloadError):
        fsdp_adapter.fsdp_shard_info(model)


def test_mixed_fsdp1_and_fsdp2_is_rejected() -> None:
    run_ranks(_check_mixed, 1)


def test_plain_module_is_not_fsdp() -> None:
    model = build_qwen2()
    assert not fsdp_adapter.is_fsdp1(model) and not fsdp_adapter.is_fsdp2(model)
    with pytest.raises(go.OffloadError):
        fsdp_adapter.fsdp1_named_tensors(model, include_grads=False)
    with pytest.raises(go.OffloadError):
        fsdp_adapter.fsdp2_named_tensors(model, include_grads=False)


def _save_then_restore_elsewhere(rank: int, world_size: int, kind: str, directory: str, saved_world: int) -> str:
    """Each rank saves its shards; then a rank (or a world of another size) tries to restore another's."""
    model, _ = _make(kind, world_size)
    path = f"{directory}/{kind}-w{world_size}-r{rank}.safetensors"
    with go.snapshot(model) as snap:
        go.save(snap, path)
    dist.barrier()
    if world_size == saved_world:
        other = f"{directory}/{kind}-w{world_size}-r{(rank + 1) % world_size}.safetensors"
    else:
        other = f"{directory}/{kind}-w{saved_world}-r0.safetensors"
    with go.load(other) as foreign:
        try:
            go.restore(model, foreign)
        except go.LayoutMismatchError as exc:
            return str(exc)
    return "restored"


@pytest.mark.parametrize("kind", ["fsdp1", "fsdp2"])
def test_restore_refuses_another_ranks_or_world_sizes_shards(kind: str, tmp_path) -> None:
    # Rank 1 restoring rank 0's file: same shapes, different shards. Must be refused before anything moves.
    for message in run_ranks(_save_then_restore_elsewhere, 2, kind, str(tmp_path), 2):
        assert "shard layout differs" in message and "rank" in message, message
    # A world-size-1 target restoring a world-size-2 shard file (saved above at rank 0).
    (message,) = run_ranks(_save_then_restore_elsewhere, 1, kind, str(tmp_path), 2)
    assert "differs" in message, message


def _check_forward_guard(rank: int, world_size: int, kind: str) -> None:
    model, opt = _make(kind, world_size)
    want = _probe(model)
    go.offload([model, opt])
    with pytest.raises(go.OffloadError, match=r"offloaded; call gpu_offload\.reload\(\)"):
        _probe(model)
    go.reload([model, opt])
    assert torch.equal(_probe(model), want)


@pytest.mark.parametrize("kind", KINDS)
def test_calling_an_offloaded_fsdp_model_says_to_reload(kind: str) -> None:
    run_ranks(_check_forward_guard, 1, kind)


# -- FSDP2: the traversal recorded, read again in one C++ pass while nothing it depends on changed ------------
def _walked(model: nn.Module, include_grads: bool) -> list[tuple[str, int]]:
    return [(n, id(t)) for n, t in fsdp_adapter.fsdp2_named_tensors(model, include_grads=include_grads)]


def _read(model: nn.Module, include_grads: bool) -> list[tuple[str, int]]:
    from gpu_offload.adapters import named_tensors

    return [(n, id(t)) for n, t in named_tensors(model, include_grads=include_grads)]


# What an FSDP2 model goes through between two reads of its tensors, one stage at a time (_enter_fsdp2_stage).
_FSDP2_STAGES = ("wrapped", "stepped", "no_grad forward", "backward", "buffer replaced", "no sync")


def _enter_fsdp2_stage(a: nn.Module, oa: torch.optim.Optimizer, stage: str, rank: int) -> None:
    if stage == "stepped":
        _step(a, oa, 0, rank)  # FSDP2 swapped every parameter out and back: the same objects again
    elif stage == "no_grad forward":
        _probe(a)  # the root group is left unsharded: read (as the walk does) after resharding it
        assert not fsdp_adapter._fsdp2_groups(a).__next__()[2].is_sharded
    elif stage == "backward":
        ids = batch(3, rank)
        lm_loss(a(ids), ids).backward()
    elif stage == "buffer replaced":  # (the names are the same, the buffer another tensor: read as it is)
        a.model.rotary_emb.register_buffer("inv_freq", a.model.rotary_emb.inv_freq.clone(), persistent=False)
    elif stage == "no sync":  # unsharded gradients on the side: the walk names them, a record defers to it
        _accumulate_without_sync(a, "fsdp2", rank)


def _check_fsdp2_record(rank: int, world_size: int) -> None:
    import gc
    import weakref

    from gpu_offload import adapters, torch_ext

    recorded = torch_ext.ext is not None and torch_ext.ext.MODULE_TREE
    a, oa = _make("fsdp2", world_size)
    for stage in _FSDP2_STAGES:
        _enter_fsdp2_stage(a, oa, stage, rank)
        for include_grads in (False, True):
            got = _read(a, include_grads)
            assert got == _walked(a, include_grads), (stage, include_grads)
        if stage == "no sync":
            assert any(n.endswith(".grad_unsharded") for n, _ in _read(a, True))
        elif recorded:
            # Served from the record: the same names list again, and no Python walk.
            from gpu_offload.adapters import named_tensors

            first = named_tensors(a)
            walk, fsdp_adapter._fsdp2_named = fsdp_adapter._fsdp2_named, None  # (a call would raise)
            try:
                assert named_tensors(a).names is first.names and a in adapters._fsdp2_trees, stage
                assert named_tensors(a, include_grads=True).names[:len(first.names)] == first.names
            finally:
                fsdp_adapter._fsdp2_named = walk
    a.set_requires_gradient_sync(True)
    if recorded:
        # The shard layout, asked at every plan miss, comes from the record while the FSDPParams and their padded
        # shards are the same (an offload leaves them so), and is read again once a shard is another tensor.
        info = adapters.shard_info(a)
        compute, fsdp_adapter.fsdp_shard_info = fsdp_adapter.fsdp_shard_info, None  # (a call would raise)
        try:
            assert adapters.shard_info(a) == info
            assert adapters.shard_info([a, oa]) is adapters.shard_info([a, oa])  # (its JSON made once, too)
            go.offload(a)
            go.reload(a)
            assert adapters.shard_info(a) == info
        finally:
            fsdp_adapter.fsdp_shard_info = compute
        fp = next(iter(fsdp_adapter._fsdp2_groups(a)))[2].fsdp_params[0]
        fp._sharded_param_data = fp._sharded_param_data.to(torch.float64)
        assert adapters.shard_info(a) != info and '"torch.float64"' in adapters.shard_info(a)
        del fp
    # The record keeps nothing of the model alive.
    ref = weakref.ref(a)
    del a, oa
    gc.collect()
    assert ref() is None


def test_an_fsdp2_models_recorded_traversal_reads_what_the_walk_reads() -> None:
    run_ranks(_check_fsdp2_record, 1)


# -- FSDP2 where no traversal is recorded (Python 3.13 and later): walked in C++ each call ------------------------
def _walk_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The helper without its recorded traversals, as on a Python whose dicts lack version tags (3.13 and
    later), where a module is walked in C++ each call (walk_module); monkeypatch turns them back on at the
    test's end. The switch reaches the checks because one rank runs in this process (run_ranks)."""
    if torch_ext.ext is None or not hasattr(torch_ext.ext, "walk_module"):
        pytest.skip(f"no module walk in the helper (gpu_offload._torch_ext {torch_ext.status()})")
    monkeypatch.setattr(torch_ext.ext, "MODULE_TREE", False)
    if hasattr(torch_ext.ext, "OPTIMIZER_TREE"):
        monkeypatch.setattr(torch_ext.ext, "OPTIMIZER_TREE", False)


def _check_rank_walked(rank: int, world_size: int) -> dict[str, int]:
    from gpu_offload import adapters

    result = _check_rank(rank, world_size, "fsdp2")
    assert len(adapters._walked_fsdp2) > 0, "the FSDP2 models were walked in Python"
    return result


def test_single_rank_fsdp2_walked_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every check of a rank (snapshots, restores, MIS, offload and reload with gradients, a twin) with the
    # FSDP2 models walked in C++ each call, as on Python 3.13.
    _walk_each_call(monkeypatch)
    (result,) = run_ranks(_check_rank_walked, 1)
    assert result["shard_bytes"] == result["full"]


def _check_fsdp2_walk(rank: int, world_size: int) -> None:
    from gpu_offload import adapters
    from gpu_offload.adapters import named_tensors

    a, oa = _make("fsdp2", world_size)
    for stage in _FSDP2_STAGES:
        _enter_fsdp2_stage(a, oa, stage, rank)
        for include_grads in (False, True):
            assert _read(a, include_grads) == _walked(a, include_grads), (stage, include_grads)
        assert a in adapters._walked_fsdp2, stage
        # The next call walks nothing in Python (neither FSDP2's walk nor its scan of the modules), answers the
        # same names list, and reshards an idle group first, as that walk does.
        first = named_tensors(a)
        if stage == "no_grad forward":
            _probe(a)
        walk, scan = fsdp_adapter._fsdp2_named, fsdp_adapter._fsdp2_scan
        fsdp_adapter._fsdp2_named = fsdp_adapter._fsdp2_scan = None  # (a call would raise)
        try:
            again = named_tensors(a)
        finally:
            fsdp_adapter._fsdp2_named, fsdp_adapter._fsdp2_scan = walk, scan
        assert again.names is first.names, stage
        assert [id(t) for t in again.tensors] == [id(t) for _, t in fsdp_adapter.fsdp2_named_tensors(
            a, include_grads=False)], stage
    a.set_requires_gradient_sync(True)
    # A managed parameter replaced under the same name: the walk's names are the same list, its parameters
    # not the same objects, and it is named as FSDP2's walk names it (which refuses it), not from what was kept.
    layer = a.model.layers[0].mlp.up_proj
    layer.weight = nn.Parameter(torch.zeros(layer.weight.shape))
    with pytest.raises(go.OffloadError, match="not registered"):
        named_tensors(a)
    with pytest.raises(go.OffloadError, match="not registered"):
        fsdp_adapter.fsdp2_named_tensors(a, include_grads=False)


def test_an_fsdp2_model_walked_each_call_reads_what_the_python_walk_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    _walk_each_call(monkeypatch)
    run_ranks(_check_fsdp2_walk, 1)


def _check_fsdp2_walk_reshards_a_group_it_did_not_keep(rank: int, world_size: int) -> None:
    from gpu_offload import adapters

    a, _ = _make("fsdp2", world_size)
    assert _read(a, False) == _walked(a, False)
    groups = list(fsdp_adapter._fsdp2_groups(a))
    kept = adapters._walked_fsdp2[a]
    assert len(kept[0][0]) == len(groups) > 1
    # What the walk kept holds every group but the root's (as when the model's groups changed since), and a
    # no_grad forward leaves the root's unsharded: the kept groups' reshard before the walk leaves it so, the
    # walk meets its unsharded parameters, and FSDP2's checks then reshard it. The walk must run again after
    # that (the tensors it met are not the ones to name), and its record be made again, of every group.
    adapters._walked_fsdp2[a] = (fsdp_adapter.group_refs(a, groups[1:]), kept[1], kept[2])
    _probe(a)
    assert groups[0][1] is a and not groups[0][2].is_sharded
    assert _read(a, False) == _walked(a, False)
    assert len(adapters._walked_fsdp2[a][0][0]) == len(groups), "not walked again after the reshard"


def test_an_fsdp2_model_walked_each_call_walks_again_after_resharding_a_group_it_did_not_keep(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _walk_each_call(monkeypatch)
    run_ranks(_check_fsdp2_walk_reshards_a_group_it_did_not_keep, 1)


def test_an_fsdp2_model_walked_each_call_names_ignored_parameters_as_the_python_walk_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _walk_each_call(monkeypatch)
    run_ranks(_check_fsdp2_params_no_group_manages, 1)


def _check_fsdp2_first_record(rank: int, world_size: int) -> None:
    import json

    from gpu_offload import adapters, torch_ext

    if torch_ext.ext is None or not torch_ext.ext.MODULE_TREE:
        return
    a, _ = _make("fsdp2", world_size)
    _probe(a)  # a no_grad forward leaves the root group unsharded: the first record reshards it
    assert not fsdp_adapter._fsdp2_groups(a).__next__()[2].is_sharded
    adapters._fsdp2_trees.clear()
    # The first record walks nothing in Python: its groups and paths come from the C++ traversal, and its
    # shard layout from those.
    walk, info_walk, scan = fsdp_adapter._fsdp2_named, fsdp_adapter.fsdp_shard_info, fsdp_adapter._fsdp2_scan

    def scan_given(module: nn.Module, paths: object = None, named_modules: object = None) -> object:
        assert named_modules is not None, "walked in Python"
        return scan(module, paths, named_modules)

    fsdp_adapter._fsdp2_named = fsdp_adapter.fsdp_shard_info = None  # (a call would raise)
    fsdp_adapter._fsdp2_scan = scan_given
    try:
        got = _read(a, False)
        text = adapters.shard_info(a)
    finally:
        fsdp_adapter._fsdp2_named, fsdp_adapter.fsdp_shard_info, fsdp_adapter._fsdp2_scan = walk, info_walk, scan
    assert a in adapters._fsdp2_trees and fsdp_adapter._fsdp2_groups(a).__next__()[2].is_sharded
    assert "paths" not in adapters._fsdp2_trees[a][4]  # (dropped once the layout is made)
    assert got == _walked(a, False)
    # The same text as json.dumps of the walk's info (a layout compares it as text, files keep it).
    walked = fsdp_adapter.fsdp_shard_info(a)
    assert text == json.dumps({"0": walked}, sort_keys=True, default=str)
    assert fsdp_adapter.shard_info_json(walked) == json.dumps(walked, sort_keys=True, default=str)
    layouts = {id(v) for v in walked["params"].values()}
    assert len(layouts) < len(walked["params"])  # (parameters of one layout share its dict)


def test_an_fsdp2_models_first_record_walks_nothing_in_python_and_reads_what_the_walk_reads() -> None:
    run_ranks(_check_fsdp2_first_record, 1)


def _check_fsdp2_first_call_collects_nothing(rank: int, world_size: int) -> None:
    # A first call that keeps an object per parameter alive (a list of pairs, say) makes the garbage collector
    # run during it, and a pass of the oldest generation over a whole model's objects takes seconds: FSDP2's
    # did (1.3-2.2 s of a 2.9 s first snapshot of 65536 experts). Its first record, shard layout and JSON now
    # make a bounded number of such objects, however many parameters (counted from a fresh collection).
    import gc

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gpu_offload import adapters, plan, torch_ext

    mesh = init_device_mesh("cpu", (world_size,))
    blocks = nn.ModuleList(nn.Sequential(*(nn.Linear(2, 2, bias=False) for _ in range(256))) for _ in range(16))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    model = fully_shard(nn.Sequential(*blocks), mesh=mesh)
    passes: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            passes.append(info["generation"])

    arena = go.Arena(1 << 20)
    for first in (True, False):
        if first:
            plan.clear_cache()
            adapters._fsdp2_trees.clear()
        gc.collect()
        gc.callbacks.append(count)
        try:
            go.snapshot(model, arena=arena).wait().free()
            go.offload(model, arena=arena)
            go.reload(model)
        finally:
            gc.callbacks.remove(count)
        if torch_ext.ext is not None and torch_ext.ext.MODULE_TREE:  # (the Python walk makes pairs)
            assert passes == [], (first, passes)
    assert len(adapters.named_tensors(model)) == 16 * 256


def test_an_fsdp2_models_first_call_keeps_no_object_per_parameter_alive() -> None:
    run_ranks(_check_fsdp2_first_call_collects_nothing, 1)


def _check_fsdp2_params_no_group_manages(rank: int, world_size: int) -> None:
    # Parameters fully_shard was told to ignore are named after the managed ones, as the walk names them: a
    # record whose traversal lists one before a managed one reads otherwise, and is not kept (every call
    # walks); one listing them last reads the same, and is kept. Both read what the walk reads, snapshot and
    # cycle through offload and reload with their bytes.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gpu_offload import adapters, torch_ext

    recorded = torch_ext.ext is not None and torch_ext.ext.MODULE_TREE
    mesh = init_device_mesh("cpu", (world_size,))
    for first in (True, False):
        torch.manual_seed(0)
        model = nn.Module()
        model.body = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        model.tail = nn.Module()
        # (A module's own parameters come before its children's: the root's first, the last child's last.)
        owner = model if first else model.tail
        owner.register_parameter("ignored", nn.Parameter(torch.randn(3)))
        fully_shard(model.body[0], mesh=mesh)
        fully_shard(model, mesh=mesh, ignored_params={owner.ignored})
        adapters._fsdp2_trees.clear()
        walked = _walked(model, False)
        name = "ignored" if first else "tail.ignored"
        assert [n for n, _ in walked][-1] == name, walked
        assert [n for n, _ in model.named_parameters()].index(name) == (0 if first else 4)
        assert _read(model, False) == walked
        if recorded:
            assert (model in adapters._fsdp2_trees) is (not first), first
        want = {n: _local(t).detach().clone() for n, t in fsdp_adapter.fsdp2_named_tensors(model, include_grads=False)}
        snap = go.snapshot(model).wait()
        assert all(torch.equal(_local(t), want[n]) for n, t in snap.tensors().items())
        snap.free()
        go.offload(model)
        go.reload(model)
        for n, t in fsdp_adapter.fsdp2_named_tensors(model, include_grads=False):
            assert torch.equal(_local(t), want[n]), n


def test_an_fsdp2_models_ignored_parameters_are_named_as_the_walk_names_them() -> None:
    run_ranks(_check_fsdp2_params_no_group_manages, 1)


def test_shard_info_json_is_json_dumps_sorted(checks: str) -> None:
    import json

    layout = {"global_shape": [2, 3], "padded_local_shape": [2, 3], "placements": ["Shard(dim=0)"],
              "dtype": "torch.float32"}
    other = dict(layout, dtype="torch.bfloat16", placements=["Replicate()", 'Odd"\\'])
    infos = [
        {"kind": "fsdp2", "world_size": 2, "rank": 1,
         "params": {"b.weight": layout, "a.é.深": other, "a.weight": layout, "z\n\"q": other, "": layout}},
        {"kind": "fsdp2", "world_size": 1, "rank": 0, "params": {}},
        # (printable ASCII names alone: the helper's own join, byte order with prefixes first)
        {"kind": "fsdp2", "world_size": 4, "rank": 3,
         "params": {"a.b": layout, "a": other, "a0": layout, "A": other, "a b": layout, "~": dict(layout),
                    "a.b.c": other, "-": layout}},
        {"kind": "fsdp2", "params": {"del\x7f": layout, "tab\t": other, "ok": layout}},
        {"kind": "fsdp2", "params": {"x": {"nested": {"b": 1, "a": [1.5, None, True]}}}, "extra": object()},
        {"kind": "fsdp1", "world_size": 1, "rank": 0, "flat_params": {"": {"padding": 0}}},
        {"kind": "fsdp2", "params": {1: layout}},  # (keys not str: json.dumps decides, as before)
        {"kind": "fsdp2", "params": "not a dict"},
    ]
    for info in infos:
        try:
            want = json.dumps(info, sort_keys=True, default=str)
        except TypeError:
            with pytest.raises(TypeError):
                fsdp_adapter.shard_info_json(info)
            continue
        assert fsdp_adapter.shard_info_json(info) == want


def test_the_helpers_json_join_is_json_dumps_or_declines() -> None:
    import json
    import random

    ext = torch_ext.ext
    if ext is None:
        pytest.skip(f"gpu_offload._torch_ext {torch_ext.status()}")
    rng = random.Random(0)
    values = [{"v": i, "s": [i, "x"]} for i in range(5)]
    alphabet = "ab.0_-A~ Z[]{}"
    mapping = {"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))): rng.choice(values)
               for _ in range(2000)}
    asked: list[int] = []

    def text_of(value: object) -> str:
        asked.append(id(value))
        return json.dumps(value, sort_keys=True)

    assert ext.json_object_of_texts(mapping, text_of) == json.dumps(mapping, sort_keys=True)
    assert sorted(asked) == sorted(set(asked)) and len(asked) == len({id(v) for v in mapping.values()})
    assert ext.json_object_of_texts({}, text_of) == "{}"
    # A model's names: long shared prefixes, names that are prefixes of others, runs of one name's
    # neighbours, in traversal order (the helper's radix sort partitions byte by byte).
    model = {f"blocks.{b}.experts.{e}.{w}": values[(b + e) % 5] for b in range(40) for e in range(60)
             for w in ("weight", "weight_scale", "w")}
    model.update({"blocks": values[0], "blocks.1": values[1], "blocks.1.": values[2], "": values[3]})
    shuffled = dict(rng.sample(sorted(model.items()), len(model)))
    for names in (model, shuffled, dict(sorted(model.items())), dict(sorted(model.items(), reverse=True))):
        assert ext.json_object_of_texts(names, text_of) == json.dumps(names, sort_keys=True)
    # Names json.dumps escapes, keys that are not str, a text that is not one: declined (None), for Python.
    for bad in ('q"', "b\\", "c\n", "d\x7f", "é", "\x00"):
        assert ext.json_object_of_texts({"ok": 1, bad: 2}, lambda v: "1") is None
    assert ext.json_object_of_texts({1: 2}, lambda v: "1") is None
    assert ext.json_object_of_texts({"a": 1}, lambda v: 1) is None
    assert ext.json_object_of_texts({"a": 1}, lambda v: "é") is None
    assert ext.json_object_of_texts([("a", 1)], lambda v: "1") is None
    with pytest.raises(ZeroDivisionError):
        ext.json_object_of_texts({"a": 1}, lambda v: 1 / 0)


def test_the_helpers_placements_compare_as_python_does() -> None:
    """fsdp2_layouts groups parameters by their placements (==): Shard and Replicate pairs compared on the C++
    objects where this build has torch's placement classes, every other pair through ==, the answer Python's."""
    import itertools

    ext = torch_ext.ext
    if ext is None:
        pytest.skip(f"gpu_offload._torch_ext {torch_ext.status()}")
    placement_types = pytest.importorskip("torch.distributed.tensor.placement_types")
    Shard, Replicate, Partial = placement_types.Shard, placement_types.Replicate, placement_types.Partial

    class Sub(Shard):  # (a subclass whose == is its own: never compared as the C++ class)
        def __eq__(self, other: object) -> bool:
            return isinstance(other, Sub)

        __hash__ = Shard.__hash__

    made = [lambda: (Shard(0),), lambda: (Shard(1),), lambda: (Replicate(),), lambda: (Replicate(), Shard(0)),
            lambda: (Replicate(), Shard(1)), lambda: (Shard(0), Shard(0)), lambda: (Partial(),),
            lambda: (Partial("avg"),), lambda: (Sub(0),), lambda: (Sub(1),), lambda: (), lambda: [Shard(0)]]
    strided = getattr(placement_types, "_StridedShard", None)
    if strided is not None:
        made += [lambda: (strided(0, split_factor=2),), lambda: (strided(0, split_factor=3),)]
    known = 0
    for a, b in itertools.product(made, repeat=2):
        x, y = a(), b()  # (objects of their own, as every FSDPParam has: no pair is the same object)
        equal, num_known = ext.placements_equal(x, y)
        assert equal == (x == y), (x, y)
        known += num_known
        assert ext.placements_equal(x, x) == (True, 0)  # (the same tuple: equal, nothing compared)
    # (Where torch binds Shard and Replicate in C++ with their == and this build has its headers, their pairs
    # are compared without Python; a build that should but does not is a silent slowdown, failed here.)
    compared_in_cpp = ext.CPP_PLACEMENTS and "__eq__" not in vars(Shard) and "__eq__" not in vars(Replicate)
    assert (known > 0) == bool(compared_in_cpp), (known, ext.CPP_PLACEMENTS)
    with pytest.raises(ZeroDivisionError):  # (an == that raises: raised)
        class Bad(Shard):
            def __eq__(self, other: object) -> bool:
                raise ZeroDivisionError

            __hash__ = Shard.__hash__

        ext.placements_equal((Bad(0),), (Bad(0),))


# -- DTensor targets: their plans are of the local tensors, and valid only for the very same DTensors --------
def _check_dtensor_plans(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from gpu_offload import plan, torch_ext

    mesh = init_device_mesh("cpu", (world_size,))
    local = torch.arange(8, dtype=torch.float32)
    sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    local = sharded._local_tensor  # (a view of the one given)
    replicated = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
    replicated._local_tensor = local  # one local tensor, two wrappers
    first = {"w": sharded}
    with go.snapshot(first) as snap:
        assert snap.state_dict()["w"].placements == (Shard(0),)
    hits = plan.cache_info()["hits"]
    with go.snapshot(first) as snap:  # a hit, checked in C++ over the local tensors where the helper is loaded
        assert snap.state_dict()["w"].placements == (Shard(0),)
    assert plan.cache_info()["hits"] == hits + 1
    if torch_ext.ext is not None:
        assert plan.lookup(["w"], [sharded]).record is not None
    # Another wrapper of the same local tensor, then the local tensor itself: neither is served the first plan.
    with go.snapshot({"w": replicated}) as snap:
        assert snap.state_dict()["w"].placements == (Replicate(),)
    with go.snapshot({"w": replicated._local_tensor}) as snap:
        assert type(snap.state_dict()["w"]) is torch.Tensor
    # Through the plan: restore, offload and reload of the DTensor target move its local tensor's bytes.
    with go.snapshot(first) as snap:
        with torch.no_grad():
            local.fill_(-1)
        go.restore(first, snap)
        assert torch.equal(sharded._local_tensor, torch.arange(8, dtype=torch.float32))
    go.offload(first)
    assert sharded._local_tensor.untyped_storage().nbytes() == 0
    go.reload(first)
    assert torch.equal(sharded._local_tensor, torch.arange(8, dtype=torch.float32))


def test_dtensor_plans_are_of_their_local_tensors_and_of_those_very_dtensors() -> None:
    run_ranks(_check_dtensor_plans, 1)


# -- FSDP2 record under two threads: one offloads and reloads, the other snapshots and restores ------------
def _check_fsdp2_record_two_threads(rank: int, world_size: int) -> None:
    import threading
    import time

    a, _ = _make("fsdp2", world_size)
    expected = {n: _local(t).clone() for n, t in fsdp_adapter.fsdp2_named_tensors(a, include_grads=False)}
    stop, errors = threading.Event(), []

    def churn() -> None:
        try:
            while not stop.is_set():
                go.offload(a)
                go.reload(a)
                time.sleep(0.005)  # (a moment live: the other thread's calls land on both states)
        except BaseException as exc:  # (reported by the main thread)
            errors.append(exc)

    worker = threading.Thread(target=churn)
    worker.start()
    served = refused = 0
    try:
        # Until 20 were served (how the calls fall between the two threads is the scheduler's: on a loaded
        # machine most land while the model is offloaded).
        for _ in range(2000):
            if served >= 20:
                break
            try:
                with go.snapshot(a) as snap:
                    got = snap.tensors()
                    assert all(torch.equal(got[n], expected[n]) for n in expected)  # never a stale or torn copy
                    go.restore(a, snap)
                served += 1
            except go.OffloadError as exc:  # offloaded by the other thread at that moment: refused, named
                assert "offloaded" in str(exc) or "released" in str(exc), exc
                refused += 1
    finally:
        stop.set()
        worker.join()
    assert not errors, errors
    assert served > 0, (served, refused)  # (how many were refused depends on the scheduling: none is fine)
    assert _read(a, False) == _walked(a, False) and _read(a, True) == _walked(a, True)
    for n, t in fsdp_adapter.fsdp2_named_tensors(a, include_grads=False):
        assert torch.equal(_local(t), expected[n]), n


def test_an_fsdp2_models_record_holds_under_two_threads() -> None:
    run_ranks(_check_fsdp2_record_two_threads, 1)


# -- A recorded plain module's shard layout: no FSDP walk while its record holds, FSDP seen once applied ------
def _check_recorded_module_strategy(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gpu_offload import adapters, torch_ext

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    walked: list[nn.Module] = []
    contains = fsdp_adapter._contains
    fsdp_adapter._contains = lambda module, cls: walked.append(module) or contains(module, cls)
    try:
        adapters.named_tensors(model)  # (recorded where the helper is loaded)
        walked.clear()
        assert adapters.shard_info(model) is None
        if torch_ext.ext is not None and torch_ext.ext.MODULE_TREE:
            assert not walked  # (FSDP is imported: its recognizers would walk every submodule)
        mesh = init_device_mesh("cpu", (world_size,))
        fully_shard(model[0], mesh=mesh)  # a submodule's class changes: the record no longer holds
        info = adapters.shard_info(model)
        assert info is not None and '"fsdp2"' in info, info
    finally:
        fsdp_adapter._contains = contains


def test_a_recorded_modules_shard_layout_needs_no_fsdp_walk_and_sees_fully_shard() -> None:
    run_ranks(_check_recorded_module_strategy, 1)


# -- The helper's per-parameter reads of FSDPParams (fsdp2_params.cpp) -------------------------------------
def _check_fsdp2_layouts_read_what_python_reads(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import struct

    from torch.distributed.tensor import Shard

    ext = torch_ext.ext
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = nn.Module()
    model.scale = nn.Parameter(torch.ones(7))  # (the root's own: named without a path)
    model.a = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3, bias=False))
    model.b = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 5)).to(torch.bfloat16)
    model.c = nn.Linear(8, 6)
    model.d = nn.Linear(8, 6)
    fully_shard(model.a, mesh=mesh)
    fully_shard(model.b, mesh=mesh)
    # Another placement for 2-D parameters: c.weight and d.weight, equal in shape and dtype, are told apart by
    # their placements alone.
    fully_shard(model.c, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    fully_shard(model.d, mesh=mesh)
    fully_shard(model, mesh=mesh)
    paths: dict[int, str] = {}
    _, groups = fsdp_adapter._fsdp2_scan(model, paths)
    fps = [fp for _, _, group in groups for fp in group.fsdp_params]
    python = fsdp_adapter._fsdp2_shard_info(fps, paths)
    assert {"scale", "a.0.weight", "a.1.weight", "b.1.weight", "c.weight", "c.bias"} <= python["params"].keys()
    assert python["params"]["c.weight"]["placements"] != python["params"]["a.0.weight"]["placements"]
    c, d = python["params"]["c.weight"], python["params"]["d.weight"]
    assert c["placements"] != d["placements"] and {**c, "placements": None} == {**d, "placements": None}
    assert python["params"]["b.1.weight"]["dtype"] == "torch.bfloat16"
    names, modules = [n for n, _ in model.named_modules()], [m for _, m in model.named_modules()]
    ids = struct.pack(f"{len(modules)}N", *map(id, modules))  # (what the helper's object_ids gives)
    assert ext is None or ext.object_ids(modules) == ids
    for given in (paths, (ids, names)):
        info, shards = fsdp_adapter.fsdp2_shard_info_and_shards(fps, given)
        assert info == python, given
        if ext is not None and ext.MODULE_TREE:  # (the helper reads FSDPParams where it reads module dicts: 3.11/3.12)
            assert shards is not None and all(s is fp._sharded_param_data for s, fp in zip(shards, fps))
            got = ext.fsdp2_layouts(fps, given)
            layouts = [got[1][i] for i in range(len(fps))]
            assert len(set(layouts)) == len({id(v) for v in python["params"].values()})  # (one dict per layout)
    # A module reached twice is named by its first path (as named_modules() names it), whichever comes first.
    again = struct.pack("N", id(model.c))
    for given in ((ids + again, names + ["elsewhere"]), (again + ids, ["elsewhere"] + names)):
        info, _ = fsdp_adapter.fsdp2_shard_info_and_shards(fps, given)
        assert info == fsdp_adapter._fsdp2_shard_info(fps, fsdp_adapter._paths_dict(given))
        assert ("elsewhere.weight" in info["params"]) == given[1][0].startswith("elsewhere")
    # A module the paths do not know is named "?", as in Python.
    partial = {k: v for k, v in paths.items() if k != id(model.c)}
    assert fsdp_adapter.fsdp2_shard_info(groups, partial) == fsdp_adapter._fsdp2_shard_info(fps, partial)
    assert "?.weight" in fsdp_adapter.fsdp2_shard_info(groups, partial)["params"]


def test_the_helpers_fsdp2_layouts_read_what_python_reads() -> None:
    run_ranks(_check_fsdp2_layouts_read_what_python_reads, 1)


# The helper, on a CPython whose instance layout its FSDPParam reads were measured on (3.11, 3.12: elsewhere
# fsdp2_layouts answers None and Python reads them).
_needs_fsdp2_layouts = pytest.mark.skipif(
    torch_ext.ext is None or torch_ext.ext.fsdp2_layouts([], {}) is None,
    reason=f"gpu_offload._torch_ext {torch_ext.status()}, or a CPython other than 3.11 and 3.12")


class _Mesh:
    def size(self) -> int:
        return 2

    def get_rank(self) -> int:
        return 1


class _Plain:  # (a plain object: its attributes in its own dict, no class attribute of theirs)
    def __init__(self, **kw: object) -> None:
        self.__dict__.update(kw)


class _Placement:
    def __init__(self, dim: int, on_eq: object = None) -> None:
        self.dim, self.on_eq = dim, on_eq

    def __eq__(self, other: object) -> bool:
        if self.on_eq is not None:
            self.on_eq()  # type: ignore[operator]
        return isinstance(other, _Placement) and other.dim == self.dim

    def __hash__(self) -> int:
        return hash(self.dim)

    def __str__(self) -> str:
        return f"P({self.dim})"


def _fake_params(count: int, cls: type = _Plain, module: object = None, **over: object) -> list[object]:
    """FSDPParam-like objects with what fsdp2_shard_info reads: a module info, a spec, shapes, a shard, a mesh."""
    module = module if module is not None else nn.Linear(1, 1)
    mesh_info = _Plain(mesh=_Mesh())
    out = []
    for i in range(count):
        attrs = dict(_module_info=_Plain(module=module, param_name=f"p{i}"),
                     _sharding_spec=_Plain(placements=(_Placement(i % 2),)),
                     _orig_size=torch.Size([4, i % 3 + 1]), padded_sharded_param_size=torch.Size([2, i % 3 + 1]),
                     _sharded_param_data=torch.zeros(2 * (i % 3 + 1), dtype=torch.float16 if i % 5 else torch.float32),
                     mesh_info=mesh_info)
        attrs.update(over)
        fp = cls.__new__(cls)
        fp.__dict__.update(attrs)
        out.append(fp)
    return out


@_needs_fsdp2_layouts
def test_the_helpers_fsdp2_layouts_decline_what_is_not_a_plain_read_and_match_python_otherwise() -> None:
    ext = torch_ext.ext
    module = nn.Linear(1, 1)
    paths = {id(module): "blocks.3"}
    fps = _fake_params(40, module=module)
    # Many layouts (shapes x dtypes x placements), named "blocks.3.p<i>": as Python groups and names them.
    groups = [("", None, _Plain(fsdp_params=fps))]
    python = fsdp_adapter._fsdp2_shard_info(fps, paths)
    assert fsdp_adapter.fsdp2_shard_info(groups, paths) == python
    got = ext.fsdp2_layouts(fps, paths)
    assert got is not None and got[0] == [f"blocks.3.p{i}" for i in range(40)]
    assert len(got[2]) == len({id(v) for v in python["params"].values()}) == 12  # (3 shapes, 2 dtypes, 2 placements)
    # A name given twice: the dict's last value for it, world and rank from the mesh it was last given with.
    twice = _fake_params(3, module=module, _module_info=_Plain(module=module, param_name="same"))
    assert fsdp_adapter.fsdp2_shard_info([("", None, _Plain(fsdp_params=twice))], paths) == (
        fsdp_adapter._fsdp2_shard_info(twice, paths))

    class Shadowed(_Plain):  # a class attribute (a property) of a read name: its code is not run, None
        @property
        def _orig_size(self) -> torch.Size:
            raise AssertionError("run")

    class Dynamic(_Plain):  # its own attribute lookup: None
        def __getattr__(self, name: str) -> object:
            raise AttributeError(name)

    class Sub(torch.Tensor):
        pass

    declined = [
        _fake_params(3, cls=Shadowed),
        _fake_params(3, cls=Dynamic),
        _fake_params(3, _module_info=_Plain(module=module, param_name=7)),
        _fake_params(3, _sharded_param_data=torch.zeros(2).as_subclass(Sub)),
        _fake_params(3, _orig_size=[4, 1]),
        _fake_params(3, _sharding_spec=_Plain(placements=[_Placement(0)])),
        _fake_params(2) + [_Plain()],  # (one without the attributes)
    ]
    for bad in declined:
        assert ext.fsdp2_layouts(bad, paths) is None
    # (Where Python reads them, fsdp2_shard_info answers what it reads.)
    for bad in declined[2:4]:
        assert fsdp_adapter.fsdp2_shard_info([("", None, _Plain(fsdp_params=bad))], paths) == (
            fsdp_adapter._fsdp2_shard_info(bad, paths))
    assert ext.fsdp2_layouts([], paths) == ([], [], [], [])
    assert ext.fsdp2_layouts(fps, {"x": "y"}) is None and ext.fsdp2_layouts(fps, (b"123", ["a"])) is None
    with pytest.raises(TypeError):
        ext.fsdp2_layouts(tuple(fps), paths)


@_needs_fsdp2_layouts
def test_the_helpers_fsdp2_layouts_survive_placements_whose_eq_changes_everything() -> None:
    # The layouts are grouped after every read, comparing placements with ==, which may run any Python: here it
    # strips every parameter of its attributes and empties the list being read. What the grouping uses is held
    # or copied: no crash, the answer is of the parameters as they were read.
    ext = torch_ext.ext
    module = nn.Linear(1, 1)
    fps: list[object] = []

    def vandal() -> None:
        for fp in list(fps):
            fp.__dict__.clear()
        fps.clear()

    def placed(params: list[object], on_eq: object) -> list[object]:  # (each its own placements: compared)
        for fp in params:
            fp._sharding_spec = _Plain(placements=(_Placement(0, on_eq),))
        return params

    fps += placed(_fake_params(8, module=module), vandal)
    got = ext.fsdp2_layouts(fps, {id(module): "m"})
    assert got is not None and got[0] == [f"m.p{i}" for i in range(8)]
    assert fps == [] and len(got[3]) == 8 and all(isinstance(t, torch.Tensor) for t in got[3])

    def boom() -> None:
        raise ValueError("placement compared")

    with pytest.raises(ValueError, match="placement compared"):
        ext.fsdp2_layouts(placed(_fake_params(6, module=module), boom), {})  # (1 and 4: one shape and dtype)
