"""A training loop that checkpoints asynchronously with torch.distributed.checkpoint through the arena.

FSDP2 (`fully_shard`) on gloo ranks (CPU). Every `--every` steps the model and AdamW state
(`get_state_dict(model, optimizer)`) are saved with `dcp.async_save(..., async_stager=ArenaStager())`:
the stage is one batched copy of the rank's shards into gpu_offload's arena, the write runs in DCP's
background thread while training goes on, and the next save reuses the same arena memory (the lines
printed show the arena's capacity and the slabs it ever allocated: flat after the first save). The
checkpoint collectives run on a process group of their own, so that they never interleave with the
training's. At the end, a freshly built model and optimizer load the last checkpoint, and their state is
checked to be bitwise the state at the moment of that save, although training had moved on meanwhile.

On GPUs the same code runs with a `cpu:gloo,cuda:nccl` process group and the model on CUDA: the stage is
then a batched device-to-host copy at the link's speed into pinned memory that is pinned once.

    python examples/async_checkpoint.py [--world-size 2] [--steps 12] [--every 3] [--dir DIR]

The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import socket
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gpu_offload as go
from gpu_offload.checkpoint import ArenaStager

WIDTH = 128
DEPTH = 4


def build(world_size: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An MLP whose layers are FSDP2 units, and its AdamW."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(WIDTH, 1))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> float:
    """One step of regression onto a fixed smooth function of the input."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(64, WIDTH, generator=g)
    y = torch.sin(x[:, :8].sum(dim=1, keepdim=True))
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state with every shard gathered (a collective), as plain CPU tensors."""
    def gather(obj: Any) -> Any:
        if hasattr(obj, "full_tensor"):
            return obj.full_tensor().detach().clone()
        if isinstance(obj, torch.Tensor):
            return obj.detach().clone()
        if isinstance(obj, dict):
            return {k: gather(v) for k, v in obj.items()}
        return obj

    msd, osd = get_state_dict(model, opt)
    return {"model": gather(msd), "optim": gather(osd["state"])}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                         b.reshape(-1).view(torch.uint8))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def say(line: str) -> None:
    """One line in one write: the ranks share the parent's stdout."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def run_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    model, opt = build(world_size, seed=0)
    ckpt_group = dist.new_group(backend="gloo")  # checkpoint collectives beside the training's
    stager = ArenaStager()  # the default arena: pinned once (on a GPU), reused by every save
    arena = stager.arena
    pending: Any = None
    saves: list[dict[str, Any]] = []
    losses: list[float] = []
    expected: dict[str, Any] = {}
    last_path = ""
    for step in range(args.steps):
        if step > 0 and step % args.every == 0:
            if pending is not None:
                pending.result()  # the previous checkpoint is written before the next one starts
            expected = full_state(model, opt)  # for the check at the end only
            last_path = f"{args.dir}/step{step:05d}"
            msd, osd = get_state_dict(model, opt)
            start = time.perf_counter()
            pending = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=last_path, async_stager=stager,
                                     process_group=ckpt_group)
            staged_ms = (time.perf_counter() - start) * 1e3
            stats = arena.stats()
            saves.append({"step": step, "staged_bytes": stager.staged_bytes, "arena_capacity": stats["capacity_bytes"],
                          "slab_allocations": stats["num_slab_allocations"]})
            say(f"rank {rank}: step {step}: checkpoint of {stager.staged_bytes} bytes staged in {staged_ms:.1f} ms, "
                f"writing in the background; arena {stats['capacity_bytes']} bytes, "
                f"{stats['num_slab_allocations']} slab(s) ever allocated")
        losses.append(train_step(model, opt, step, rank))  # goes on while the checkpoint is written
    if pending is not None:
        pending.result()
    stager.close()

    # A fresh model and optimizer (another initialisation) load the last checkpoint.
    fresh, fresh_opt = build(world_size, seed=1)
    train_step(fresh, fresh_opt, 0, rank)  # so that AdamW has state to load into
    msd, osd = get_state_dict(fresh, fresh_opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=last_path, process_group=ckpt_group)
    set_state_dict(fresh, fresh_opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    verified = same(full_state(fresh, fresh_opt), expected)
    changed = not same(full_state(model, opt), expected)
    if not verified:
        raise AssertionError(f"rank {rank}: the checkpoint loaded from {last_path} is not the state at its save")
    say(f"rank {rank}: OK: {last_path} loaded into a fresh model is bitwise the state at its save "
        f"(training had moved on since: {changed})")
    return {"rank": rank, "saves": saves, "losses": losses, "verified": verified, "changed_since": changed}


def _rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace, results: Any) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        results.put(run_rank(rank, world_size, args))
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})
        raise
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3, help="checkpoint every this many steps")
    parser.add_argument("--dir", default=None, help="checkpoint folder (default: a temporary one, removed after)")
    args = parser.parse_args()
    if args.every < 1 or args.steps <= args.every:
        parser.error("--steps must be larger than --every (at least one checkpoint)")
    temporary = args.dir is None
    if temporary:
        args.dir = tempfile.mkdtemp(prefix="async_checkpoint_")
    results = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(_rank_main, args=(args.world_size, free_port(), args, results), nprocs=args.world_size, join=True)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        print(f"error: a rank failed:\n{exc}", file=sys.stderr)
        return 1
    finally:
        if temporary:
            shutil.rmtree(args.dir, ignore_errors=True)
    by_rank = {}
    while not results.empty():
        r = results.get()
        by_rank[r["rank"]] = r
    print(json.dumps({"ok": True, "world_size": args.world_size, "version": go.__version__,
                      "ranks": [by_rank[r] for r in range(args.world_size)]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
