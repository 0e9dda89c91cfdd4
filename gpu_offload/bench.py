"""Benchmark: the engine beside the link limit and the baselines, measured in one run.

Layouts come from the package's copy of the calibration layouts (the parameter shapes of a model as
run-length [shape, count] runs). On a machine without a GPU the layout is scaled down by dividing each
shape's first dimension (tensor count kept), and the "link" is host memory: the limit is one contiguous
copy of the same bytes.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from . import api
from ._errors import OffloadError
from .arena import Arena

logger = logging.getLogger("gpu_offload")

LAYOUT_NAMES = ("qwen1.5b", "qwen7b", "small64k", "tiny4k", "mixed")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "uint8": torch.uint8}
DTYPE_NAMES = tuple(_DTYPES)


@dataclass
class Layout:
    name: str
    dtype: torch.dtype
    shapes: list[tuple[int, ...]]
    scale: int = 1

    @property
    def num_tensors(self) -> int:
        return len(self.shapes)

    @property
    def nbytes(self) -> int:
        item = torch.empty(0, dtype=self.dtype).element_size()
        return sum(math.prod(s) for s in self.shapes) * item


def load_layout(name_or_path: str, *, dtype: Optional[str] = None, scale: int = 1) -> Layout:
    """A named layout from the package data, or a JSON file with the same fields ({"dtype", "runs"}).

    Raises OffloadError (one line, naming the problem) for an unknown name, an unreadable or malformed
    file, an unknown dtype, or a run whose dimensions or count are not positive integers.
    """
    path = Path(name_or_path)
    if name_or_path in LAYOUT_NAMES:
        table = json.loads(resources.files("gpu_offload").joinpath("data/layouts.json").read_text())
        spec = table[name_or_path]
    elif path.suffix == ".json" or path.exists():
        try:
            spec = json.loads(path.read_text())
        except FileNotFoundError:
            raise OffloadError(f"layout file {path} does not exist") from None
        except (OSError, ValueError) as exc:
            raise OffloadError(f"layout file {path} is not readable JSON: {exc}") from None
    else:
        raise OffloadError(f"unknown layout {name_or_path!r}: use one of {', '.join(LAYOUT_NAMES)} or a JSON file")
    if not isinstance(spec, dict) or "runs" not in spec:
        raise OffloadError(f"layout {name_or_path}: expected a JSON object with \"runs\": [[shape, count], ...] "
                           "(and optionally \"dtype\", \"name\")")
    dtype_name = dtype or spec.get("dtype", "bfloat16")
    if dtype_name not in _DTYPES:
        raise OffloadError(f"layout {name_or_path}: unknown dtype {dtype_name!r} (use one of {', '.join(_DTYPES)})")
    shapes: list[tuple[int, ...]] = []
    try:
        for run in spec["runs"]:
            shape_spec, count_spec = run
            # Exact integers only: a float or a bool dimension is a typo, not something to round.
            if isinstance(count_spec, bool) or not isinstance(count_spec, int) or count_spec < 1 or any(
                    isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape_spec):
                raise OffloadError(f"layout {name_or_path}: run {run!r}: dimensions and counts must be positive "
                                   "integers")
            shape = list(shape_spec)
            if shape and scale > 1:
                shape[0] = max(1, shape[0] // scale)
            shapes.extend([tuple(shape)] * count_spec)
    except (TypeError, ValueError) as exc:
        raise OffloadError(f"layout {name_or_path}: malformed runs ({exc}); expected [[shape, count], ...]") from None
    if not shapes:
        raise OffloadError(f"layout {name_or_path} has no tensors")
    return Layout(str(spec.get("name", name_or_path)), _DTYPES[dtype_name], shapes, scale)


def host_bytes_needed(layout: Layout, device: torch.device) -> int:
    """Host memory `run` needs at its peak, roughly: on the CPU the tensors, the contiguous copy's two
    buffers or the arena, and the baselines' copies; on a GPU the pinned buffer, the arena and the
    baselines' host copies."""
    return (4 if device.type == "cpu" else 3) * layout.nbytes


def make_tensors(layout: Layout, device: torch.device) -> dict[str, torch.Tensor]:
    """One tensor per shape, each its own storage, filled with a cheap non-constant pattern."""
    out = {}
    for i, shape in enumerate(layout.shapes):
        t = torch.empty(shape, dtype=layout.dtype, device=device)
        t.fill_(i % 251)
        out[f"t{i}"] = t
    return out


@dataclass
class Row:
    method: str
    direction: str  # d2h, h2d, both
    seconds: float
    nbytes: int
    gbps: float
    ratio: Optional[float] = None  # to the limit of the same direction, same run
    note: str = ""


@dataclass
class Result:
    layout: str
    device: str
    num_tensors: int
    nbytes: int
    scale: int
    repeats: int
    rows: list[Row] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], Any], device: torch.device, repeats: int, setup: Optional[Callable[[], Any]] = None,
          warmup: int = 1) -> float:
    """Median seconds of fn over repeats, after warm-up; setup runs untimed before each call."""
    times = []
    for i in range(warmup + repeats):
        if setup is not None:
            setup()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _release_torch_pinned() -> None:
    """Returns torch's cached pinned blocks to the system. torch keeps freed pinned memory (rounded up to a
    power of two) for reuse; the baselines of a 15 GB layout would otherwise hold several times that."""
    import gc

    if not torch.cuda.is_available():  # nothing pinned by torch without a GPU (and the call would raise)
        return
    gc.collect()
    for owner, name in ((getattr(torch, "accelerator", None), "memory.empty_host_cache"),
                        (torch._C, "_host_emptyCache")):
        fn: Any = owner
        for part in name.split("."):
            fn = getattr(fn, part, None) if fn is not None else None
        if callable(fn):
            fn()
            return


def run(layout: Layout, device: torch.device, *, repeats: int = 5, baselines: bool = True,
        progress: Optional[Callable[[str], None]] = None, gather_sweep: Sequence[int] = ()) -> Result:
    """Measures every method on one layout; returns rows with GB/s and the ratio to the limit."""
    step = progress or (lambda _name: None)
    tensors = make_tensors(layout, device)
    nbytes = layout.nbytes
    result = Result(layout.name, str(device), layout.num_tensors, nbytes, layout.scale, repeats)
    pinned = device.type == "cuda"
    limits: dict[str, float] = {}

    def add(method: str, direction: str, seconds: float, note: str = "", moved: Optional[int] = None) -> None:
        moved = nbytes if moved is None else moved
        gbps = moved / seconds / 1e9
        ratio = gbps / limits[direction] if direction in limits and method != "limit" else None
        result.rows.append(Row(method, direction, seconds, moved, gbps, ratio, note))

    # The limit: one contiguous copy of the same bytes, each way.
    step("limit")
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(7)
    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    t = _time(lambda: flat_host.copy_(flat_dev, non_blocking=True), device, repeats)
    limits["d2h"] = nbytes / t / 1e9
    add("limit", "d2h", t, "one contiguous copy of the same bytes" + (" (pinned)" if pinned else ""))
    t = _time(lambda: flat_dev.copy_(flat_host, non_blocking=True), device, repeats)
    limits["h2d"] = nbytes / t / 1e9
    add("limit", "h2d", t, "one contiguous copy of the same bytes" + (" (pinned)" if pinned else ""))
    del flat_dev, flat_host
    _release_torch_pinned()

    # The engine, on a warm arena (first cycle pins; steady state is what a training loop sees).
    arena = Arena()
    step("gpu_offload.snapshot")
    holder: dict[str, Any] = {}

    def snap() -> None:
        holder["snap"] = api.snapshot(tensors, arena=arena).wait()

    def free_snap() -> None:
        if "snap" in holder:
            holder.pop("snap").free()

    add("gpu_offload.snapshot+wait", "d2h", _time(snap, device, repeats, setup=free_snap))
    step("gpu_offload.restore")
    add("gpu_offload.restore", "h2d", _time(lambda: api.restore(tensors, holder["snap"]), device, repeats))
    free_snap()
    def ensure_resident() -> None:
        if api.is_offloaded(tensors):
            api.reload(tensors)

    def ensure_offloaded() -> None:
        if not api.is_offloaded(tensors):
            api.offload(tensors, arena=arena)

    step("gpu_offload.offload")
    add("gpu_offload.offload", "d2h",
        _time(lambda: api.offload(tensors, arena=arena), device, repeats, setup=ensure_resident),
        "empty_cache included")
    step("gpu_offload.reload")
    add("gpu_offload.reload", "h2d", _time(lambda: api.reload(tensors), device, repeats, setup=ensure_offloaded))
    if api.is_offloaded(tensors):
        api.reload(tensors)
    result.info["arena"] = arena.stats()  # num_slab_allocations: pinned once, flat from the second cycle
    if gather_sweep and device.type == "cuda":
        step("gather threshold sweep")
        _gather_sweep(tensors, device, repeats, arena, add, gather_sweep)

    if device.type == "cuda":
        # Both directions at once: the limit is one D2H and one H2D of the same bytes on two streams; the
        # engine swaps this layout out while a second copy of it comes back in.
        step("gpu_offload.swap")
        a, b = torch.empty(nbytes, dtype=torch.uint8, device=device), torch.empty(nbytes, dtype=torch.uint8, device=device)
        ha, hb = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2))
        s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)

        def both() -> None:
            with torch.cuda.stream(s1):
                ha.copy_(a, non_blocking=True)
            with torch.cuda.stream(s2):
                b.copy_(hb, non_blocking=True)

        t = _time(both, device, repeats)
        limits["both"] = 2 * nbytes / t / 1e9
        add("limit", "both", t, "one D2H and one H2D of the same bytes on two streams", moved=2 * nbytes)
        del a, b, ha, hb
        _release_torch_pinned()
        other = make_tensors(layout, device)
        api.offload(other, arena=arena)
        pair = [tensors, other]

        def swap_once() -> None:
            api.swap(pair[0], pair[1], arena=arena)
            pair.reverse()

        add("gpu_offload.swap", "both", _time(swap_once, device, repeats), "offload one while reloading another",
            moved=2 * nbytes)
        if api.is_offloaded(tensors):
            api.swap(other, tensors, arena=arena)
        if api.is_offloaded(other):
            api.reload(other)
        del other, pair

        # A fresh arena: the first snapshot pins its memory (what a new process pays once), against
        # allocating a pinned buffer with torch and copying into it.
        step("first snapshot, fresh arena")
        cold = Arena()

        def first() -> None:
            api.snapshot(tensors, arena=cold).wait().free()

        add("first snapshot, fresh arena", "d2h", _time(first, device, 1, warmup=0), "pinning included")
        result.info["cold_arena"] = cold.stats()
        del cold

        def torch_pinned() -> None:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            off = 0
            for t_ in tensors.values():
                n = t_.numel() * t_.element_size()
                host[off:off + n].copy_(t_.reshape(-1).view(torch.uint8), non_blocking=True)
                off += n

        add("torch.empty(pin_memory=True) + copy", "d2h", _time(torch_pinned, device, 1, warmup=0),
            "pinning included")
        _release_torch_pinned()

    if baselines:
        step("baselines")
        values = list(tensors.values())
        if device.type == "cuda":
            add("seed: p.cpu().clone()", "d2h", _time(lambda: [p.cpu().clone() for p in values], device, 1),
                "verl DetachActorWorker")
            add("p.to('cpu', non_blocking=True)+sync", "d2h",
                _time(lambda: [p.to("cpu", non_blocking=True) for p in values], device, repeats))
        else:
            add("seed: p.cpu().clone()", "d2h", _time(lambda: [p.cpu().clone() for p in values], device, repeats),
                "on the CPU .cpu() is a no-op: one clone per tensor")
        host = [torch.empty_like(p, device="cpu", pin_memory=pinned) for p in values]
        add("preallocated per-tensor copy_", "d2h",
            _time(lambda: [h.copy_(p, non_blocking=True) for h, p in zip(host, values)], device, repeats),
            "pinned" if pinned else "")
        add("preallocated per-tensor copy_ back", "h2d",
            _time(lambda: [p.copy_(h, non_blocking=True) for h, p in zip(host, values)], device, repeats),
            "pinned" if pinned else "")
        del host
        if pinned:
            _release_torch_pinned()
    result.info["limits_gbps"] = limits
    return result


def default_scale(layout_name: str, device: torch.device) -> int:
    """How much to shrink a layout on this device: on the CPU, to roughly 100-250 MB per layout."""
    if device.type == "cuda":
        return 1
    return {"qwen1.5b": 16, "qwen7b": 64, "small64k": 4, "tiny4k": 2, "mixed": 16}.get(layout_name, 1)


def _gather_sweep(tensors: dict[str, torch.Tensor], device: torch.device, repeats: int, arena: Arena,
                  add: Callable[..., None], thresholds: Sequence[int]) -> None:
    """snapshot+wait and restore with GPU_OFFLOAD_GATHER_MAX_BYTES set to each threshold in turn (storages up
    to it go through the gather/scatter kernel), in this process; one row per threshold and direction."""
    import os

    from . import plan as _plan

    before = os.environ.get("GPU_OFFLOAD_GATHER_MAX_BYTES")
    try:
        for limit in thresholds:
            os.environ["GPU_OFFLOAD_GATHER_MAX_BYTES"] = str(int(limit))
            _plan.clear_cache()  # plans read the threshold when they are built
            holder: dict[str, Any] = {}

            def snap() -> None:
                holder["snap"] = api.snapshot(tensors, arena=arena).wait()

            def free_snap() -> None:
                if "snap" in holder:
                    holder.pop("snap").free()

            note = f"GPU_OFFLOAD_GATHER_MAX_BYTES={int(limit)}"
            add(f"snapshot+wait, gather<={int(limit)}", "d2h", _time(snap, device, repeats, setup=free_snap), note)
            add(f"restore, gather<={int(limit)}", "h2d",
                _time(lambda: api.restore(tensors, holder["snap"]), device, repeats), note)
            free_snap()
    finally:
        if before is None:
            os.environ.pop("GPU_OFFLOAD_GATHER_MAX_BYTES", None)
        else:
            os.environ["GPU_OFFLOAD_GATHER_MAX_BYTES"] = before
        _plan.clear_cache()
