"""An OpenRLHF-style DeepSpeed ZeRO actor: offload around the rollout, importance ratio from the old policy.

Each step of the loop, as a colocated PPO / GRPO trainer does it:

* rollout: the actor engine's weights, fp32 masters and Adam state leave the device
  (`offload_states(actor)`, the drop-in for DeepSpeed's `actor.offload_states()`), so vLLM could use the
  memory; a batch is "generated" (here: drawn); `reload_states(actor)` brings everything back, bitwise;
* old log-probs: the weights of the policy that generated the batch are kept as a snapshot of the actor's
  module (for ZeRO-3: each rank's partitions only); restore it, compute, restore the current weights;
* train: a clipped, importance-weighted token-level surrogate (a toy reward: tokens below vocab/2 are good).

At step 0 the old policy is the current one, so the ratio is exactly 1; afterwards it moves off 1.

Runs on the CPU (DS_ACCELERATOR=cpu, one gloo rank) in some seconds once DeepSpeed's op is compiled (its
first initialize compiles a small op, about a minute). The last line printed is a JSON summary.

    python examples/deepspeed_offload.py [--stage 3] [--steps 4] [--bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import gpu_offload as go  # noqa: E402
from gpu_offload.adapters.deepspeed import deepspeed_state  # noqa: E402
from gpu_offload.integrations.deepspeed import offload_states, reload_states  # noqa: E402

VOCAB, HIDDEN, SEQ, BATCH = 64, 32, 8, 4
# The MLP's matrices are wider than DeepSpeed's default stage3_param_persistence_threshold (1e5 elements), so
# ZeRO-3 partitions them and keeps the small parameters (embedding, norm, biases) whole on every rank.
WIDE = 3200


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mlp = nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, WIDE), nn.GELU(), nn.Linear(WIDE, HIDDEN))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.head(x + self.mlp(x))


def token_logp(actor, ids: torch.Tensor) -> torch.Tensor:
    """log pi(next token | token) for every position but the last."""
    logp = torch.log_softmax(actor(ids[:, :-1]).float(), dim=-1)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=3, choices=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    import deepspeed

    torch.manual_seed(0)
    model = Policy().to(torch.bfloat16 if args.bf16 else torch.float32)
    config = {
        "train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},  # DeepSpeed's default persistence threshold
        "bf16": {"enabled": args.bf16},
    }
    actor, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    gen = torch.Generator().manual_seed(1)
    old_policy = go.snapshot(actor.module)  # the weights the rollout engine generates with
    steps = []
    for step in range(args.steps):
        # Rollout: free the device for the generation engine, then bring the actor back.
        with torch.no_grad():
            probe_ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(99))
            before = actor(probe_ids).float().clone()
        offload_states(actor)
        cats = deepspeed_state(actor, include_grads=False, reshard=False)
        held = sum(t.untyped_storage().nbytes() for c in ("lp_params", "hp_params", "optim_states") for _, t in cats[c])
        offloaded = go.offloaded_bytes()
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)  # what vLLM would have generated
        reload_states(actor)
        with torch.no_grad():
            same = bool(torch.equal(actor(probe_ids).float(), before))

        # Old log-probs from the policy that generated the batch, then back to the current weights.
        current = go.snapshot(actor.module)
        go.restore(actor.module, old_policy)
        with torch.no_grad():
            old_logp = token_logp(actor, ids)
        go.restore(actor.module, current)

        # Train: clipped importance-weighted surrogate with a toy per-token reward.
        logp = token_logp(actor, ids)
        ratio = torch.exp(logp - old_logp)
        reward = (ids[:, 1:] < VOCAB // 2).float()
        advantage = reward - reward.mean()
        loss = -torch.min(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage).mean()
        actor.backward(loss)
        actor.step()

        old_policy.free()
        old_policy = current  # the weights this step's batch came from are the next step's old policy
        r = ratio.detach()
        record = {"step": step, "loss": loss.item(), "ratio_mean": r.mean().item(), "ratio_min": r.min().item(),
                  "ratio_max": r.max().item(), "offloaded_bytes": offloaded, "held_after_offload": held,
                  "bitwise_after_reload": same}
        steps.append(record)
        print(f"step {step}: offloaded {offloaded} bytes (held {held}), reload bitwise {same}; ratio mean "
              f"{record['ratio_mean']:.6f} min {record['ratio_min']:.6f} max {record['ratio_max']:.6f}", flush=True)
    old_policy.free()
    ok = all(s["bitwise_after_reload"] and s["held_after_offload"] == 0 and s["offloaded_bytes"] > 0 for s in steps)
    dist.destroy_process_group()
    print(json.dumps({"ok": ok, "stage": args.stage, "bf16": args.bf16, "deepspeed": deepspeed.__version__,
                      "steps": steps}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
