"""Threads: several threads snapshot, restore, offload and reload different models at once, sharing one
arena, for as long as asked; every value is checked bitwise after every step.

    python benchmarks/stress_threads.py --seconds 300              # the long run (CPU)
    python benchmarks/stress_threads.py --seconds 300 --device cuda

tests/test_faults.py runs the same `stress()` for a few seconds. Exit status 1 on any wrong value or error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
import traceback
from typing import Any, Optional

import torch

import gpu_offload as go


def _bits(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().reshape(-1).view(torch.uint8).clone() for t in tensors]


def _same(tensors: list[torch.Tensor], expected: list[torch.Tensor]) -> bool:
    return all(torch.equal(t.detach().reshape(-1).view(torch.uint8), e) for t, e in zip(tensors, expected))


def _worker(index: int, seconds: float, device: torch.device, width: int, depth: int, arena: go.Arena,
            barrier: threading.Barrier, report: dict[str, Any], min_steps: int = 0) -> None:
    torch.manual_seed(index)
    # Different models per thread: other widths, so their layouts (and cached plans) differ.
    w = width + 16 * index
    model = torch.nn.Sequential(*[torch.nn.Linear(w, w) for _ in range(depth)]).to(device)
    params = list(model.parameters())
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    counts = {"snapshots": 0, "restores": 0, "offloads": 0, "wrong": 0}
    report[f"thread{index}"] = counts
    try:
        barrier.wait()
        deadline = time.monotonic() + seconds
        step = 0
        while time.monotonic() < deadline or step < min_steps:  # at least min_steps rounds, however slow
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                expected = _bits(params)
                checksum = step % 2 == 0
                snap = go.snapshot(model, arena=arena, checksum=checksum)
                counts["snapshots"] += 1
                with torch.no_grad():
                    torch._foreach_mul_(params, -1.5)
                go.restore(model, snap, verify=checksum)
                counts["restores"] += 1
                counts["wrong"] += not _same(params, expected)
                if step % 3 == 0:
                    go.offload(model, arena=arena)
                    go.reload(model)
                    counts["offloads"] += 1
                    counts["wrong"] += not _same(params, expected)
                snap.free()
                with torch.no_grad():  # new values for the next round
                    torch._foreach_add_(params, 0.25)
            step += 1
    except BaseException:
        report.setdefault("errors", []).append(f"thread {index}: {traceback.format_exc()}")


def stress(seconds: float = 300.0, *, device: str = "cpu", threads: int = 2, width: int = 256, depth: int = 6,
           arena: Optional[go.Arena] = None, min_steps: int = 0) -> dict[str, Any]:
    """Runs the threads for `seconds` (and at least `min_steps` rounds each); returns per-thread counts,
    errors and the arena's state after."""
    dev = torch.device(device)
    arena = arena if arena is not None else go.Arena(min_slab_bytes=16 << 20)
    report: dict[str, Any] = {"seconds": seconds, "device": device, "num_threads": threads}
    barrier = threading.Barrier(threads)
    workers = [threading.Thread(target=_worker, name=f"stress-{i}",
                                args=(i, seconds, dev, width, depth, arena, barrier, report, min_steps))
               for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    report["arena_used_bytes_after"] = arena.used_bytes
    report["offloaded_bytes_after"] = go.offloaded_bytes()
    report["wrong"] = sum(v["wrong"] for k, v in report.items() if k.startswith("thread") and isinstance(v, dict))
    report["ok"] = (not report.get("errors") and report["wrong"] == 0 and report["arena_used_bytes_after"] == 0
                    and report["offloaded_bytes_after"] == 0)
    return report


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=6)
    args = parser.parse_args(argv)
    report = stress(args.seconds, device=args.device, threads=args.threads, width=args.width, depth=args.depth)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
