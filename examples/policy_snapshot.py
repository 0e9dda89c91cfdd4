"""Off-policy correction with a snapshot of the previous policy, and offloading around a rollout phase.

A plain PyTorch loop, shaped like an asynchronous ("one step off-policy") RL trainer:

* the rollout engine (vLLM/SGLang in real life; here a second copy of the network) generates a batch with
  the weights of the *previous* step, which it receives from a host snapshot (`snap.tensors()`);
* while it generates, the trainer's model and Adam state are offloaded (`go.offload([model, opt])`), so
  the accelerator memory is free for the engine; they are reloaded afterwards, bitwise unchanged;
* the trainer computes an importance ratio pi_current / pi_old for the batch: restore the old weights
  into the model, compute old log-probs, restore the current weights, compute current log-probs.

The task is a contextual bandit: a state is a random vector, the right action is a fixed function of it,
and the reward is 1 for the right action. The gradient comes from a clipped, importance-weighted policy
gradient surrogate with a mean-reward baseline; the loss printed is -mean(ratio * reward), the importance-
weighted estimate of minus the current policy's expected reward, which goes down as the policy learns.
At step 0 the previous policy is the current one, so the ratio is exactly 1; after that the restored old
weights give the same log-probs as the rollout engine (checked bitwise), and the ratio moves off 1.

Runs on the CPU in a few seconds (`--device cuda` on a GPU). The last line printed is a JSON summary.

    python examples/policy_snapshot.py [--steps 30] [--device cpu]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import torch
from torch import nn

import gpu_offload as go

STATE_DIM = 16
NUM_ACTIONS = 8


def make_policy(seed: int) -> nn.Module:
    """A small MLP from states to action logits."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(STATE_DIM, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, NUM_ACTIONS))


def log_probs(policy: nn.Module, states: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """log pi(action | state) for each row."""
    logp = torch.log_softmax(policy(states), dim=-1)
    return logp.gather(1, actions[:, None]).squeeze(1)


class Environment:
    """States are Gaussian vectors; the rewarded action is the argmax of a fixed random projection."""

    def __init__(self, device: torch.device, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.projection = torch.randn(STATE_DIM, NUM_ACTIONS, generator=g).to(device)
        self.generator = torch.Generator().manual_seed(seed + 1)
        self.device = device

    def states(self, n: int) -> torch.Tensor:
        return torch.randn(n, STATE_DIM, generator=self.generator).to(self.device)

    def reward(self, states: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return (actions == (states @ self.projection).argmax(-1)).float()


def rollout(engine: nn.Module, env: Environment, batch_size: int,
            generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The fake rollout phase: the engine samples one action per state with its own (stale) weights."""
    with torch.no_grad():
        states = env.states(batch_size)
        probs = torch.softmax(engine(states), dim=-1)
        actions = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(states.device)
    return {"states": states, "actions": actions, "rewards": env.reward(states, actions)}


def storage_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters hold on their device right now (0 while offloaded)."""
    return sum(p.untyped_storage().nbytes() for p in model.parameters())


def main() -> int:
    """Trains for --steps steps; prints one line per step, then the JSON summary; 0 on success."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)

    model = make_policy(seed=0).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    engine = copy.deepcopy(model)  # the rollout engine's own weights, synced from snapshots below
    env = Environment(device)
    sampler = torch.Generator().manual_seed(2)

    # The behaviour policy of the first batch is the initial policy itself.
    previous = go.snapshot(model)
    losses: list[float] = []
    ratios: list[dict[str, float]] = []
    moved: list[int] = []
    for step in range(args.steps):
        # --- rollout phase: the trainer's state leaves the device while the engine works -------------
        opt.zero_grad(set_to_none=True)  # gradients are dropped, not offloaded
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        go.offload([model, opt])
        assert go.is_offloaded(model) and storage_bytes(model) == 0
        moved.append(go.offloaded_bytes())
        engine.load_state_dict(previous.tensors())  # weight sync from host memory: the previous policy
        batch = rollout(engine, env, args.batch_size, sampler)
        go.reload([model, opt])
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "reload changed weights"

        # --- importance ratio against the previous policy ------------------------------------------
        current = go.snapshot(model)
        go.restore(model, previous)  # old weights, in place
        with torch.no_grad():
            old_logp = log_probs(model, batch["states"], batch["actions"])
        go.restore(model, current)  # back to the current weights before computing gradients
        with torch.no_grad():  # the restored weights are exactly those the engine sampled with
            assert torch.equal(old_logp, log_probs(engine, batch["states"], batch["actions"]))
        logp = log_probs(model, batch["states"], batch["actions"])
        ratio = torch.exp(logp - old_logp)

        # --- update ---------------------------------------------------------------------------------
        rewards = batch["rewards"]
        advantage = rewards - rewards.mean()
        surrogate = -(ratio.clamp(0.8, 1.2) * advantage).mean()
        surrogate.backward()
        opt.step()
        loss = -(ratio.detach() * rewards).mean().item()  # -(importance-weighted mean reward)
        losses.append(loss)
        r = ratio.detach()
        ratios.append({"mean": r.mean().item(), "min": r.min().item(), "max": r.max().item()})

        # The pre-update weights become the previous policy of the next step.
        previous.free()
        previous = current
        print(f"step {step:3d}  loss {loss:+.4f}  reward {rewards.mean().item():.3f}  ratio mean "
              f"{ratios[-1]['mean']:.6f} min {ratios[-1]['min']:.6f} max {ratios[-1]['max']:.6f}  "
              f"offloaded {moved[-1]} bytes")

    previous.free()
    if ratios[0]["min"] != 1.0 or ratios[0]["max"] != 1.0:
        print("error: the ratio at step 0 is not exactly 1", file=sys.stderr)
        return 1
    print(json.dumps({"losses": losses, "ratios": ratios, "offloaded_bytes": moved,
                      "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
