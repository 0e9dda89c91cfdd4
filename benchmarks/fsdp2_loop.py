"""Host cost of offload([model, optimizer]) + reload in an FSDP2 training loop on the CPU (one rank, gloo).

    .venv/bin/python benchmarks/fsdp2_loop.py [--tensors 4096] [--cycles 6] [--json out.json]

The model is host_cost.py's tree of nn.Linear(2, 2, bias=False) experts, 256 per block, with fully_shard on
each block and on the root, and AdamW. Each cycle trains one step first (forward, backward, optimizer step):
FSDP2 unshards and reshards every parameter, the gradients are new tensors, the optimizer state changes.
Then it times offload([model, optimizer], grads=...) + reload, under each grads policy. The copies cost
almost nothing (the tensors are 16 bytes), so what it prints is the engine's host work, in ms per cycle
(median of the cycles after the first, and the first). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import host_cost  # noqa: E402

import gpu_offload as go  # noqa: E402
from gpu_offload import plan  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tensors", type=int, default=4096)
    p.add_argument("--cycles", type=int, default=6)
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args()
    model = host_cost.make_fsdp2_module(args.tensors, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 2)
    results: dict[str, Any] = {"num_parameters": args.tensors, "torch": torch.__version__,
                               "load_average_start": os.getloadavg()}
    for policy in ("keep", "drop", "copy"):
        times, misses = [], []
        for _ in range(args.cycles):
            model(x).sum().backward()
            opt.step()
            before = plan.cache_info()["misses"]
            t0 = time.perf_counter()
            go.offload([model, opt], grads=policy)
            go.reload([model, opt])
            times.append((time.perf_counter() - t0) * 1e3)
            misses.append(plan.cache_info()["misses"] - before)
            opt.zero_grad(set_to_none=policy != "drop")  # (dropped gradients come back zeroed, in place)
        steady = statistics.median(times[1:]) if len(times) > 1 else times[0]
        results[policy] = {"first_ms": times[0], "median_ms": steady, "all_ms": times, "plan_misses": misses}
        print(f"grads={policy}: {steady:.1f} ms per cycle (first {times[0]:.1f} ms; plan misses per cycle {misses})")
    results["load_average_end"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
