"""Where the time of one engine call goes, phase by phase: for the calls that fall short of the link on the
H200 (offload and reload 0.88x of the limit, swap 0.69x of both ways on qwen1.5b; everything on tiny4k),
what the host spends in each phase and how long the device still works after the call returns. Issue 19:
find where the time goes before changing anything.

    python benchmarks/phases.py --device cuda --layout qwen1.5b --layout tiny4k [--repeats 5] [--json out.json]
        [--one-step-reload] [--gather-max-bytes N]

Each call (snapshot+wait, restore, offload, reload, swap) runs --repeats times after one untimed call; the
table gives medians in ms: "call" from the call to its return, "device" from there until the device is idle
again (torch.cuda.synchronize(); snapshot: wait()), and the host phases inside the call, each counted where
it is outermost: "read" (the target's tensors gathered: adapters), "check" (the cached plan found and
checked, or a fresh bind), "resize" (storages released or allocated: torch's allocator, cudaMalloc after
empty_cache), "uses" (the allocator told of the copy stream: record_stream), "enqueue" (the copy batches
handed to the driver: on CUDA the batch call, the gather kernel's table), "cache" (torch.cuda.empty_cache:
cudaFree, which waits for the device), "region" (the arena's), and "rest" (the call's own Python). The
limit row: one contiguous pinned copy of the same bytes each way, in the same run. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from typing import Any, Callable, Iterator

import torch

import gpu_offload as go
from gpu_offload import adapters, api, bench, plan
from gpu_offload import arena as arena_module

PHASES = ("read", "check", "resize", "uses", "enqueue", "cache", "region")


class Phases:
    """Host seconds per phase, counted where a phase is the outermost one running (no double counting)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.calls = dict.fromkeys(PHASES, 0)  # the outermost calls counted
        self._depth = 0

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start
                self.calls[phase] += 1
                self._depth -= 1
        return timed

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.calls = dict.fromkeys(PHASES, 0)


@contextlib.contextmanager
def instrumented(phases: Phases) -> Iterator[None]:
    """Wraps the engine's phase functions where api.py reaches them (module attributes, read at each call)."""
    patched = [
        (api, "named_tensors", "read"), (plan, "resolve", "check"), (plan, "cached", "check"),
        (plan, "resize", "resize"), (plan, "mark_live_in_use", "uses"), (plan, "mark_in_use", "uses"),
        (api, "_empty_cache", "cache"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
    run, allocate = plan.CopyPlans.run, arena_module.Arena._allocate
    try:
        for owner, name, phase in patched:
            setattr(owner, name, phases.wrap(phase, getattr(owner, name)))
        plan.CopyPlans.run = phases.wrap("enqueue", run)  # type: ignore[method-assign]
        arena_module.Arena._allocate = phases.wrap("region", allocate)  # type: ignore[method-assign]
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
        plan.CopyPlans.run = run  # type: ignore[method-assign]
        arena_module.Arena._allocate = allocate  # type: ignore[method-assign]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, call: Callable[[], Any], finish: Callable[[Any], None], device: torch.device,
            repeats: int, phases: Phases, setup: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Medians of `repeats` timed calls (after one untimed): the call, the device after it, each phase."""
    samples: list[dict[str, float]] = []
    for i in range(repeats + 1):
        setup()
        _sync(device)
        phases.reset()
        with instrumented(phases):
            t0 = time.perf_counter()
            out = call()
            t1 = time.perf_counter()
        finish(out)
        _sync(device)
        t2 = time.perf_counter()
        if i:
            sample = {"call": t1 - t0, "device": t2 - t1, **phases.seconds}
            sample["rest"] = sample["call"] - sum(phases.seconds.values())
            samples.append(sample)
    return {"name": name, **{k: statistics.median(s[k] for s in samples) * 1e3 for k in samples[0]}}


def limit_ms(nbytes: int, device: torch.device, repeats: int) -> dict[str, float]:
    """One contiguous pinned copy of the same bytes each way (ms, median)."""
    if device.type != "cuda":
        return {}
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for direction, fn in (("d2h", lambda: host.copy_(dev, non_blocking=True)),
                          ("h2d", lambda: dev.copy_(host, non_blocking=True))):
        times = []
        for _ in range(repeats + 1):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - t0)
        out[direction] = statistics.median(times[1:]) * 1e3
    return out


def run_layout(name: str, device: torch.device, repeats: int) -> dict[str, Any]:
    layout = bench.load_layout(name, scale=bench.default_scale(name, device))
    tensors = bench.make_tensors(layout, device)
    arena = go.Arena()
    phases = Phases()
    rows = []
    snap_holder: list[Any] = []

    def free_snap() -> None:
        while snap_holder:
            snap_holder.pop().free()

    rows.append(measure("snapshot+wait", lambda: go.snapshot(tensors, arena=arena), lambda s: snap_holder.append(s.wait()),
                        device, repeats, phases, setup=free_snap))
    snap = go.snapshot(tensors, arena=arena).wait()
    free_snap()
    rows.append(measure("restore", lambda: go.restore(tensors, snap), lambda _: None, device, repeats, phases))
    snap.free()

    def resident() -> None:
        if go.is_offloaded(tensors):
            go.reload(tensors)

    def offloaded() -> None:
        if not go.is_offloaded(tensors):
            go.offload(tensors, arena=arena)

    rows.append(measure("offload", lambda: go.offload(tensors, arena=arena), lambda _: None, device, repeats, phases,
                        setup=resident))
    rows.append(measure("offload, no empty_cache", lambda: go.offload(tensors, arena=arena, empty_cache=False),
                        lambda _: None, device, repeats, phases, setup=resident))
    rows.append(measure("reload", lambda: go.reload(tensors), lambda _: None, device, repeats, phases,
                        setup=offloaded))
    resident()
    other = bench.make_tensors(layout, device)
    go.offload(other, arena=arena)
    pair = [tensors, other]

    def swap() -> None:
        go.swap(pair[0], pair[1], arena=arena)
        pair.reverse()

    rows.append(measure("swap", swap, lambda _: None, device, repeats, phases))
    for t in pair:
        if go.is_offloaded(t):
            go.reload(t)
    del other, pair
    return {"layout": name, "num_tensors": layout.num_tensors, "nbytes": layout.nbytes,
            "limit_ms": limit_ms(layout.nbytes, device, repeats), "rows": rows}


def _print(result: dict[str, Any]) -> None:
    limit = result["limit_ms"]
    where = ", ".join(f"limit {k} {v:.2f} ms" for k, v in limit.items()) or "no limit on the CPU"
    print(f"{result['layout']}: {result['num_tensors']} tensors, {result['nbytes'] / 1e9:.3f} GB ({where})")
    cols = ("call", "device", *PHASES, "rest")
    print(f"  {'ms':<24}" + "".join(f"{c:>9}" for c in cols))
    for row in result["rows"]:
        print(f"  {row['name']:<24}" + "".join(f"{row[c]:9.2f}" for c in cols))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layout", action="append", help="a bench layout (default: qwen1.5b and tiny4k)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json")
    p.add_argument("--one-step-reload", action="store_true",
                   help="reload in one step (allocate everything, then copy), to compare with the parts")
    p.add_argument("--gather-max-bytes", type=int, help="GPU_OFFLOAD_GATHER_MAX_BYTES for this run")
    args = p.parse_args()
    if args.gather_max_bytes is not None:
        import os
        os.environ["GPU_OFFLOAD_GATHER_MAX_BYTES"] = str(args.gather_max_bytes)
    if args.one_step_reload:
        plan.RELOAD_FIRST_PART_BYTES = 1 << 62
    device = torch.device(args.device)
    results = []
    for name in args.layout or ["qwen1.5b", "tiny4k"]:
        result = run_layout(name, device, args.repeats)
        _print(result)
        results.append(result)
    if args.json:
        meta = {"device": str(device), "torch": torch.__version__, "gather_max_bytes": plan.gather_max_bytes(),
                "reload_first_part_bytes": plan.RELOAD_FIRST_PART_BYTES, "helper": adapters._ext is not None}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
