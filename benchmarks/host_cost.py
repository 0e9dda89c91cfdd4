"""Host cost of the engine's calls on targets of many tiny tensors (the copies themselves cost nothing), in
ms and in Y, Y being one Python pass `[t.data_ptr() for t in ts]` over the same tensors in the same run.

    .venv/bin/python benchmarks/host_cost.py [--tensors 65536] [--repeats 15] [--json out.json] [--one-process]
        [--device cuda]

Measures (each the median of --repeats calls, with the slowest/fastest spread):
  dict / module (a tree of nn.Linear(2, 2, bias=False), 256 per block, the shape of an MoE's experts):
    cached snapshot+wait+free, restore, offload+reload, and the first (uncached) snapshot;
  model+adamw: [module, its AdamW after one step] (a quarter of the tensors the parameters), the same rows;
  fsdp2: the same tree with fully_shard on each block and on the root (one rank, gloo): DTensor parameters;
  llm339: the 339 tensors of the qwen1.5b layout, each shrunk to 16 bytes (its rank kept), as a dict;
  and, where the torch-aware helper is loaded, "allocator": the storages released and allocated again
  by one C++ call, torch's allocator alone (a share of offload+reload no engine avoids); on CUDA also
  "allocator + copy-stream uses": the same with each storage first recorded on the copy stream (offload's
  record_stream), whose price is an event per freed block in torch's caching allocator.
  and "checks (in offload+reload)": the two validations a cycle makes before anything moves (the target
  read, then its cached plan checked, holding its storages: twice without its grads, as offload and then
  reload read it where no registered set holds gradients; before 2026-12-03's fifth session the reload read
  the grads too, and this row did), alone;
  module only: "offload+reload, grads=keep|copy|drop", the cycle with a .grad on every parameter (twice the
  tensors; Y stays the parameters' pass).
Each figure in Y twice: "Y", the call's median over the median of a block of Y passes taken before the
calls; "Y paired", the median of each call's ratio to a Y pass timed right after it, the second of two
(on a shared host whose speed drifts within a minute, the steadier of the two; the first pass absorbs
what the call leaves behind, glibc's deferred consolidation of freed chunks and evicted caches).
Where the garbage collector ran inside a row's timed calls, the row says how often, by generation
("gc passes 0/1/2", JSON "gc_passes"): a call should keep no object per tensor alive.
Nothing is asserted; this prints a table (and writes JSON with --json).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch

import gpu_offload as go
from gpu_offload import adapters, bench, plan

try:
    from gpu_offload import torch_ext
except ImportError:  # a version without the torch-aware helper (for before/after runs)
    torch_ext = None  # type: ignore[assignment]


# The garbage collector's passes during the timed calls, by generation (see _times): a call that keeps an
# object per tensor alive makes it run, and a pass of the oldest generation walks every object of the process.
_gc_passes: list[int] = [0, 0, 0]
_gc_counting = [False]


def _count_gc(phase: str, info: dict[str, int]) -> None:
    if phase == "start" and _gc_counting[0]:
        _gc_passes[info["generation"]] += 1


def _times(fn: Callable[[], Any], repeats: int, setup: Callable[[], Any] | None = None, warmup: int = 2,
           y_pass: Callable[[], Any] | None = None) -> list[float] | tuple[list[float], list[float]]:
    """Seconds per call of fn (after `warmup` untimed calls). With y_pass: also the seconds of a Y pass
    timed right after each call (the second of two), as a second list (pairs taken together follow the
    machine's drift). The collector's passes inside the timed calls are added to _gc_passes."""
    if _count_gc not in gc.callbacks:
        gc.callbacks.append(_count_gc)
    out, ys = [], []
    for i in range(warmup + repeats):
        if setup is not None:
            setup()
        _gc_counting[0] = i >= warmup
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        _gc_counting[0] = False
        if y_pass is not None:
            # Two passes, the second timed: the first takes what the call left for whoever allocates next
            # (glibc consolidates the chunks torch's allocator freed at the next large request) and caches
            # the call evicted. Timing the first would inflate Y by the call's own deferred work.
            y_pass()
            t0 = time.perf_counter()
            y_pass()
            ys.append(time.perf_counter() - t0)
        if i >= warmup:
            out.append(dt)
    return (out, ys[warmup:]) if y_pass is not None else out


def _stat(samples: list[float], ys: list[float] | None = None) -> dict[str, float]:
    out = {"median_ms": statistics.median(samples) * 1e3, "min_ms": min(samples) * 1e3, "max_ms": max(samples) * 1e3}
    if ys:
        # The median of each call's ratio to the Y pass timed just after it: on a machine whose speed drifts
        # (a shared host), steadier than the ratio of two medians taken at different times.
        out["Y_paired"] = statistics.median(t / y for t, y in zip(samples, ys))
    return out


KINDS = ["dict", "module", "model+adamw", "fsdp2", "llm"]


def make_module(num_tensors: int, per_block: int = 256) -> torch.nn.Module:
    blocks = []
    left = num_tensors
    while left > 0:
        n = min(per_block, left)
        blocks.append(torch.nn.ModuleList(torch.nn.Linear(2, 2, bias=False) for _ in range(n)))
        left -= n
    return torch.nn.ModuleList(blocks)


def make_fsdp2_module(num_tensors: int, device: str) -> torch.nn.Module:
    """make_module's tree with fully_shard on each block of 256 and on the root, in a world of one rank (a
    gloo or NCCL group made here): its parameters are DTensors, FSDP2's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", rank=0, world_size=1,
                               init_method=f"tcp://127.0.0.1:{port}")
    mesh = init_device_mesh(torch.device(device).type, (1,))
    m = _Sharded(make_module(num_tensors)).to(device)
    for block in m.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(m, mesh=mesh)


class _Sharded(torch.nn.Module):
    """make_module's blocks, each a module with a forward (fully_shard refuses a bare ModuleList)."""

    class Block(torch.nn.Module):
        def __init__(self, experts: torch.nn.ModuleList) -> None:
            super().__init__()
            self.experts = experts

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for expert in self.experts:
                x = x + expert(x)
            return x

    def __init__(self, blocks: torch.nn.ModuleList) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(self.Block(b) for b in blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (x: [batch, 2])
        for block in self.blocks:
            x = block(x)
        return x


def measure_target(kind: str, target: Any, tensors: list[torch.Tensor], repeats: int, arena: go.Arena) -> dict[str, Any]:
    def y_pass() -> None:
        [t.data_ptr() for t in tensors]

    y = _times(y_pass, repeats)
    out: dict[str, Any] = {"kind": kind, "num_tensors": len(tensors), "Y": _stat(y),
                           "device": str(tensors[0].device) if tensors else "cpu"}
    # On a GPU each call is timed until it returns (the host's share; snapshot+wait also waits for its
    # copies), the device idle before it (untimed), so that no call waits on the one before it.
    settle = torch.cuda.synchronize if tensors and tensors[0].is_cuda else None

    def paired(fn: Callable[[], Any], n: int, setup: Callable[[], Any] | None = None, **kw: Any) -> dict[str, Any]:
        if settle is not None:
            before = setup
            setup = (lambda: (before(), settle())) if before is not None else settle
        # (Its own name: `before` above is the setup the CUDA lambda calls, read when the lambda runs.)
        passes_before = list(_gc_passes)
        stat = _stat(*_times(fn, n, setup=setup, y_pass=y_pass, **kw))
        stat["gc_passes"] = [a - b for a, b in zip(_gc_passes, passes_before)]  # (by generation, over the n calls)
        return stat

    def forget() -> None:  # untimed: a first call on a target drops no plan of its own
        plan.clear_cache()
        # The recorded traversals too (a module's, an optimizer's, a list's joined names; absent in older versions).
        for name in ("_trees", "_optimizer_trees", "_joined_names", "_fsdp2_trees", "_walked_fsdp2", "_walked_names",
                     "_walked_optimizer_names"):
            recorded = getattr(adapters, name, None)
            if recorded is not None:
                recorded.clear()

    out["first snapshot (uncached)"] = paired(lambda: go.snapshot(target, arena=arena).wait().free(),
                                              max(3, repeats // 3), setup=forget, warmup=1)
    out["snapshot+wait+free"] = paired(lambda: go.snapshot(target, arena=arena).wait().free(), repeats)
    snap = go.snapshot(target, arena=arena).wait()
    out["restore"] = paired(lambda: go.restore(target, snap), repeats)
    snap.free()

    def cycle() -> None:
        go.offload(target, arena=arena, empty_cache=False)
        go.reload(target)

    out["offload+reload"] = paired(cycle, repeats)
    if torch_ext is not None and torch_ext.ext is not None:
        record = torch_ext.ext.record(tensors)

        def allocator() -> None:
            record.resize_live(tensors, True)
            record.resize_live(tensors, False)

        out["allocator (in offload+reload)"] = paired(allocator, repeats)
        if settle is not None:  # CUDA: and each storage recorded on the copy stream first, as offload does
            copy = plan.copy_stream(tensors[0].device.index, True)
            streams = {copy.device_index: (copy.stream_id, copy.device_index, copy.device_type)}

            def allocator_with_uses() -> None:
                # (the allocator then records an event per freed block, and queries them at later mallocs)
                record.record_streams_live(tensors, None, streams)
                record.resize_live(tensors, True)
                record.resize_live(tensors, False)

            out["allocator + copy-stream uses"] = paired(allocator_with_uses, repeats)

    def checks() -> None:  # what offload, then reload, asks of the cached target before a byte moves
        for _ in range(2):
            resolved = plan.cached(adapters.named_tensors(target), hold=True)
            assert resolved is not None, "the target's plan is not cached"

    if hasattr(plan, "cached"):  # (absent in older versions)
        go.offload(target, arena=arena, empty_cache=False)  # the plan as a cycle finds it
        go.reload(target)
        out["checks (in offload+reload)"] = paired(checks, repeats)
    modules = [target] if isinstance(target, torch.nn.Module) else [x for x in target if isinstance(x, torch.nn.Module)]
    if modules:
        # After a backward: every parameter has a .grad (as many tensors again), under each grads policy.
        params = [p for m in modules for p in m.parameters()]
        for p in params:
            p.grad = torch.zeros_like(p)
        for policy in ("keep", "copy", "drop"):
            def cycle_with(policy: str = policy) -> None:
                go.offload(target, arena=arena, empty_cache=False, grads=policy)
                go.reload(target)

            out[f"offload+reload, grads={policy}"] = paired(cycle_with, repeats)
        for p in params:
            p.grad = None
    ymed = out["Y"]["median_ms"]
    for k, v in list(out.items()):
        if isinstance(v, dict) and k != "Y":
            v["Y"] = v["median_ms"] / ymed
            v["spread"] = v["max_ms"] / v["min_ms"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tensors", type=int, default=65536)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", type=str, default=None)
    p.add_argument("--only", choices=KINDS, action="append")
    p.add_argument("--device", default="cpu",
                   help="where the tensors live (cuda: torch's caching allocator in the allocator row)")
    p.add_argument("--import-deepspeed", action="store_true",
                   help="import DeepSpeed first (DS_ACCELERATOR=cpu), as OpenRLHF does: the module rows then show "
                        "what a process with DeepSpeed loaded pays")
    p.add_argument("--one-process", action="store_true",
                   help="measure every target in this process, one after the other (by default each runs in a "
                        "process of its own: a target built on the heap the one before it left is scattered "
                        "over it, and every figure of it moves, Y's too, by up to 2x)")
    args = p.parse_args()
    only = set(args.only or KINDS)
    if len(only) > 1 and not args.one_process:
        results = _in_own_processes(args, [k for k in KINDS if k in only])
    else:
        results = _measure(args, only)
    _print(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _in_own_processes(args: argparse.Namespace, kinds: list[str]) -> dict[str, Any]:
    """Each target measured by this script in a fresh process, in order; their results merged."""
    import subprocess
    import tempfile

    merged: dict[str, Any] = {"load_average_start": os.getloadavg(), "processes": "one per target"}
    for kind in kinds:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            cmd = [sys.executable, os.path.abspath(__file__), "--only", kind, "--tensors", str(args.tensors),
                   "--repeats", str(args.repeats), "--device", args.device, "--json", out.name]
            if args.import_deepspeed:
                cmd.append("--import-deepspeed")
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            with open(out.name) as f:
                part = json.load(f)
        for key in ("torch", "torch_ext", "deepspeed_imported"):
            merged.setdefault(key, part[key])
        merged.update({k: v for k, v in part.items() if isinstance(v, dict) and "num_tensors" in v})
    merged["load_average_end"] = os.getloadavg()
    return merged


def _measure(args: argparse.Namespace, only: set[str]) -> dict[str, Any]:
    if args.import_deepspeed:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed  # noqa: F401
    arena = go.Arena()
    results: dict[str, Any] = {"load_average_start": os.getloadavg(), "torch": torch.__version__,
                               "torch_ext": _ext_state(), "deepspeed_imported": "deepspeed" in sys.modules}
    if "dict" in only:
        d = {f"t{i}": torch.empty(4, device=args.device) for i in range(args.tensors)}
        results["dict"] = measure_target("dict", d, list(d.values()), args.repeats, arena)
        del d
    if "module" in only:
        m = make_module(args.tensors).to(args.device)
        results["module"] = measure_target("module", m, list(m.parameters()), args.repeats, arena)
        del m
    if "model+adamw" in only:
        # [model, its AdamW after a step]: a quarter of the tensors are parameters, the rest the optimizer's
        # exp_avg, exp_avg_sq and step of each.
        m = make_module(max(1, args.tensors // 4)).to(args.device)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        for p in m.parameters():
            p.grad = None
        target = [m, opt]
        results["model+adamw"] = measure_target("model+adamw", target, adapters.named_tensors(target).tensors,
                                                args.repeats, arena)
        del m, opt, target
    if "fsdp2" in only:
        m = make_fsdp2_module(args.tensors, args.device)
        # (Y over the DTensors' local tensors, which hold the data.)
        results["fsdp2"] = measure_target("fsdp2", m, [p._local_tensor for p in m.parameters()], args.repeats, arena)
        del m
    if "llm" in only:
        layout = bench.load_layout("qwen1.5b", dtype="float32")
        t = {f"t{i}": torch.empty([1] * (len(shape) - 1) + [4], device=args.device) for i, shape in enumerate(layout.shapes)}
        results["llm339"] = measure_target("dict", t, list(t.values()), max(args.repeats, 51), arena)
    results["load_average_end"] = os.getloadavg()
    return results


def _print(results: dict[str, Any]) -> None:
    for key in ("dict", "module", "model+adamw", "fsdp2", "llm339"):
        r = results.get(key)
        if r is None:
            continue
        print(f"{key}: {r['num_tensors']} tensors on {r.get('device', 'cpu')}, Y = {r['Y']['median_ms']:.2f} ms "
              f"({r['Y']['min_ms']:.2f}-{r['Y']['max_ms']:.2f})")
        for name, v in r.items():
            if isinstance(v, dict) and name != "Y":
                passes = v.get("gc_passes") or [0, 0, 0]
                gc_note = f"   gc passes {'/'.join(map(str, passes))}" if any(passes) else ""
                print(f"  {name:28s} {v['median_ms']:9.3f} ms  {v['Y']:7.2f} Y  {v['Y_paired']:7.2f} Y paired   "
                      f"min-max {v['min_ms']:.3f}-{v['max_ms']:.3f}{gc_note}")
    print(f"load average {results['load_average_start'][0]:.1f} -> {results['load_average_end'][0]:.1f}; "
          f"torch_ext: {results['torch_ext']}")


def _ext_state() -> str:
    try:
        from gpu_offload import torch_ext
    except ImportError:
        return "absent"
    return torch_ext.status()


if __name__ == "__main__":
    sys.exit(main())
