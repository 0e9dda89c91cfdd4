"""Ray actors holding FSDP2 shards, offloading and reloading them on command from a driver.

This is how verl places its training workers: one Ray actor per rank, the actors placed through a
placement group (one bundle per rank), rank 0 publishing the rendezvous address, every rank joining one
process group and holding its FSDP2 (`fully_shard`) shard of the model and of the optimizer state. Between
training steps the driver tells every rank to offload (its shards leave the device, the memory is freed),
runs whatever needs the memory (rollout), and tells them to reload.

On the CPU (the default, what CI runs) the process group is gloo and the mesh is a CPU DeviceMesh; with
`--device cuda` each actor takes one GPU, the backend is NCCL and the mesh a CUDA DeviceMesh. With
`--address` the driver joins an existing cluster (`ray start --head` on one node, `ray start
--address=HEAD:6379` on the others) instead of starting a local instance; see docs/ray.md.

The driver checks, per rank: that after offload every local shard holds no memory, that the bytes
offloaded equal a snapshot's `nbytes` for the same target, and that after reload the shards are bitwise
equal to what they were before. The last line printed is a JSON summary.

    python examples/ray_fsdp2_offload.py [--world-size 2] [--device cpu|cuda] [--address auto]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Any, Optional

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from torch import nn

VOCAB, DIM, HIDDEN, LAYERS = 128, 64, 256, 2


class Block(nn.Module):
    """A pre-norm residual MLP block: the unit each `fully_shard` call shards."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """A small residual language model; every rank builds it with the same seed, FSDP2 then shards it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def full_param_bytes() -> int:
    """Bytes of the unsharded model's parameters (float32)."""
    return sum(p.numel() * p.element_size() for p in TinyLM().parameters())


class FSDPWorker:
    """One rank: a process-group member holding its FSDP2 shard of TinyLM and of AdamW's state."""

    def __init__(self, rank: int, world_size: int, device: str) -> None:
        # Ranks share the node's cores; one intra-op thread each keeps them from oversubscribing it.
        torch.set_num_threads(1)
        self.rank, self.world_size, self.device_type = rank, world_size, device
        self.model: Optional[nn.Module] = None
        self.opt: Optional[torch.optim.Optimizer] = None

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: this node's address and a free port for the process group's store."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, master_addr: str, master_port: int) -> dict[str, Any]:
        """Joins the process group (gloo on the CPU, NCCL on GPUs) and builds the sharded model."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if self.device_type == "cuda":
            # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU: it is device 0 here.
            torch.cuda.set_device(0)
        backend = "nccl" if self.device_type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
                                world_size=self.world_size)
        mesh = init_device_mesh(self.device_type, (self.world_size,))
        torch.manual_seed(0)  # the same initial weights on every rank, as loading a checkpoint would give
        model = TinyLM().to(self.device_type)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        self.model = fully_shard(model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        return {"rank": self.rank, "backend": backend, "node": ray.util.get_node_ip_address(),
                "pid": os.getpid()}

    def train_step(self, step: int) -> float:
        """One data-parallel step on this rank's batch (gradients are reduce-scattered by FSDP2)."""
        assert self.model is not None and self.opt is not None
        g = torch.Generator().manual_seed(1000 * step + self.rank)
        ids = torch.randint(0, VOCAB, (4, 16), generator=g).to(self.device_type)
        logits = self.model(ids)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)  # gradients are dropped before offloading, as trainers do
        return loss.item()

    def _local_params(self) -> dict[str, torch.Tensor]:
        assert self.model is not None
        return {name: p.to_local() for name, p in self.model.named_parameters()}

    def shard_state(self) -> dict[str, Any]:
        """This rank's local shards (as CPU byte tensors, for a bitwise comparison in the driver) and the
        device bytes its parameter shards and optimizer state hold right now."""
        assert self.opt is not None
        params = self._local_params()
        storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in params.values()}
        opt_state = [v for s in self.opt.state.values() for v in s.values() if torch.is_tensor(v)]
        opt_storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in
                        (getattr(v, "_local_tensor", v) for v in opt_state)}
        return {
            "params": {n: t.detach().reshape(-1).view(torch.uint8).cpu().clone() for n, t in params.items()
                       if t.untyped_storage().nbytes()},
            "param_storage_bytes": sum(storages.values()),
            "optimizer_storage_bytes": sum(opt_storages.values()),
        }

    def snapshot_nbytes(self) -> int:
        """What a snapshot of this rank's [model, optimizer] carries (freed at once)."""
        import gpu_offload as go

        with go.snapshot([self.model, self.opt]) as snap:
            return snap.nbytes

    def offload(self) -> dict[str, Any]:
        """Moves this rank's shards and optimizer state to host memory; reports bytes and what is left."""
        import gpu_offload as go

        start = time.perf_counter()
        go.offload([self.model, self.opt])
        seconds = time.perf_counter() - start
        state = self.shard_state()
        return {"offloaded_bytes": go.offloaded_bytes(), "is_offloaded": go.is_offloaded([self.model, self.opt]),
                "param_storage_bytes": state["param_storage_bytes"],
                "optimizer_storage_bytes": state["optimizer_storage_bytes"], "seconds": seconds}

    def reload(self) -> dict[str, Any]:
        """Brings them back into the same storages."""
        import gpu_offload as go

        start = time.perf_counter()
        go.reload([self.model, self.opt])
        return {"offloaded_bytes": go.offloaded_bytes(), "is_offloaded": go.is_offloaded([self.model, self.opt]),
                "seconds": time.perf_counter() - start}

    def close(self) -> None:
        """Leaves the process group."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> int:
    """Drives the ranks through train, offload, reload, train; prints per-rank lines and a JSON summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--address", default=None,
                        help="an existing Ray cluster ('auto' or HEAD:6379); default: start a local instance")
    parser.add_argument("--steps", type=int, default=2, help="training steps before and after the round trip")
    args = parser.parse_args()

    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.world_size, include_dashboard=False, log_to_driver=True)
    workers: list[Any] = []
    pg = None
    try:
        # One bundle per rank, as verl's resource pools do; PACK keeps ranks on as few nodes as possible.
        bundle = {"CPU": 1, "GPU": 1} if args.device == "cuda" else {"CPU": 1}
        pg = placement_group([dict(bundle) for _ in range(args.world_size)], strategy="PACK")
        ray.get(pg.ready(), timeout=120)
        actor = ray.remote(num_cpus=1, num_gpus=1 if args.device == "cuda" else 0)(FSDPWorker)
        workers = [
            actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=rank)).remote(rank, args.world_size, args.device)
            for rank in range(args.world_size)
        ]
        addr, port = ray.get(workers[0].rendezvous.remote())
        for info in ray.get([w.setup.remote(addr, port) for w in workers]):
            print(f"rank {info['rank']}: {info['backend']} on node {info['node']} (pid {info['pid']})")

        def all_ranks(method: str, *a: Any) -> list[Any]:
            return ray.get([getattr(w, method).remote(*a) for w in workers])

        losses = [all_ranks("train_step", s) for s in range(args.steps)]
        before = all_ranks("shard_state")
        snap_bytes = all_ranks("snapshot_nbytes")
        off = all_ranks("offload")
        # ... the devices are free here: the driver would now run rollout on them ...
        back = all_ranks("reload")
        after = all_ranks("shard_state")
        losses += [all_ranks("train_step", s) for s in range(args.steps, 2 * args.steps)]
        all_ranks("close")

        ok = True
        ranks = []
        for rank in range(args.world_size):
            b, a, o, r = before[rank], after[rank], off[rank], back[rank]
            bitwise = b["params"].keys() == a["params"].keys() and all(
                torch.equal(b["params"][n], a["params"][n]) for n in b["params"])
            freed = o["param_storage_bytes"] == 0 and o["optimizer_storage_bytes"] == 0
            device_bytes = b["param_storage_bytes"] + b["optimizer_storage_bytes"]
            ok &= bitwise and freed and o["is_offloaded"] and not r["is_offloaded"] and r["offloaded_bytes"] == 0
            ok &= o["offloaded_bytes"] == snap_bytes[rank] == device_bytes
            print(f"rank {rank}: offloaded {o['offloaded_bytes']} bytes (snapshot nbytes {snap_bytes[rank]}; "
                  f"params {b['param_storage_bytes']}, optimizer {b['optimizer_storage_bytes']}) in "
                  f"{o['seconds'] * 1e3:.1f} ms; held after offload: {o['param_storage_bytes']} + "
                  f"{o['optimizer_storage_bytes']} bytes; reloaded in {r['seconds'] * 1e3:.1f} ms; "
                  f"bitwise equal after reload: {bitwise}")
            ranks.append({"rank": rank, "offloaded_bytes": o["offloaded_bytes"], "snapshot_nbytes": snap_bytes[rank],
                          "param_storage_bytes": b["param_storage_bytes"],
                          "optimizer_storage_bytes": b["optimizer_storage_bytes"],
                          "held_after_offload": o["param_storage_bytes"] + o["optimizer_storage_bytes"],
                          "offloaded_after_reload": r["offloaded_bytes"], "bitwise_equal": bitwise})
        print("losses by step (per rank):", [[round(x, 4) for x in step] for step in losses])
        print(json.dumps({"ok": bool(ok), "world_size": args.world_size, "device": args.device,
                          "full_param_bytes": full_param_bytes(), "ranks": ranks, "losses": losses}))
        return 0 if ok else 1
    finally:
        for w in workers:
            ray.kill(w)
        if pg is not None:
            remove_placement_group(pg)
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
