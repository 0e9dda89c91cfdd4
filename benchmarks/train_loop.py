"""Host cost of the engine's calls in a training loop on the CPU: a plain module, or FSDP2 (one rank, gloo).

    .venv/bin/python benchmarks/train_loop.py [--kind module|fsdp2|both] [--tensors 4096] [--cycles 6]
                                              [--json out.json]

The model is host_cost.py's tree of nn.Linear(2, 2, bias=False) experts, 256 per block (each block a module
with a forward), with AdamW; for fsdp2, fully_shard on each block and on the root. Each cycle trains one
step first (forward, backward, optimizer step): the gradients are new tensors (zero_grad(set_to_none=True)
after each cycle, as most loops do), the optimizer state changes, and FSDP2 unshards and reshards every
parameter. Then it times, on [model, optimizer]: offload(grads=...) + reload under each grads policy, and
snapshot(include_grads=True) + wait + free. The copies cost almost nothing (the tensors are 16 bytes), so
what it prints is the engine's host work, in ms per cycle (median of the cycles after the first, and the
first), with the plan misses per cycle and how many of them were served a cached plan's layout (new
tensors laid out the same way: plan._rebound). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import host_cost  # noqa: E402

import gpu_offload as go  # noqa: E402
from gpu_offload import plan  # noqa: E402


def _cycles(model: torch.nn.Module, opt: torch.optim.Optimizer, call: Callable[[], None], cycles: int,
            drop: bool) -> dict[str, Any]:
    x = torch.randn(4, 2)
    times, misses, rebound = [], [], []
    for _ in range(cycles):
        model(x).sum().backward()
        opt.step()
        before = plan.cache_info()
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
        after = plan.cache_info()
        misses.append(after["misses"] - before["misses"])
        rebound.append(after.get("rebound", 0) - before.get("rebound", 0))  # (0: a version without it)
        opt.zero_grad(set_to_none=not drop)  # (dropped gradients come back zeroed, in place)
    steady = statistics.median(times[1:]) if len(times) > 1 else times[0]
    return {"first_ms": times[0], "median_ms": steady, "all_ms": times, "plan_misses": misses,
            "rebound": rebound}


def measure(kind: str, num_tensors: int, cycles: int) -> dict[str, Any]:
    model = (host_cost.make_fsdp2_module(num_tensors, "cpu") if kind == "fsdp2"
             else host_cost._Sharded(host_cost.make_module(num_tensors)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    target = [model, opt]
    out: dict[str, Any] = {}

    def snapshot() -> None:
        go.snapshot(target, include_grads=True).wait().free()

    calls: list[tuple[str, Callable[[], None], bool]] = [
        (f"grads={policy}", lambda policy=policy: (go.offload(target, grads=policy), go.reload(target)),
         policy == "drop") for policy in ("keep", "drop", "copy")]
    calls.append(("snapshot(include_grads=True)", snapshot, False))
    for name, call, drop in calls:
        row = out[name] = _cycles(model, opt, call, cycles, drop)
        print(f"{kind} {name}: {row['median_ms']:.1f} ms per cycle (first {row['first_ms']:.1f} ms; plan misses "
              f"per cycle {row['plan_misses']}, of them served a cached layout {row['rebound']})")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kind", choices=("module", "fsdp2", "both"), default="both")
    p.add_argument("--tensors", type=int, default=4096)
    p.add_argument("--cycles", type=int, default=6)
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args()
    results: dict[str, Any] = {"num_parameters": args.tensors, "torch": torch.__version__,
                               "load_average_start": os.getloadavg()}
    for kind in (("module", "fsdp2") if args.kind == "both" else (args.kind,)):
        results[kind] = measure(kind, args.tensors, args.cycles)
    results["load_average_end"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
