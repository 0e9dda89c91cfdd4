"""Soak: many cycles of snapshot/restore/offload/reload/free on a mid-size model, watching for leaks.

Each cycle takes a snapshot with checksums, perturbs the weights, restores with verify=True, offloads the
model and its optimizer, reloads them and frees the snapshot; the values are compared bitwise with the
originals every `--check-every` cycles and at the end. After every cycle it records host RSS, the arena's
used and pinned (capacity) bytes, slabs ever created, bytes still offloaded, cached plans and, on a GPU,
torch.cuda.memory_allocated / memory_reserved. Each series must stay flat within --tolerance (1%) of its
value at the end of warm-up. It also measures what checksum=True adds to a snapshot.

    python benchmarks/soak.py                                   # 1000 cycles on the CPU, figures to stdout
    python benchmarks/soak.py --mmap-threshold 0                # with glibc's dynamic mmap threshold
    python benchmarks/soak.py --device cuda --json benchmarks/results/soak-h200-$(date +%F).json

tests/test_soak.py runs the same `soak()` for 50 cycles. Exit status 1 when a series is not flat or a
value came back wrong.

Figures per series, over the cycles after warm-up: "drift" = largest distance from the value at the end of
warm-up relative to it (what the tolerance applies to), "band" = (max - min) relative to it, and
"trend_per_1000_cycles" = least-squares slope (a leak shows as a steady positive slope; noise does not).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Optional

import torch

import gpu_offload as go
from gpu_offload import plan as _plan

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Resident set size of this process, from /proc (no dependency)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def build_model(device: torch.device, width: int, depth: int, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A stack of Linear + LayerNorm layers and an AdamW with its state filled by one step."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width)]
    model = torch.nn.Sequential(*layers).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width, device=device)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p for p in model.parameters()] + [t for s in opt.state.values() for t in s.values()
                                                if isinstance(t, torch.Tensor)]
    return tensors


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.detach().reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
               for x, y in zip(a, b))


def sample(arena: go.Arena, device: torch.device) -> dict[str, int]:
    """The figures that must stay flat, taken between cycles, once the device has finished the cycle's copies
    (a freed snapshot's region returns to the arena when the copies that read it have ended: read before
    that, the arena's use alternated between 0 and one snapshot from cycle to cycle on the H200)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stats = arena.stats()
    out = {
        "rss_bytes": rss_bytes(),
        "arena_used_bytes": int(stats["used_bytes"]),
        "pinned_bytes": int(stats["capacity_bytes"]),
        "slab_allocations": int(stats["num_slab_allocations"]),
        "offloaded_bytes": go.offloaded_bytes(),
        "cached_plans": _plan.cache_info()["num_plans"],
    }
    if device.type == "cuda":
        out["cuda_memory_allocated"] = torch.cuda.memory_allocated(device)
        out["cuda_memory_reserved"] = torch.cuda.memory_reserved(device)
    return out


def drift(series: list[int]) -> float:
    """The largest distance from the first value, relative to it: 0.0 for a flat series."""
    if not series:
        return 0.0
    return max(abs(x - series[0]) for x in series) / max(series[0], 1)


def trend(series: list[int]) -> float:
    """Least-squares slope, per 1000 steps: what a leak shows as, where noise averages out."""
    n = len(series)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(series) / n
    num = sum((i - mean_x) * (y - mean_y) for i, y in enumerate(series))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return num / den * 1000


def soak(cycles: int = 1000, *, device: str = "cpu", width: int = 1024, depth: int = 8, warmup: int = 20,
         check_every: int = 10, tolerance: float = 0.01, arena: Optional[go.Arena] = None,
         progress: bool = False) -> dict[str, Any]:
    """Runs the cycles and returns the figures: per-metric drift after warm-up, flat or not, wrong values."""
    dev = torch.device(device)
    model, opt = build_model(dev, width, depth)
    expected = [t.detach().clone() for t in _state_bytes(model, opt)]
    arena = arena if arena is not None else go.Arena(min_slab_bytes=64 << 20)
    target = [model, opt]
    params = list(model.parameters())
    samples: list[dict[str, int]] = []
    wrong = 0
    start = time.perf_counter()
    for cycle in range(cycles):
        snap = go.snapshot(model, checksum=True, arena=arena)
        with torch.no_grad():
            torch._foreach_add_(params, 1.0)
        go.restore(model, snap, verify=True)
        go.offload(target, arena=arena)
        go.reload(target)
        snap.free()
        if (cycle + 1) % check_every == 0 or cycle + 1 == cycles:
            wrong += not _same(_state_bytes(model, opt), expected)
        if cycle + 1 == warmup or cycle + 1 == cycles:
            gc.collect()  # (slow with torch loaded: only where the comparison starts and ends)
        samples.append(sample(arena, dev))
        if progress and (cycle + 1) % max(1, cycles // 10) == 0:
            print(f"  cycle {cycle + 1}/{cycles}: {samples[-1]}", file=sys.stderr)
    seconds = time.perf_counter() - start
    steady = samples[warmup:] if len(samples) > warmup else samples[-1:]
    metrics = sorted(samples[0])
    result: dict[str, Any] = {
        "cycles": cycles,
        "warmup_cycles": warmup,
        "seconds": round(seconds, 2),
        "state_bytes": sum(t.numel() * t.element_size() for t in expected),
        "wrong_values": wrong,
        "tolerance": tolerance,
        "after_warmup": {m: steady[0][m] for m in metrics},
        "final": {m: samples[-1][m] for m in metrics},
        "min": {m: min(s[m] for s in steady) for m in metrics},
        "max": {m: max(s[m] for s in steady) for m in metrics},
        "drift": {m: round(drift([s[m] for s in steady]), 6) for m in metrics},
        "band": {m: round((max(s[m] for s in steady) - min(s[m] for s in steady)) / max(steady[0][m], 1), 6)
                 for m in metrics},
        "trend_per_1000_cycles": {m: round(trend([s[m] for s in steady]), 1) for m in metrics},
    }
    # Zero-valued series (nothing offloaded between cycles) must stay exactly zero.
    result["flat"] = {m: (max(s[m] for s in steady) == 0) if steady[0][m] == 0 else result["drift"][m] <= tolerance
                      for m in metrics}
    result["ok"] = wrong == 0 and all(result["flat"].values())
    return result


def checksum_overhead(*, device: str = "cpu", nbytes: int = 256 << 20, repeats: int = 7) -> dict[str, Any]:
    """Median seconds of snapshot+wait of one model's worth of storages without and with checksum=True."""
    dev = torch.device(device)
    tensors = {f"t{i}": torch.randn(nbytes // 16 // 4, device=dev) for i in range(16)}
    arena = go.Arena(min_slab_bytes=nbytes + (64 << 20))

    def timed(checksum: bool) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        snap = go.snapshot(tensors, arena=arena, checksum=checksum)
        snap.wait()
        if checksum:
            snap.checksums  # the sums are on the host
        seconds = time.perf_counter() - t0
        snap.free()
        return seconds

    timed(False), timed(True)  # warm-up: pin, plan, scratch buffers
    plain, summed = [], []
    for _ in range(repeats):  # interleaved, so drift in the machine's load hits both alike
        plain.append(timed(False))
        summed.append(timed(True))
    p, s = statistics.median(plain), statistics.median(summed)
    return {"nbytes": nbytes, "repeats": repeats, "snapshot_seconds": round(p, 5),
            "snapshot_checksum_seconds": round(s, 5), "overhead": round(s / p - 1, 4),
            "snapshot_gbps": round(nbytes / p / 1e9, 2)}


def fix_mmap_threshold(nbytes: int) -> bool:
    """Fixes glibc's mmap threshold (mallopt M_MMAP_THRESHOLD). By default glibc raises the threshold each
    time a large block is freed, so the multi-MiB CPU tensors that offload frees and reload re-allocates
    drift between mmap and the heap and RSS wanders by megabytes with no leak; a fixed threshold keeps
    them on mmap and RSS shows what is really held. False where there is no glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, nbytes))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--width", type=int, default=1024, help="Linear width (default 1024)")
    parser.add_argument("--depth", type=int, default=8, help="Linear+LayerNorm layers (default 8: ~100 MB with AdamW)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--tolerance", type=float, default=0.01)
    parser.add_argument("--overhead-bytes", type=int, default=256 << 20)
    parser.add_argument("--mmap-threshold", type=int, default=1 << 20,
                        help="fix glibc's mmap threshold at this many bytes (default 1 MiB; 0: glibc's dynamic one)")
    parser.add_argument("--json", help="write the figures here (e.g. benchmarks/results/soak-cpu-<date>.json)")
    args = parser.parse_args(argv)
    fixed = fix_mmap_threshold(args.mmap_threshold) if args.mmap_threshold > 0 else False

    figures: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "gpu_offload": go.__version__,
                    "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
                    "malloc_mmap_threshold": args.mmap_threshold if fixed else "glibc default (dynamic)"},
        "soak": soak(args.cycles, device=args.device, width=args.width, depth=args.depth, warmup=args.warmup,
                     tolerance=args.tolerance, progress=True),
        "checksum_overhead": checksum_overhead(device=args.device, nbytes=args.overhead_bytes),
    }
    text = json.dumps(figures, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if figures["soak"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
