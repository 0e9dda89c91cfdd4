"""DeepSpeed ZeRO engines (stages 0-3) on the CPU: DS_ACCELERATOR=cpu, gloo, 1 and 2 ranks.

Every check trains an engine beside a twin built the same way, moves the engine's state (snapshot -> 2
steps -> restore; offload -> reload; offload with gradients between backward and step) and requires the
losses and probe logits to stay bitwise equal to the twin's.

DeepSpeed compiles a small op on its first initialize (about a minute; FusedAdam, needed by DeepSpeed's own
stage-3 offload_states, one more). The build cache is TORCH_EXTENSIONS_DIR, set here to build/torch_extensions
unless given, so every test of a run (and the spawned ranks) reuses it. The default run covers a reduced
matrix; the full one (every stage x fp32/bf16 x 1/2 ranks, DeepSpeed's own stage-3 offload) is marked slow
and runs with GPU_OFFLOAD_DS_FULL=1.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / "build" / "torch_extensions"))
deepspeed = pytest.importorskip("deepspeed")

import torch.distributed as dist  # noqa: E402

import gpu_offload as go  # noqa: E402
from gpu_offload.adapters import deepspeed as ds_adapter  # noqa: E402
from gpu_offload.integrations.deepspeed import offload_states, reload_states  # noqa: E402
from gpu_offload.integrations.verl import GpuOffloadSlotsMixin  # noqa: E402
from helpers_dist import QWEN2_TINY, batch, lm_loss, run_ranks  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

FULL = os.environ.get("GPU_OFFLOAD_DS_FULL") == "1"
full_only = pytest.mark.skipif(not FULL, reason="full DeepSpeed matrix: set GPU_OFFLOAD_DS_FULL=1")

# DeepSpeed's default stage3_param_persistence_threshold: parameters with fewer elements stay whole on every
# rank (ZeRO-3 persistent parameters). The config leaves it at its default, and the MLP matrices are made wider
# than it, so that ZeRO-3 partitions those while the embedding, norms and biases persist.
DEFAULT_PERSISTENCE_THRESHOLD = 100_000
WIDE = 3200  # hidden * WIDE > the threshold


class TinyLM(torch.nn.Module):
    """Embedding, two MLP blocks with LayerNorm and a tied head: under ZeRO-3's default persistence threshold
    the MLP matrices are partitioned and every other parameter persists."""

    def __init__(self, vocab: int = QWEN2_TINY["vocab_size"], hidden: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, WIDE), torch.nn.GELU(),
                                torch.nn.Linear(WIDE, hidden))
            for _ in range(2))
        self.norm = torch.nn.LayerNorm(hidden)
        self.register_buffer("scale", torch.tensor(0.5))
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x) * self.scale)


def build_model(seed: int, dtype: torch.dtype) -> TinyLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyLM().to(dtype)


_seen_group: list[Any] = [None]


def _forget_stale_groups() -> None:
    """DeepSpeed caches process groups in module globals; world-size-1 tests run in this process, each with a
    fresh default group, so the cache of the previous test's group is dropped."""
    from deepspeed.utils import groups

    default = dist.distributed_c10d._get_default_group()
    if _seen_group[0] is default:
        return
    _seen_group[0] = default
    for name, value in list(vars(groups).items()):
        if name.startswith("_") and name.isupper():
            if isinstance(value, dict):
                value.clear()
            elif isinstance(value, dist.ProcessGroup):
                setattr(groups, name, None)


def make_engine(stage: int, bf16: bool, seed: int = 0, fused_adam: bool = False) -> Any:
    _forget_stale_groups()
    # What a launcher sets; the process group itself is run_ranks' (DeepSpeed adopts it).
    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()), LOCAL_RANK=str(dist.get_rank()))
    model = build_model(seed, torch.bfloat16 if bf16 else torch.float32)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": not fused_adam}},
        "zero_optimization": {"stage": stage},  # DeepSpeed's default persistence threshold
        "bf16": {"enabled": bf16},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train_step(engine: Any, step: int, rank: int) -> torch.Tensor:
    ids = batch(step, rank)
    loss = lm_loss(engine(ids), ids)
    engine.backward(loss)
    engine.step()
    return loss.detach().clone()


def probe(engine: Any) -> torch.Tensor:
    with torch.no_grad():
        return engine(batch(999, 0)).float().clone()


def both(a: Any, b: Any, steps: range, rank: int, what: str) -> None:
    for i in steps:
        la, lb = train_step(a, i, rank), train_step(b, i, rank)
        assert torch.equal(la, lb), f"{what}: loss at step {i} differs ({la} vs {lb})"
    assert torch.equal(probe(a), probe(b)), f"{what}: probe logits differ"


def state_of(target: Any, include_grads: bool = False) -> dict[str, torch.Tensor]:
    """Clones of every tensor the adapter names (for 'nothing written' and 'same state' checks)."""
    from gpu_offload.adapters import named_tensors

    return {n: t.detach().clone() for n, t in named_tensors(target, include_grads=include_grads, reshard=False)}


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k} differs"


def ds_grads(engine: Any) -> list[torch.Tensor]:
    """Every gradient tensor DeepSpeed holds for the engine, read from its own attributes (not the adapter's)."""
    opt = engine.optimizer
    out = [p.grad for p in engine.module.parameters() if p.grad is not None]
    for lists in (getattr(opt, "averaged_gradients", None) or {}).values():
        out.extend(g for g in (lists or []) if isinstance(g, torch.Tensor))
    for attr in ("grads_in_partition", "grad_partitions_flat_buffer"):
        value = getattr(opt, attr, None)
        out.extend(value if isinstance(value, list) else [value] if isinstance(value, torch.Tensor) else [])
    masters = [*(getattr(opt, "single_partition_of_fp32_groups", None) or []),
               *(getattr(opt, "fp32_partitioned_groups_flat", None) or []),
               *(m for group in getattr(opt, "fp32_groups", None) or [] for m in group)]
    out.extend(m.grad for m in masters if isinstance(m, torch.Tensor) and m.grad is not None)
    return [g for g in out if isinstance(g, torch.Tensor) and g.numel()]


def released(engine: Any, categories: tuple[str, ...]) -> bool:
    cats = ds_adapter.deepspeed_state(engine, include_grads=True, reshard=False)
    tensors = [t for c in categories for _, t in cats[c]]
    return bool(tensors) and all(t.untyped_storage().nbytes() == 0 for t in tensors)


# ----------------------------------------------------------------------------------------- the matrix


def check_round_trips(rank: int, world_size: int, stage: int, bf16: bool, mis: bool) -> dict[str, int]:
    a = make_engine(stage, bf16)
    b = make_engine(stage, bf16)
    assert ds_adapter.is_deepspeed_engine(a) and ds_adapter.is_deepspeed_optimizer(a.optimizer) == (stage > 0 or bf16)
    if stage == 3:  # the default persistence threshold: some parameters persist (whole), the matrices do not
        persist = [p.ds_persist for p in a.module.parameters()]
        assert any(persist) and not all(persist), persist
    both(a, b, range(2), rank, "before")

    # snapshot -> 2 steps -> restore: the twin never moved, so the engine must be back in step with it.
    snap = go.snapshot(a)
    for i in range(2, 4):
        train_step(a, i, rank)
    go.restore(a, snap)
    both(a, b, range(4, 6), rank, "after restore")
    nbytes = snap.nbytes
    snap.free()

    # offload -> reload between steps (gathered ZeRO-3 parameters after the probe included).
    go.offload(a)
    assert go.is_offloaded(a)
    assert released(a, ("lp_params", "hp_params", "optim_states"))
    go.reload(a)
    assert not go.is_offloaded(a)
    both(a, b, range(6, 8), rank, "after offload/reload")

    # With gradients, between backward and step.
    for e in (a, b):
        ids = batch(8, rank)
        e.backward(lm_loss(e(ids), ids))
    grads = state_of(a, include_grads=True)
    assert any(".grad" in n or "averaged_gradients" in n for n in grads), "no gradient named"
    go.offload(a, include_grads=True)
    assert released(a, ("lp_params", "hp_params", "optim_states", "lp_grads"))
    go.reload(a)
    assert_same_state(state_of(a, include_grads=True), grads, "grads after reload")
    a.step(), b.step()
    both(a, b, range(9, 11), rank, "after offload with grads")

    # grads="drop", between steps (ZeRO-3 keeps its gradient partitions allocated; ZeRO 1/2 hold none then) ...
    go.offload(a, grads="drop")
    assert not any(g.untyped_storage().nbytes() for g in ds_grads(a)), "a gradient still holds memory"
    go.reload(a)
    both(a, b, range(20, 21), rank, "after dropping the gradients between steps")
    # ... and between backward and step, beside a twin whose gradients were zeroed.
    for e in (a, b):
        ids = batch(21, rank)
        e.backward(lm_loss(e(ids), ids))
    dropped = ds_grads(a)
    assert dropped and any(g.float().abs().sum() > 0 for g in dropped)
    state_bytes = go.snapshot(a).nbytes
    go.offload(a, grads="drop")
    assert all(g.untyped_storage().nbytes() == 0 for g in dropped), "a gradient still holds memory"
    assert go.offloaded_bytes() == state_bytes, "gradient bytes went to host memory"
    go.reload(a)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in ds_grads(a)), "gradients not zeroed"
    for g in ds_grads(b):
        g.zero_()
    a.step(), b.step()
    both(a, b, range(22, 24), rank, "after dropping the gradients between backward and step")

    if mis:  # MIS v1/v2: old weights back for log-probs, then the current ones, then training goes on.
        v1 = go.snapshot(a)
        ref_v1 = probe(a)
        replay = [train_step(a, i, rank) for i in range(11, 13)]
        for i in range(11, 13):
            train_step(b, i, rank)
        v2 = go.snapshot(a)
        ref_v2 = probe(a)
        go.restore(a, v1)
        assert torch.equal(probe(a), ref_v1), "restored v1 computes like v1"
        assert not torch.equal(ref_v1, ref_v2)
        go.restore(a, v2)
        assert torch.equal(probe(a), ref_v2), "restored v2 computes like v2"
        go.restore(a, v1)  # completeness: from v1 (masters, Adam state) the same steps replay bitwise
        assert all(torch.equal(train_step(a, i, rank), x) for i, x in zip(range(11, 13), replay)), "replay"
        go.restore(a, v2)
        both(a, b, range(13, 15), rank, "after MIS")
        v1.free()
        v2.free()
        # The module and the optimizer apart, as a list: the same round trip.
        go.offload([a.module, a.optimizer])
        assert go.is_offloaded(a)
        go.reload([a.module, a.optimizer])
        both(a, b, range(15, 16), rank, "after offloading [module, optimizer]")

    info = ds_adapter.deepspeed_shard_info(a)
    assert info["stage"] == stage and info["dp"] == [world_size, rank]
    masters = ds_adapter.deepspeed_state(a, include_grads=False, reshard=False)["hp_params"]
    full = sum(getattr(p, "ds_numel", p.numel()) for p in a.module.parameters())
    return {"nbytes": nbytes, "master_numel": sum(t.numel() for _, t in masters), "full_numel": full}


DEFAULT = [(1, False, 1), (2, True, 1), (3, True, 1), (3, False, 2)]
MATRIX = [(s, bf, w) for s in (0, 1, 2, 3) for bf in (False, True) for w in (1, 2) if (s, bf, w) not in DEFAULT]


def _id(c: tuple[int, bool, int]) -> str:
    return f"stage{c[0]}-{'bf16' if c[1] else 'fp32'}-{c[2]}rank"


@pytest.mark.parametrize("stage,bf16,world", DEFAULT, ids=[_id(c) for c in DEFAULT])
def test_round_trips_match_twin(stage: int, bf16: bool, world: int) -> None:
    check_partitions(run_ranks(check_round_trips, world, stage, bf16, stage == 3, timeout=300), stage, bf16)


def check_partitions(results: list[dict[str, int]], stage: int, bf16: bool) -> None:
    """Each rank holds (and copies) its own 1/world of the fp32 masters, not all of them."""
    full, world = results[0]["full_numel"], len(results)
    for r in results:
        if stage == 0:
            assert r["master_numel"] == (full if bf16 else 0), r
        else:  # padding: a few elements per parameter (ZeRO-3) or per group
            assert full // world <= r["master_numel"] <= full // world + 256, (r, full)
    if world == 2 and stage > 0:
        assert results[0]["nbytes"] == results[1]["nbytes"]


@pytest.mark.slow
@full_only
@pytest.mark.parametrize("stage,bf16,world", MATRIX, ids=[_id(c) for c in MATRIX])
def test_round_trips_match_twin_full(stage: int, bf16: bool, world: int) -> None:
    check_partitions(run_ranks(check_round_trips, world, stage, bf16, stage == 3, timeout=300), stage, bf16)


# ------------------------------------------------------------------------------ layouts that differ


def _nothing_written(engine: Any, snap: Any) -> str:
    before = state_of(engine)
    with pytest.raises(go.LayoutMismatchError) as err:
        go.restore(engine, snap)
    assert_same_state(state_of(engine), before, "after a refused restore")
    return str(err.value)


def check_other_rank(rank: int, world_size: int, stage: int, directory: str) -> str:
    engine = make_engine(stage, True)
    train_step(engine, 0, rank)
    with go.snapshot(engine) as snap:
        go.save(snap, f"{directory}/r{rank}.safetensors")
    dist.barrier()
    with go.load(f"{directory}/r{(rank + 1) % world_size}.safetensors") as foreign:
        return _nothing_written(engine, foreign)


@pytest.mark.parametrize("stage", [3, pytest.param(2, marks=[pytest.mark.slow, full_only])])
def test_restore_refuses_another_ranks_partitions(stage: int, tmp_path: Path) -> None:
    for message in run_ranks(check_other_rank, 2, stage, str(tmp_path), timeout=300):
        assert "shard layout differs" in message and "dp" in message, message


def check_other_stage(rank: int, world_size: int) -> list[str]:
    engines = {s: make_engine(s, True) for s in (1, 2, 3)}
    for s, e in engines.items():
        train_step(e, 0, rank)
    messages = []
    for src, dst in ((1, 2), (2, 1), (2, 3), (3, 2)):
        with go.snapshot(engines[src]) as snap:
            messages.append(_nothing_written(engines[dst], snap))
    return messages


def test_restore_refuses_another_stages_snapshot() -> None:
    (messages,) = run_ranks(check_other_stage, 1, timeout=300)
    # Stages 1 and 2 keep the same tensors: only the recorded stage tells them apart.
    assert "shard layout differs" in messages[0] and "stage" in messages[0], messages[0]
    assert "stage" in messages[1], messages[1]
    assert all(messages), messages


# ------------------------------------------------------------------------------------------ drop-ins


def check_drop_ins(rank: int, world_size: int, stage: int, fused_adam: bool) -> None:
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

    ours, theirs, twin = (make_engine(stage, True, fused_adam=fused_adam) for _ in range(3))
    for i in range(2):
        for e in (ours, theirs, twin):
            train_step(e, i, rank)
    offload_states(ours)
    theirs.offload_states()
    assert released(ours, ("lp_params", "hp_params", "optim_states"))
    reload_states(ours)
    theirs.reload_states()
    assert_same_state(state_of(ours), state_of(theirs), "after reload: ours vs DeepSpeed's")
    assert_same_state(state_of(ours), state_of(twin), "after reload: ours vs the twin")

    # include with DeepSpeed's enum: only the optimizer state leaves.
    offload_states(ours, include=[OffloadStateTypeEnum.optim_states])
    assert released(ours, ("optim_states",)) and not released(ours, ("lp_params",))
    offload_states(ours, include=["optim_states"])  # already offloaded: skipped, as DeepSpeed does
    reload_states(ours)
    before = state_of(ours)
    reload_states(ours)  # nothing offloaded: left as it is, as DeepSpeed's own (a no-op there too)
    theirs.reload_states()
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    offload_states(ours, device=OffloadDeviceEnum.none)  # as DeepSpeed's own: a warning, nothing moved
    offload_states(ours, device="none")
    assert not released(ours, ("lp_params",)) and not released(ours, ("optim_states",))
    assert_same_state(state_of(ours), before, "after the calls that move nothing")
    with pytest.raises(go.OffloadError, match="CPU only"):
        offload_states(ours, device="nvme")
    with pytest.raises(go.OffloadError, match="unknown"):
        offload_states(ours, include=["weights"])

    # DeepSpeed's own offload in effect: gpu_offload refuses the engine instead of copying stale storages.
    theirs.offload_states(include=[OffloadStateTypeEnum.optim_states])
    with pytest.raises(go.OffloadError, match="reload_states"):
        go.snapshot(theirs)
    theirs.reload_states()
    for i in range(2, 4):
        losses = [train_step(e, i, rank) for e in (ours, theirs, twin)]
        assert torch.equal(losses[0], losses[2]) and torch.equal(losses[1], losses[2]), f"step {i}: {losses}"


def test_drop_ins_beside_deepspeeds_own() -> None:
    run_ranks(check_drop_ins, 1, 2, False, timeout=300)


def check_persistent_parameters_kept(rank: int, world_size: int) -> None:
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as State

    ours, twin = make_engine(3, True), make_engine(3, True)
    for i in range(2):
        train_step(ours, i, rank), train_step(twin, i, rank)
    persistent = [(n, p) for n, p in ours.module.named_parameters() if p.ds_persist]
    assert persistent and all(p.ds_status.name == "AVAILABLE" and p.numel() == p.ds_numel for _, p in persistent)
    # What OpenRLHF offloads for generation: everything but the 16-bit weights (lp_params).
    offload_states(ours, include=[State.optim_states, State.hp_params, State.lp_grads, State.contiguous_grad_buffer])
    assert released(ours, ("optim_states", "hp_params"))
    gone = [n for n, p in persistent if p.ds_status.name != "AVAILABLE" or p.untyped_storage().nbytes() == 0]
    assert not gone, f"persistent replicas released although lp_params was not included: {gone}"
    lp = ds_adapter.deepspeed_state(ours, include_grads=False, reshard=False)["lp_params"]
    assert all(t.untyped_storage().nbytes() > 0 for _, t in lp if t.numel()), "16-bit weights released"
    assert torch.equal(probe(ours), probe(twin)), "a forward with the 16-bit weights kept"
    reload_states(ours)
    both(ours, twin, range(2, 4), rank, "after offload_states without lp_params")
    # With lp_params the replicas go too (they are 16-bit weights); the next forward gathers them again.
    offload_states(ours, include=[State.lp_params])
    assert all(p.ds_status.name == "NOT_AVAILABLE" for _, p in persistent)
    reload_states(ours)
    both(ours, twin, range(4, 6), rank, "after offload_states with lp_params")


def test_offload_states_keeps_persistent_parameters_without_lp_params() -> None:
    # ZeRO-3 with DeepSpeed's default stage3_param_persistence_threshold (1e5): the norms, biases and the
    # embedding persist.
    run_ranks(check_persistent_parameters_kept, 1, timeout=300)


@pytest.mark.slow
@full_only
@pytest.mark.parametrize("stage", [1, 3])
def test_drop_ins_beside_deepspeeds_own_full(stage: int) -> None:
    # DeepSpeed's own stage-3 offload_states asserts FusedAdam (compiled on first use).
    run_ranks(check_drop_ins, 1, stage, stage == 3, timeout=600)


# -------------------------------------------------------------------------------------- verl slots


class DeepSpeedActorWorker(GpuOffloadSlotsMixin):
    """An OpenRLHF / verl style worker whose actor module is a DeepSpeed engine."""

    def __init__(self, engine: Any) -> None:
        self.actor_module = engine


def check_slots(rank: int, world_size: int) -> None:
    engine, twin = make_engine(3, True), make_engine(3, True)
    worker = DeepSpeedActorWorker(engine)
    train_step(engine, 0, rank), train_step(twin, 0, rank)
    worker.save_model_to_cpu(1)
    ref_v1 = probe(engine)
    train_step(engine, 1, rank), train_step(twin, 1, rank)
    worker.save_model_to_cpu(2)
    ref_v2 = probe(engine)
    # A slot is the weights' partitions only (the engine's module), not the optimizer state.
    names = list(worker.cpu_saved_models[1].tensors())
    with pytest.raises(go.OffloadError, match="deepspeed_zero3_module.*flat shards"):  # partitions: no state dict
        worker.cpu_saved_models[1].state_dict()
    assert any(n.endswith(".ds_tensor") for n in names) and not any("optimizer" in n for n in names), names
    worker.restore_model_from_cpu(1)
    assert torch.equal(probe(engine), ref_v1)
    worker.restore_model_from_cpu(2)
    assert torch.equal(probe(engine), ref_v2)
    both(engine, twin, range(2, 4), rank, "after the slots")
    worker.cpu_saved_models = {}


def test_verl_slots_over_a_deepspeed_actor() -> None:
    run_ranks(check_slots, 1, timeout=300)


# ------------------------------------------------------------------------------------- detection


def check_recorded_then_converted(rank: int, world_size: int) -> tuple[list[str], list[str], list[str]]:
    _forget_stale_groups()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from gpu_offload.adapters import named_tensors

    model = build_model(0, torch.float32)
    first = named_tensors(model)
    if go.torch_ext.ext is not None and go.torch_ext.ext.MODULE_TREE:
        # Served from its record although DeepSpeed is imported (not walked in Python again) ...
        assert named_tensors(model).names is first.names
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    # (zero.Init converts the parameters alone: the modules' dicts, which the record covers, stay as they were.)
    deepspeed.zero.Init(module=model, config_dict_or_path=config)
    # ... and, once ZeRO-3 converted its parameters in place, named as ZeRO-3 names them: the partitions.
    after = named_tensors(model)
    with go.snapshot(model) as snap:
        snapped = list(snap.names)
    return list(first.names), list(after.names), snapped


def test_a_recorded_module_that_zero3_converts_in_place_is_named_by_zero3() -> None:
    (result,) = run_ranks(check_recorded_then_converted, 1, timeout=300)
    plain, after, snapped = result
    assert not any(n.endswith(".ds_tensor") for n in plain)
    assert any(n.endswith(".ds_tensor") for n in after), after[:8]
    assert [n for n in after if n.endswith(".ds_tensor")] == [n for n in snapped if n.endswith(".ds_tensor")]


def test_detection_and_errors() -> None:
    plain = torch.nn.Linear(2, 2)
    assert not ds_adapter.is_deepspeed(plain) and not ds_adapter.is_deepspeed(torch.optim.SGD(plain.parameters()))
    with pytest.raises(go.OffloadError, match="not a DeepSpeed"):
        ds_adapter.deepspeed_shard_info(plain)
    with pytest.raises(go.OffloadError, match="DeepSpeedEngine"):
        offload_states(plain)

    class Odd(deepspeed.runtime.base_optimizer.DeepSpeedOptimizer):  # a wrapper this version does not know
        pass

    with pytest.raises(go.OffloadError, match=rf"DeepSpeed {deepspeed.__version__}.*not supported"):
        go.snapshot(Odd())
