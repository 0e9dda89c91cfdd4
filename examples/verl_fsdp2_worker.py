"""A verl-style FSDP2 actor worker keeping numbered CPU copies of its weights for off-policy correction.

verl's fully-async trainer trains the actor for several local steps between two weight syncs to the
rollout engine, while the rollout keeps generating with the weights of the last sync (v1). To compute the
old log-probs of a batch under the policy that generated it, the trainer asks every actor rank to:

    local step 1:   save_model_to_cpu(1)                  # v1, the weights the rollout engine has
                    old_log_prob = compute_log_prob(batch)
    local step k>1: save_model_to_cpu(k)                  # the current weights, v_k
                    restore_model_from_cpu(1)             # back to v1 ...
                    old_log_prob = compute_log_prob(batch)
                    restore_model_from_cpu(k)             # ... and forward to v_k again
                    clear_cpu_model(k)

`ActorWorker` below stands in for verl's `ActorRolloutRefWorker` (no verl import): it holds an FSDP2
(`fully_shard`) Qwen2-shaped decoder at `self.actor_module_fsdp`, the attribute verl's fsdp2 worker uses,
and gets the three slot methods from `gpu_offload.integrations.verl.GpuOffloadSlotsMixin`: every rank
keeps only its own shards in the pinned arena, and no collective runs in save, restore or clear. In verl
the trainer calls these on the worker group and Ray runs them on every rank (`Dispatch.ONE_TO_ALL`); here
every rank simply runs the same sequence, which is what that dispatch amounts to.

Each rank checks, at every local step after the first, that restoring slot 1 reproduces v1's log-probs on
a fixed probe batch bitwise, and that restoring slot k reproduces v_k's; it prints the bytes each slot
keeps, then an OK line. The parent prints a JSON summary as the last line.

Runs on the CPU with 2 gloo ranks (torch.multiprocessing spawn, 127.0.0.1) in a few seconds:

    python examples/verl_fsdp2_worker.py [--world-size 2] [--windows 2] [--steps-per-window 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from gpu_offload.integrations.verl import GpuOffloadSlotsMixin

# Qwen2's architecture at toy size. Every dimension is even, so two ranks get equal shards with no padding.
VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 128, 64, 128, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
SEQ, BATCH = 16, 4


# ---------------------------------------------------------------------------------------------- model


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Layer(nn.Module):
    """One decoder layer: grouped-query attention with q/k/v biases and RoPE, then a SwiGLU MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(HIDDEN)
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.post_attention_layernorm = RMSNorm(HIDDEN)
        self.gate_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.up_proj = nn.Linear(HIDDEN, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, HIDDEN, bias=False)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-second, first), dim=-1) * sin

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.input_layernorm(x)
        q = self._rope(self.q_proj(h).view(b, s, HEADS, HEAD_DIM).transpose(1, 2), cos, sin)
        k = self._rope(self.k_proj(h).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2), cos, sin)
        v = self.v_proj(h).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, s, HIDDEN))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyQwen2(nn.Module):
    """Token embedding, decoder layers, final norm, lm_head tied to the embedding (as in small Qwen2s)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.lm_head.weight = self.embed_tokens.weight
        # A non-persistent buffer like Qwen2's rotary inv_freq: replicated, not sharded, kept in each slot too.
        self.register_buffer("inv_freq", 1.0 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM),
                             persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        angles = torch.outer(torch.arange(ids.shape[1], dtype=torch.float32), self.inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def full_param_bytes() -> int:
    """Bytes of the unsharded model's unique parameters (the tied weight counted once)."""
    return sum(p.numel() * p.element_size() for p in TinyQwen2().parameters())


def buffer_bytes() -> int:
    return sum(b.numel() * b.element_size() for b in TinyQwen2().buffers())


# --------------------------------------------------------------------------------------------- worker


class ActorWorker(GpuOffloadSlotsMixin):
    """Stands in for verl's ActorRolloutRefWorker (fsdp2 strategy).

    In verl the slot methods would be re-exported with verl's decorator so that Ray calls them on every
    rank, e.g. ``save_model_to_cpu = register(dispatch_mode=Dispatch.ONE_TO_ALL)(
    GpuOffloadSlotsMixin.save_model_to_cpu)``; the mixin finds the module at ``actor_module_fsdp``.
    """

    def __init__(self, rank: int, world_size: int, lr: float) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.rank = rank
        mesh = init_device_mesh("cpu", (world_size,))
        torch.manual_seed(0)  # every rank starts from the same weights, as loading a checkpoint would
        model = TinyQwen2()
        for layer in model.layers:  # each decoder layer is its own FSDP2 unit, as verl wraps them
            fully_shard(layer, mesh=mesh)
        self.actor_module_fsdp = fully_shard(model, mesh=mesh)
        self.actor_optimizer = torch.optim.AdamW(self.actor_module_fsdp.parameters(), lr=lr)

    def compute_log_prob(self, ids: torch.Tensor) -> torch.Tensor:
        """log pi(token t+1 | tokens <= t) for every position, without gradients (verl's old log-prob)."""
        with torch.no_grad():
            return self._log_prob(ids)

    def _log_prob(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.actor_module_fsdp(ids)[:, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    def update_actor(self, ids: torch.Tensor, old_log_prob: torch.Tensor,
                     advantages: torch.Tensor) -> dict[str, float]:
        """One importance-weighted policy-gradient step (gradients are reduce-scattered by FSDP2)."""
        log_prob = self._log_prob(ids)
        ratio = torch.exp(log_prob - old_log_prob)
        loss = -(ratio.clamp(0.8, 1.2) * advantages[:, None]).mean()
        loss.backward()
        self.actor_optimizer.step()
        self.actor_optimizer.zero_grad(set_to_none=True)
        r = ratio.detach()
        return {"loss": loss.item(), "ratio_mean": r.mean().item(), "ratio_min": r.min().item(),
                "ratio_max": r.max().item()}


# ---------------------------------------------------------------------------------------------- ranks


def rollout_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the rollout engine would hand this rank: token ids and one advantage per sequence."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randn(BATCH, generator=g)


def say(line: str) -> None:
    """One line in one write: the ranks share the parent's stdout, and print() writes the newline apart."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def run_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """The trainer's sequence of worker calls on one rank; raises if a restore is not bitwise exact."""
    worker = ActorWorker(rank, world_size, args.lr)
    probe = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(999))
    steps: list[dict[str, Any]] = []
    restores_checked = 0
    global_step = 0
    for window in range(args.windows):
        # A window ends with a weight sync to the rollout engine: its weights are v1 of the next window.
        for local_step in range(1, args.steps_per_window + 1):
            ids, advantages = rollout_batch(global_step, rank)
            if local_step == 1:
                worker.save_model_to_cpu(1)
                old_log_prob = worker.compute_log_prob(ids)
                probe_v1 = worker.compute_log_prob(probe)  # the reference every later restore must reproduce
                slot_bytes = worker.cpu_saved_models[1].nbytes
            else:
                probe_vk = worker.compute_log_prob(probe)
                worker.save_model_to_cpu(local_step)
                slot_bytes = worker.cpu_saved_models[local_step].nbytes
                worker.restore_model_from_cpu(1)
                old_log_prob = worker.compute_log_prob(ids)
                if not torch.equal(worker.compute_log_prob(probe), probe_v1):
                    raise AssertionError(f"rank {rank}: restoring slot 1 at step {global_step} does not reproduce "
                                         "v1's log-probs bitwise")
                worker.restore_model_from_cpu(local_step)
                if not torch.equal(worker.compute_log_prob(probe), probe_vk):
                    raise AssertionError(f"rank {rank}: restoring slot {local_step} at step {global_step} does not "
                                         "reproduce its log-probs bitwise")
                if torch.equal(probe_vk, probe_v1):
                    raise AssertionError(f"rank {rank}: training did not change the weights by step {global_step}")
                worker.clear_cpu_model(local_step)
                restores_checked += 1
            stats = worker.update_actor(ids, old_log_prob, advantages)
            steps.append({"window": window, "local_step": local_step, "slot_bytes": slot_bytes, **stats})
            say(f"rank {rank}: window {window} local step {local_step}: slot {local_step} keeps {slot_bytes} bytes; "
                f"ratio mean {stats['ratio_mean']:.6f} min {stats['ratio_min']:.6f} max {stats['ratio_max']:.6f}; "
                f"loss {stats['loss']:+.5f}")
            global_step += 1
        worker.clear_cpu_model(1)  # the weight sync: slot 1 is taken again at the next window's first step
    if worker.cpu_saved_models:
        raise AssertionError(f"rank {rank}: slots left after clearing: {sorted(worker.cpu_saved_models)}")
    say(f"rank {rank}: OK: {restores_checked} restores of v1 reproduced its log-probs bitwise; "
        f"each slot kept {steps[0]['slot_bytes']} bytes on this rank")
    return {"rank": rank, "slot_bytes": steps[0]["slot_bytes"], "restores_checked": restores_checked, "steps": steps}


def _rank_main(rank: int, world_size: int, port: int, args: argparse.Namespace, results: Any) -> None:
    # The ranks share the machine's cores: one intra-op thread each keeps them from oversubscribing it.
    torch.set_num_threads(1)
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
    """A TCP port that was free a moment ago on 127.0.0.1 (the process group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    """Spawns the ranks, prints their lines, then a JSON summary; 0 when every rank's checks passed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--windows", type=int, default=2, help="weight-sync windows")
    parser.add_argument("--steps-per-window", type=int, default=3, help="local steps between two syncs (>= 2)")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    if args.steps_per_window < 2:
        parser.error("--steps-per-window must be at least 2 (step 1 only saves v1)")

    results = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(_rank_main, args=(args.world_size, free_port(), args, results), nprocs=args.world_size, join=True)
    except mp.ProcessRaisedException as exc:
        print(f"error: a rank failed:\n{exc}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as exc:
        print(f"error: a rank exited: {exc}", file=sys.stderr)
        return 1
    by_rank = {}
    while not results.empty():
        r = results.get()
        by_rank[r["rank"]] = r
    ranks = [by_rank[r] for r in range(args.world_size)]
    print(json.dumps({"ok": True, "world_size": args.world_size, "full_param_bytes": full_param_bytes(),
                      "buffer_bytes": buffer_bytes(), "ranks": ranks}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
