"""gpu_offload.checkpoint.ArenaStager and Snapshot.state_dict() with torch.distributed.checkpoint.

FSDP2 on 2 gloo ranks: an async save staged through the arena while training goes on, loaded into fresh
models on 2 ranks and on 1, bitwise; get_state_dict/set_state_dict round trips; the arena flat over many
saves; errors before anything is written. CUDA-marked tests run where a GPU answers.
"""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import gpu_offload as go

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

if dist.is_available():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from gpu_offload.checkpoint import ArenaStager

from conftest import bits
from cuda_gates import engine_stream, hold, recorded, settle
import conftest
from conftest import bits, every_interrupt
from helpers_dist import batch, build_qwen2, lm_loss, run_ranks

_MIB = 1 << 20


# ------------------------------------------------------------------------------------------ helpers


class GatedWriter(FileSystemWriter if dist.is_available() else object):  # type: ignore[misc]
    """Writes only once `gate` is set: the training step that runs meanwhile is sure to come first, so a
    stager that handed DCP the live tensors (not a copy) would write the later values."""

    def __init__(self, path: str, gate: threading.Event) -> None:
        super().__init__(path)
        self.gate = gate

    def write_data(self, plan: Any, planner: Any) -> Any:
        assert self.gate.wait(60), "the gate was never opened"
        return super().write_data(plan, planner)


class FailingWriter(FileSystemWriter if dist.is_available() else object):  # type: ignore[misc]
    def write_data(self, plan: Any, planner: Any) -> Any:
        raise OSError(28, "No space left on device (injected)")


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _clone_tree(obj: Any) -> Any:
    """A deep copy whose tensors are plain clones of the local data (DTensor -> its local shard)."""
    if isinstance(obj, torch.Tensor):
        return _local(obj).detach().clone()
    if isinstance(obj, dict):
        return {k: _clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone_tree(v) for v in obj)
    return obj


def _assert_tree_equal(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = _local(a), _local(b)
        assert a.shape == b.shape and a.dtype == b.dtype, (path, a.shape, b.shape, a.dtype, b.dtype)
        assert torch.equal(bits(a), bits(b)), f"{path} differs"
        return
    if isinstance(a, dict):
        assert set(a) == set(b), (path, set(a) ^ set(b))
        for k in a:
            _assert_tree_equal(a[k], b[k], f"{path}.{k}")
        return
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_tree_equal(x, y, f"{path}.{i}")
        return
    assert a == b, (path, a, b)


def _full(sd: Any) -> Any:
    """The state dict with every DTensor gathered to a full tensor (a collective)."""
    if hasattr(sd, "full_tensor"):
        return sd.full_tensor().detach().clone()
    if isinstance(sd, torch.Tensor):
        return sd.detach().clone()
    if isinstance(sd, dict):
        return {k: _full(v) for k, v in sd.items()}
    if isinstance(sd, (list, tuple)):
        return type(sd)(_full(v) for v in sd)
    return sd


def _fsdp2(world_size: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build_qwen2(seed=seed)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    ids = batch(step, rank)
    lm_loss(model(ids), ids).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _load_into(model: torch.nn.Module, opt: torch.optim.Optimizer, path: str, pg: Any = None) -> dict[str, Any]:
    """dcp.load into a model and optimizer (through get/set_state_dict); returns their state dicts after."""
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path, process_group=pg)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


# ------------------------------------------------------------------------------------------ FSDP2, 2 ranks


def _fsdp2_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model, opt = _fsdp2(world_size, seed=0)
    _step(model, opt, 0, rank)  # AdamW has state
    # Checkpoint collectives run in the write thread beside training's: a group of their own.
    ckpt_pg = dist.new_group(backend="gloo")
    arena = go.Arena(min_slab_bytes=4 * _MIB)
    out: dict[str, Any] = {}

    msd, osd = get_state_dict(model, opt)
    at_call = _full({"model": msd, "optim": osd})  # gathered before the save (a collective)
    local_at_call = _clone_tree({"model": msd, "optim": osd})
    gate = threading.Event()
    with ArenaStager(arena) as stager:
        fut = dcp.async_save({"model": msd, "optim": osd}, storage_writer=GatedWriter(f"{root}/async", gate),
                             async_stager=stager, process_group=ckpt_pg)
        out["staged_bytes"] = stager.staged_bytes
        _step(model, opt, 1, rank)  # while the write waits: training goes on
        gate.set()
        fut.result()
    msd_after, osd_after = get_state_dict(model, opt)
    out["changed_by_step"] = not torch.equal(_local(msd_after["model.norm.weight"]),
                                             local_at_call["model"]["model.norm.weight"])

    # Snapshot.state_dict(): a snapshot taken now is saved after another step.
    snap_sd = {"model": msd_after, "optim": osd_after}
    snap_full = _full(snap_sd)
    snap = go.snapshot(snap_sd, arena=arena)
    _step(model, opt, 2, rank)
    staged = snap.state_dict()
    # Back into the state dict's nesting (names are "model.<fqn>" and "optim.state.<fqn>.<key>"); the
    # optimizer's param_groups hold no tensors and come from the source.
    nested = {"model": {fqn: staged[f"model.{fqn}"] for fqn in msd_after},
              "optim": {"state": {fqn: {key: staged[f"optim.state.{fqn}.{key}"] if isinstance(v, torch.Tensor) else v
                                        for key, v in state.items()}
                                  for fqn, state in osd_after["state"].items()},
                        "param_groups": osd_after["param_groups"]}}
    out["snapshot_dtensors"] = sum(1 for v in staged.values() if hasattr(v, "to_local"))
    out["snapshot_all_host"] = all(_local(v).device.type == "cpu" for v in staged.values())
    dcp.save(nested, checkpoint_id=f"{root}/snapshot", process_group=ckpt_pg)
    snap.free()

    # A snapshot of the module itself (not of its state dict): its parameters are DTensors under their own
    # names, each rank's host shard a view of its padded local storage. Saved after another step.
    module_snap = go.snapshot(model, arena=arena)
    module_full = _full(dict(model.named_parameters()))  # as of the snapshot (a collective)
    _step(model, opt, 3, rank)
    staged = module_snap.state_dict()
    params = dict(model.named_parameters())
    out["module_dtensors"] = all(type(staged[n]).__name__ == "DTensor" and staged[n].to_local().device.type == "cpu"
                                 and staged[n].to_local().shape == p.to_local().shape
                                 and staged[n].shape == p.shape and staged[n].placements == p.placements
                                 for n, p in params.items())
    out["module_changed_by_step"] = not all(torch.equal(staged[n].to_local(), p.to_local()) for n, p in params.items())
    dcp.save(staged, checkpoint_id=f"{root}/module", process_group=ckpt_pg)
    del staged
    module_snap.free()

    # Fresh models on the same 2 ranks (another init) load both checkpoints.
    fresh, fopt = _fsdp2(world_size, seed=7)
    _step(fresh, fopt, 5, rank)
    loaded = _full(_load_into(fresh, fopt, f"{root}/async", ckpt_pg))
    _assert_tree_equal(loaded, at_call, "async save, 2 ranks")
    fresh2, fopt2 = _fsdp2(world_size, seed=8)
    _step(fresh2, fopt2, 5, rank)
    loaded = _full(_load_into(fresh2, fopt2, f"{root}/snapshot", ckpt_pg))
    _assert_tree_equal(loaded, snap_full, "snapshot save, 2 ranks")
    out["arena_used_after"] = arena.used_bytes
    if rank == 0:  # tensors cross the process boundary as a file (not through the result queue)
        torch.save({"async": at_call, "snapshot": snap_full, "module": module_full}, f"{root}/expected.pt")
    return out


def _one_rank_load(rank: int, world_size: int, path: str) -> dict[str, Any]:
    model = build_qwen2(seed=11)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, 0, 0)
    return _clone_tree(_load_into(model, opt, path))


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("dcp")
    return root, run_ranks(_fsdp2_rank, 2, str(root), timeout=240)


def test_fsdp2_async_save_two_ranks(fsdp2_run: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = fsdp2_run
    for r in results:
        assert r["staged_bytes"] > 0
        assert r["changed_by_step"], "the training step during the write changed nothing: the test proves nothing"
    # Each rank staged its own shards (about half the model), not the whole model.
    assert abs(results[0]["staged_bytes"] - results[1]["staged_bytes"]) < results[0]["staged_bytes"] // 4


@pytest.mark.parametrize("which", ["async", "snapshot"])
def test_fsdp2_checkpoint_loads_on_one_rank(fsdp2_run: tuple[Path, list[dict[str, Any]]], which: str) -> None:
    root, results = fsdp2_run
    expected = torch.load(root / "expected.pt", weights_only=True)[which]
    (loaded,) = run_ranks(_one_rank_load, 1, str(root / which))
    # The unsharded model names its tied lm_head too; everything the sharded one saved must match.
    _assert_tree_equal({k: v for k, v in loaded["model"].items() if k in expected["model"]}, expected["model"],
                       f"{which}: model on 1 rank")
    _assert_tree_equal(loaded["optim"]["state"], expected["optim"]["state"], f"{which}: AdamW state on 1 rank")


def test_snapshot_state_dict_of_fsdp2_wraps_dtensors(fsdp2_run: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = fsdp2_run
    for r in results:
        assert r["snapshot_dtensors"] > 0 and r["snapshot_all_host"]


def _one_rank_module_load(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    model = build_qwen2(seed=11)  # another init: every value must come from the checkpoint
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=path)
    return {k: v.clone() for k, v in sd.items()}


def test_fsdp2_module_snapshot_saved_on_two_ranks_loads_on_one(fsdp2_run: tuple[Path, list[dict[str, Any]]]) -> None:
    # go.snapshot(fsdp2_model).state_dict() is a reshardable checkpoint: 2 ranks save it, 1 rank loads it.
    root, results = fsdp2_run
    assert all(r["module_dtensors"] for r in results), "the snapshot's parameters are not the model's DTensors"
    assert all(r["module_changed_by_step"] for r in results), "the step after the snapshot changed nothing"
    expected = torch.load(root / "expected.pt", weights_only=True)["module"]
    (loaded,) = run_ranks(_one_rank_module_load, 1, str(root / "module"))
    assert expected and set(expected) <= set(loaded)
    _assert_tree_equal({k: loaded[k] for k in expected}, expected, "module snapshot on 1 rank")


# ------------------------------------------------------------------------------------------ one process


def _roundtrip_rank(rank: int, world_size: int, path: str, overlap: bool) -> dict[str, Any]:
    model = build_qwen2(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, 0, 0)
    _step(model, opt, 1, 0)
    msd, osd = get_state_dict(model, opt)
    expected = _clone_tree({"model": msd, "optim": osd})
    arena = go.Arena(min_slab_bytes=4 * _MIB)
    with ArenaStager(arena, overlap=overlap) as stager:
        res = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path, async_stager=stager)
        if overlap:  # a stager that returns a future: DCP answers with both futures
            res.staging_completion.result()
            res = res.upload_completion
        _step(model, opt, 2, 0)
        res.result()
    fresh = build_qwen2(seed=3)
    fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    _step(fresh, fopt, 9, 0)
    loaded = _clone_tree(_load_into(fresh, fopt, path))
    _assert_tree_equal(loaded, expected, "get_state_dict round trip")
    return {}


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_get_state_dict_roundtrip(tmp_path: Path, overlap: bool) -> None:
    run_ranks(_roundtrip_rank, 1, str(tmp_path / "ckpt"), overlap)


def _wait_released(arena: go.Arena, expected: int, what: str) -> None:
    # DCP's write thread drops the staged dict just after the future is set: give it a moment.
    deadline = time.monotonic() + 30
    while arena.used_bytes != expected and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert arena.used_bytes == expected, (what, arena.used_bytes, expected)


def test_fifty_saves_keep_the_arena_flat(tmp_path: Path) -> None:
    arena = go.Arena(min_slab_bytes=4 * _MIB)
    sd = {"w": torch.randn(256, 64), "b": torch.randn(64), "nested": {"x": torch.arange(100)}, "step": 0}
    stager = ArenaStager(arena)
    stats = []
    for i in range(50):
        sd["w"].add_(1)
        sd["step"] = i
        fut = dcp.async_save(sd, checkpoint_id=str(tmp_path / f"c{i % 2}"), async_stager=stager, no_dist=True)
        fut.result()
        _wait_released(arena, 0, f"save {i}")
        stats.append(arena.stats())
    stager.close()
    assert stats[0]["capacity_bytes"] > 0
    assert {s["capacity_bytes"] for s in stats} == {stats[0]["capacity_bytes"]}
    assert {s["num_slab_allocations"] for s in stats} == {stats[0]["num_slab_allocations"]}
    out = {"w": torch.zeros(256, 64), "b": torch.zeros(64), "nested": {"x": torch.zeros(100, dtype=torch.long)},
           "step": -1}
    dcp.load(out, checkpoint_id=str(tmp_path / "c1"), no_dist=True)
    _assert_tree_equal(out, sd, "last save")


def test_snapshot_state_dict_plain(tmp_path: Path) -> None:
    sd = {"a": torch.randn(10, 3), "b": torch.arange(7, dtype=torch.int16)}
    snap = go.snapshot(sd)
    expected = _clone_tree(sd)
    sd["a"].add_(1)
    staged = snap.state_dict()
    assert set(staged) == {"a", "b"} and all(t.device.type == "cpu" for t in staged.values())
    dcp.save(staged, checkpoint_id=str(tmp_path / "s"), no_dist=True)
    snap.free()
    with pytest.raises(go.OffloadError, match="freed"):
        snap.state_dict()
    with pytest.raises(go.OffloadError, match="meta tensors"):  # the same checks as every snapshot, first
        go.snapshot({"m": torch.empty(2, device="meta")})
    out = {"a": torch.zeros(10, 3), "b": torch.zeros(7, dtype=torch.int16)}
    dcp.load(out, checkpoint_id=str(tmp_path / "s"), no_dist=True)
    _assert_tree_equal(out, expected, "snapshot saved with dcp")


def test_structure_and_non_tensor_values_pass_through() -> None:
    arena = go.Arena(min_slab_bytes=4 * _MIB)
    shared = torch.randn(4, 4)
    groups = [{"lr": 0.1, "params": [0, 1]}]
    sd = {"m": {"w": shared, "w_view": shared[1:], "tied": shared}, "list": [torch.ones(2), "x", 3],
          "tuple": (torch.zeros(1), None), "param_groups": groups, "dotted.key": torch.ones(1), "dotted": {"key": torch.zeros(1)},
          "trailing.": torch.full((1,), 2.0), "trailing": torch.full((1,), 4.0), "": torch.full((1,), 3.0)}
    before = shared.clone()
    with ArenaStager(arena) as stager:
        staged = stager.stage(sd)
        shared.add_(5)  # training after the stage does not reach the staged copy
        groups[0]["lr"] = 0.5  # nor the non-tensor values
        assert torch.equal(staged["m"]["w"], before) and torch.equal(staged["m"]["w_view"], before[1:])
        # Views and shared storages come out as views of one host storage, as in the source.
        assert staged["m"]["w"].untyped_storage().data_ptr() == staged["m"]["tied"].untyped_storage().data_ptr()
        assert staged["m"]["w_view"].untyped_storage().data_ptr() == staged["m"]["w"].untyped_storage().data_ptr()
        assert isinstance(staged["list"], list) and staged["list"][1:] == ["x", 3]
        assert isinstance(staged["tuple"], tuple) and staged["tuple"][1] is None
        assert staged["param_groups"] == [{"lr": 0.1, "params": [0, 1]}]
        assert torch.equal(staged["dotted.key"], torch.ones(1)) and torch.equal(staged["dotted"]["key"], torch.zeros(1))
        assert [float(staged[k]) for k in ("trailing.", "trailing", "")] == [2.0, 4.0, 3.0]
        assert arena.used_bytes > 0 and stager.staged_bytes > 0
        del staged
    assert arena.used_bytes == 0


# ------------------------------------------------------------------------------------------ errors


def _no_files(path: Path) -> bool:
    return not path.exists() or not any(path.iterdir())


def test_meta_tensor_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    arena = go.Arena(min_slab_bytes=4 * _MIB)
    arena.reserve(1 * _MIB)
    before = arena.stats()
    sd = {"ok": torch.ones(3), "bad": torch.empty(3, device="meta")}
    with ArenaStager(arena) as stager:
        with pytest.raises(go.OffloadError, match=r"ArenaStager.*bad: meta tensors"):
            dcp.async_save(sd, checkpoint_id=str(tmp_path / "m"), async_stager=stager, no_dist=True)
    assert _no_files(tmp_path / "m")
    after = arena.stats()
    assert (after["used_bytes"], after["capacity_bytes"]) == (before["used_bytes"], before["capacity_bytes"])


def test_a_conjugate_view_is_refused_by_name_not_saved_conjugated(tmp_path: Path) -> None:
    # Its storage holds the unconjugated values: staged as they are, the checkpoint held conj(value).
    arena = go.Arena(min_slab_bytes=4 * _MIB)
    z = torch.complex(torch.randn(4), torch.randn(4))
    with ArenaStager(arena) as stager:
        with pytest.raises(go.OffloadError, match=r"ArenaStager.*zc: a conjugate view"):
            dcp.async_save({"zc": z.conj()}, checkpoint_id=str(tmp_path / "c"), async_stager=stager, no_dist=True)
    assert _no_files(tmp_path / "c") and arena.used_bytes == 0


def test_offloaded_tensors_are_refused(tmp_path: Path) -> None:
    arena = go.Arena(min_slab_bytes=4 * _MIB)
    model = torch.nn.Linear(8, 8)
    sd = model.state_dict()
    go.offload(model, arena=arena)
    try:
        used = arena.used_bytes
        with ArenaStager(arena) as stager:
            with pytest.raises(go.OffloadError, match=r"ArenaStager.*offloaded.*reload"):
                dcp.async_save(sd, checkpoint_id=str(tmp_path / "o"), async_stager=stager, no_dist=True)
        assert _no_files(tmp_path / "o") and arena.used_bytes == used
    finally:
        go.reload(model)


def test_arena_cap_is_refused_and_arena_unchanged(tmp_path: Path) -> None:
    arena = go.Arena(max_bytes=64 * 1024, min_slab_bytes=64 * 1024)
    sd = {"big": torch.randn(64 * 1024)}  # 256 KiB > the cap
    with ArenaStager(arena) as stager:
        with pytest.raises(go.OffloadError, match="ArenaStager"):
            dcp.async_save(sd, checkpoint_id=str(tmp_path / "c"), async_stager=stager, no_dist=True)
    assert _no_files(tmp_path / "c")
    assert arena.used_bytes == 0


def test_failed_write_leaves_the_arena_as_it_was(tmp_path: Path) -> None:
    arena = go.Arena(min_slab_bytes=4 * _MIB)
    arena.reserve(1 * _MIB)
    before = arena.stats()
    sd = {"w": torch.randn(100, 10)}
    with ArenaStager(arena) as stager:
        fut = dcp.async_save(sd, storage_writer=FailingWriter(str(tmp_path / "f")), async_stager=stager, no_dist=True)
        with pytest.raises(BaseException, match="No space left"):  # DCP raises a CheckpointException
            fut.result()
        del fut
    _wait_released(arena, before["used_bytes"], "after a failed write")
    assert arena.stats()["capacity_bytes"] == before["capacity_bytes"]
    # The stager still works after a failure.
    with ArenaStager(arena) as stager:
        dcp.async_save(sd, checkpoint_id=str(tmp_path / "ok"), async_stager=stager, no_dist=True).result()


def test_snapshot_state_dict_of_sharded_modules(tmp_path: Path) -> None:
    run_ranks(_sharded_module_rank, 1, str(tmp_path))


def test_a_failed_writes_staged_memory_is_back_without_waiting_for_the_collector(tmp_path: Path) -> None:
    # DCP's exception holds a reference cycle (its frames hold it back): with the collector off, as many
    # trainers run, only the stager can give the space back.
    arena = go.Arena(min_slab_bytes=4 * _MIB)
    sd = {"w": torch.randn(100, 10)}
    stager = ArenaStager(arena)
    gc.collect()
    gc.disable()
    try:
        fut = dcp.async_save(sd, storage_writer=FailingWriter(str(tmp_path / "f")), async_stager=stager, no_dist=True)
        with pytest.raises(BaseException, match="No space left"):
            fut.result()
        del fut
        for thread in threading.enumerate():  # DCP's writer thread ends once the failure is reported
            if thread.name.startswith("AsyncCheckpointExecutor"):
                thread.join(30)
        assert arena.used_bytes > 0  # held by the cycle, the collector being off
        stager.close()
        assert arena.used_bytes == 0 and stager.staged_bytes == 0
    finally:
        gc.enable()


def test_close_racing_a_stage_in_flight_starts_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    arena = go.Arena(min_slab_bytes=4 * _MIB)
    stager = ArenaStager(arena, overlap=True)

    def close_meanwhile(self: go.Snapshot) -> bool:
        stager.close()  # another thread's close(), after the stage passed its own check
        return False  # a copy still in flight, as on a GPU

    monkeypatch.setattr(go.Snapshot, "done", close_meanwhile)
    with pytest.raises(go.OffloadError, match="after close"):
        stager.stage({"x": torch.ones(10)})
    monkeypatch.undo()
    assert stager._executor is None
    assert not [t for t in threading.enumerate() if t.name.startswith("gpu_offload-stager")]
    gc.collect()
    assert arena.used_bytes == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_an_interrupt_anywhere_in_stage_gives_everything_back(overlap: bool) -> None:
    arena = go.Arena(min_slab_bytes=4 * _MIB)
    stager = ArenaStager(arena, overlap=overlap)
    sd = {"w": torch.randn(64), "nested": {"b": torch.arange(5), "view": torch.arange(9)[2:]}, "step": 3}
    staged: list[Any] = []

    def check(k: int) -> None:
        staged.clear()
        if (stager.staged_bytes, arena.used_bytes) != (0, 0):
            gc.collect()  # (slow: only where something is still held)
        assert (stager.staged_bytes, arena.used_bytes) == (0, 0), f"interrupt {k} ({conftest.last_point}) kept a region user"

    points = every_interrupt(lambda: staged.append(stager.stage(sd)), check)
    assert points > 20
    staged.append(stager.stage(sd))
    out = staged[0].result() if overlap else staged[0]
    _assert_tree_equal(out, sd, "the uninterrupted stage")
    del out
    check(points + 1)
    stager.close()


def _sharded_module_rank(rank: int, world_size: int, directory: str) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model, _ = _fsdp2(world_size, seed=0)
    # An FSDP2 module's snapshot is its state dict: the same names, DTensors where the parameters are.
    snap = go.snapshot(model)
    staged = snap.state_dict()
    assert set(staged) == {n for n, _ in model.named_parameters(remove_duplicate=False)} | {
        n for n, _ in model.named_buffers()}
    for name, p in model.named_parameters():
        assert type(staged[name]).__name__ == "DTensor" and staged[name].placements == p.placements
        assert torch.equal(staged[name].to_local(), p.to_local()), name
    del staged
    go.save(snap, f"{directory}/fsdp2.safetensors")
    snap.free()
    with go.load(f"{directory}/fsdp2.safetensors") as loaded:  # a file keeps no DTensor specs
        with pytest.raises(go.OffloadError, match="no DTensor specs"):
            loaded.state_dict()
    with go.snapshot(model, include_grads=True) as snap:
        with pytest.raises(go.OffloadError, match="gradients"):
            snap.state_dict()
    # Its state dict (DTensors) is what DCP saves: wrapped again as DTensors.
    snap = go.snapshot(model.state_dict())
    staged = snap.state_dict()
    assert staged and all(type(v).__name__ == "DTensor" for v in staged.values() if v.dim() > 0)
    snap.free()
    # FSDP1's flat parameters are no state dict: refused with the reason.
    fsdp1 = FSDP(build_qwen2(seed=0), device_id=torch.device("cpu"))
    with go.snapshot(fsdp1) as snap:
        with pytest.raises(go.OffloadError, match="fsdp1.*flat shards"):
            snap.state_dict()


def test_protocol_overlap_future_and_release() -> None:
    from torch.distributed.checkpoint.staging import AsyncStager

    arena = go.Arena(min_slab_bytes=4 * _MIB)
    stager = ArenaStager(arena, overlap=True)
    assert isinstance(stager, AsyncStager) and stager.should_synchronize_after_execute is False
    src = {"a": torch.randn(100), "b": [torch.randn(3, 3)]}
    fut = stager.stage(src)
    stager.synchronize_staging()
    staged = fut.result()
    assert torch.equal(staged["a"], src["a"]) and torch.equal(staged["b"][0], src["b"][0])
    assert stager.staged_bytes == (100 + 9) * 4 and arena.used_bytes > 0
    del fut, staged
    gc.collect()
    assert stager.staged_bytes == 0 and arena.used_bytes == 0  # dropped staged dict: its region is back
    stager.close()


def test_stage_after_close_is_an_error() -> None:
    stager = ArenaStager(go.Arena(min_slab_bytes=4 * _MIB))
    stager.close()
    stager.close()  # idempotent
    with pytest.raises(go.OffloadError, match="after close"):
        stager.stage({"x": torch.ones(1)})


# ------------------------------------------------------------------------------------------ CUDA


def _cuda() -> bool:
    return go.cuda_available() and torch.cuda.is_available()


@pytest.mark.cuda
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_cuda_stage_is_the_state_at_the_call(overlap: bool) -> None:
    if not _cuda():
        pytest.skip("no CUDA device")
    arena = go.Arena(min_slab_bytes=64 * _MIB)
    params = [torch.nn.Parameter(torch.randn(4096, 1024, device="cuda"))]
    params += [torch.nn.Parameter(torch.randn(257, device="cuda")) for _ in range(64)]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.SGD(params, lr=1.0)
    src = {"w": params[0], "small": params[1:], "step": 7}
    expected = {"w": params[0].detach().cpu(), "small": [p.detach().cpu() for p in params[1:]], "step": 7}
    for p in params:  # the step's kernels loaded before the gate (a zero gradient changes nothing)
        p.grad = torch.zeros_like(p)
    opt.step()
    for p in params:
        p.grad = torch.ones_like(p)
    go.snapshot({"x": torch.ones(16, device="cuda")}, arena=arena).wait().free()
    arena.reserve(32 * _MIB)
    torch.cuda.synchronize()
    with ArenaStager(arena, overlap=overlap) as stager:
        with hold(engine_stream(0, to_host=True)) as gate:  # the copy is held
            if not overlap:
                gate.open_after(0.5)  # stage() waits for the copy on the host: released from another thread
            out = stager.stage(src)
            # Enqueued after the stage: must not reach the staged copy. Without overlap stage() returned a
            # complete copy; with overlap the optimizer step waits for it (gpu_offload's step pre-hook).
            opt.step()
            if overlap:
                assert not settle(recorded()), "the step ran before the staged copy had read the weights"
            gate.release()
        staged = out.result() if overlap else out
        host = [staged["w"], *staged["small"]]
        assert all(t.device.type == "cpu" and t.is_pinned() for t in host)
        _assert_tree_equal(staged, expected, "staged on CUDA")
        assert not torch.equal(params[0].detach().cpu(), expected["w"]), "the step changed nothing"
        del staged, out, host


@pytest.mark.cuda
def test_cuda_saves_pin_nothing_after_the_first(tmp_path: Path) -> None:
    if not _cuda():
        pytest.skip("no CUDA device")
    arena = go.Arena(min_slab_bytes=64 * _MIB)
    sd = {f"p{i}": torch.randn(1024, 256, device="cuda") for i in range(32)}
    stats = []
    with ArenaStager(arena) as stager:
        for i in range(20):
            dcp.async_save(sd, checkpoint_id=str(tmp_path / f"c{i % 2}"), async_stager=stager, no_dist=True).result()
            _wait_released(arena, 0, f"save {i}")
            stats.append((arena.stats()["capacity_bytes"], arena.stats()["num_slab_allocations"]))
    assert len(set(stats)) == 1, stats
    out = {k: torch.zeros(1024, 256) for k in sd}
    dcp.load(out, checkpoint_id=str(tmp_path / "c1"), no_dist=True)
    _assert_tree_equal(out, {k: v.cpu() for k, v in sd.items()}, "CUDA save")


# ------------------------------------------------------------------------------------------ bench --stager


def test_bench_stager_rows_beside_dcp(tmp_path: Path) -> None:
    import json

    from gpu_offload import cli

    layout = tmp_path / "tiny.json"
    layout.write_text(json.dumps({"name": "tiny-stager", "dtype": "float32", "runs": [[[64, 128], 5], [[300], 4]]}))
    nbytes = (5 * 64 * 128 + 4 * 300) * 4
    assert cli.main(["bench", "--layout", str(layout), "--repeats", "1", "--no-baselines", "--stager",
                     "--json", str(tmp_path / "out.json")]) == 0
    (res,) = json.loads((tmp_path / "out.json").read_text())["results"]
    rows = {r["method"]: r for r in res["rows"]}
    from gpu_offload.bench_stager import dcp_stager

    dcp_class = dcp_stager(torch.device("cpu"))[0]
    limit = next(r["gbps"] for r in res["rows"] if r["method"] == "limit" and r["direction"] == "d2h")
    for name, kind in (("ArenaStager", "engine"), ("DCP stager", "baseline")):
        for when in ("first", "steady"):
            r = rows[f"{name} {when}"]
            assert r["kind"] == kind
            if name == "DCP stager":
                assert dcp_class in r["note"], r["note"]  # which of DCP's stagers it was
            assert r["direction"] == "d2h" and r["nbytes"] == nbytes and r["seconds"] > 0
            assert r["gbps"] == pytest.approx(nbytes / r["seconds"] / 1e9)
            assert r["ratio"] == pytest.approx(r["gbps"] / limit)
    # Without the flag, no staging rows.
    assert cli.main(["bench", "--layout", str(layout), "--repeats", "1", "--no-baselines",
                     "--json", str(tmp_path / "plain.json")]) == 0
    (res,) = json.loads((tmp_path / "plain.json").read_text())["results"]
    assert not any("Stager" in r["method"] for r in res["rows"])


def test_bench_times_a_dcp_stager_that_cannot_stage_twice_anew_each_call(monkeypatch, caplog) -> None:
    # torch 2.11's DefaultStager closes its inner stager at the end of each stage(), and its second call
    # raises: the bench then times its steady state with a new one per call, says so, and keeps going.
    from gpu_offload import bench, bench_stager

    made: list[Any] = []

    class OneShot:
        def __init__(self) -> None:
            self.calls = 0
            self.closed = False
            made.append(self)

        def stage(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            self.calls += 1
            if self.calls > 1:
                raise KeyError(type)
            return {k: v.clone() for k, v in sd.items()}

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr(bench_stager, "dcp_stager", lambda device: ("OneShotStager()", OneShot))
    layout = bench.Layout("tiny", torch.float32, [(64,)] * 3)
    b = bench.Bench(layout, torch.device("cpu"), repeats=3)
    b.measure("limit", "d2h", lambda: None)
    with caplog.at_level("WARNING", logger="gpu_offload.bench_stager"):
        rows = {r.method: r for r in bench_stager.measure_stager(b)}
    steady = rows["DCP stager steady"]
    assert "a new OneShotStager() each call" in steady.note and "KeyError" in steady.note, steady.note
    assert len(steady.samples) == 3 and steady.seconds > 0
    assert all(s.closed for s in made) and all(s.calls <= 2 for s in made)
    assert "its steady state is timed with a new stager each call" in caplog.text
    assert "a new" not in rows["ArenaStager steady"].note  # (the engine's own stager stages again)


def test_a_dying_target_queues_its_plan_once() -> None:
    # Every tensor of a dead target used to queue the plan's key (a tuple as long as the target) for
    # pruning, which then hashed it once per tensor: a first stage after a 65536-tensor target died took
    # minutes. One entry per plan now.
    from gpu_offload import plan as _plan

    tensors = {f"t{i}": torch.zeros(2) for i in range(300)}
    go.snapshot(tensors).free()
    _plan._prune()
    assert not _plan._dead_keys
    del tensors
    gc.collect()
    # (Only this target's entries: another test's target may die in the same collection.)
    mine = [key for key, _ in _plan._dead_keys if key[:2] == ("record", 300) or len(key) == 300]
    assert len(mine) == 1, _plan._dead_keys
    _plan._prune()
