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
import os
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from . import _topology, api
from . import plan as _plan
from ._bytes import format_bytes
from ._errors import OffloadError
from ._version import __version__
from .arena import Arena
from .snapshot import Snapshot

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


SCHEMA_VERSION = 3  # of the JSON record; 2: per-repeat samples, spread, run metadata; 3: short method names,
# each row's kind, the limit measured again after the engine, the machine's load
WIDE_SPREAD = 1.5  # max/min of a measurement's repeats above which the table warns
DRIFT_FLOOR = 1.1  # the limit moving by less than this between the start and the end is not worth a warning
# Rows by kind: the limit (one contiguous copy), gpu_offload's own methods, the per-tensor baselines, and the
# engine's host work per call (moves nothing; ms, no GB/s).
KINDS = ("limit", "engine", "baseline", "host")


@dataclass
class Row:
    """One measurement: `seconds`, `gbps` and `ratio` are at the median of the repeats; `samples` are the
    seconds of every repeat, `gbps_min`/`gbps_max` the slowest and fastest repeat."""

    method: str
    direction: str  # d2h, h2d, both
    seconds: float
    nbytes: int
    gbps: float
    ratio: Optional[float] = None  # to the limit of the same direction, same run
    note: str = ""
    samples: list[float] = field(default_factory=list)
    gbps_min: float = 0.0
    gbps_max: float = 0.0
    iqr_seconds: float = 0.0  # interquartile range of the samples
    kind: str = "baseline"  # one of KINDS

    @property
    def spread(self) -> float:
        """Slowest over fastest repeat (1.0 for a single repeat)."""
        if self.gbps_min > 0:
            return self.gbps_max / self.gbps_min
        return max(self.samples) / min(self.samples) if self.samples and min(self.samples) > 0 else 1.0

    @property
    def wide(self) -> bool:
        return self.spread > WIDE_SPREAD


@dataclass
class Result:
    layout: str
    device: str
    num_tensors: int
    nbytes: int
    scale: int
    repeats: int
    dtype: str = ""
    rows: list[Row] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for row, data in zip(self.rows, out["rows"]):
            data["spread"] = row.spread
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], Any], device: torch.device, repeats: int, setup: Optional[Callable[[], Any]] = None,
          warmup: int = 1, sync: bool = True) -> list[float]:
    """Seconds of each of `repeats` calls of fn, after `warmup` untimed calls; setup runs untimed before each.

    Not torch.utils.benchmark.Timer: its timeit() adds at least two warm-up calls per measurement and has no
    untimed per-call setup (offload needs a reload before each call, a snapshot the previous one freed), and
    its clock synchronizes the current device rather than the one measured. Every method, the limit
    included, is timed by this one loop so that their ratios compare like with like; the statistics come
    from torch.utils.benchmark.Measurement. On a GPU each call is bracketed by a synchronize of its device,
    so asynchronous copies are timed until they have finished (sync=False: only until fn returns, the host's
    share).
    """
    times = []
    for i in range(warmup + repeats):
        if setup is not None:
            setup()
        _sync(device)
        start = time.perf_counter()
        fn()
        if sync:
            _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


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


class Bench:
    """What every group of measurements shares in one run: the layout's tensors, the engine's arena, the
    limits measured so far, and `measure`, which times one method, turns it into a Row and reports it.

    A group is a function `group(bench) -> list[Row]` (see GROUPS); `run` calls each in turn, so a new
    kind of measurement is one more function."""

    def __init__(self, layout: Layout, device: torch.device, repeats: int,
                 on_row: Optional[Callable[[Row], None]] = None) -> None:
        self.layout = layout
        self.device = device
        self.repeats = repeats
        self.nbytes = layout.nbytes
        self.pinned = device.type == "cuda"
        self.tensors = make_tensors(layout, device)
        self.arena = Arena()
        self.limits: dict[str, float] = {}  # GB/s at the median, per direction
        self.info: dict[str, Any] = {}
        self._on_row = on_row

    def measure(self, method: str, direction: str, fn: Callable[[], Any], *, note: str = "",
                setup: Optional[Callable[[], Any]] = None, repeats: Optional[int] = None, warmup: int = 1,
                moved: Optional[int] = None, kind: Optional[str] = None, sync: bool = True,
                note_of: Optional[Callable[[float], str]] = None) -> Row:
        """Times fn and returns its Row; a `limit` row also sets the limit of its direction. `kind` (one of
        KINDS): "limit" for the method "limit", "host" for the direction "host", else "engine" for a name
        starting with "go.", else "baseline". moved=0: a host-cost row (no GB/s). note_of(median seconds), if
        given, writes the note."""
        from torch.utils.benchmark import Measurement
        from torch.utils.benchmark.utils.common import TaskSpec

        samples = _time(fn, self.device, self.repeats if repeats is None else repeats, setup, warmup, sync)
        stats = Measurement(1, samples, TaskSpec(stmt=method, setup=""))
        moved = self.nbytes if moved is None else moved
        gbps = moved / stats.median / 1e9
        if method == "limit":
            self.limits[direction] = gbps
        limit = self.limits.get(direction) if method != "limit" else None
        if kind is None:
            kind = ("limit" if method == "limit" else "host" if direction == "host" else
                    "engine" if method.startswith("go.") else "baseline")
        if note_of is not None:
            note = note_of(stats.median)
        row = Row(method, direction, stats.median, moved, gbps, None if limit is None else gbps / limit, note,
                  samples=list(samples), gbps_min=moved / max(samples) / 1e9, gbps_max=moved / min(samples) / 1e9,
                  iqr_seconds=stats.iqr, kind=kind)
        if self._on_row is not None:
            self._on_row(row)
        return row


class _HeldSnapshot:
    """The snapshot a timed restore reads: `take` snapshots (the previous one freed by `free`, the setup
    of each timed call, so that the arena is reused rather than grown)."""

    def __init__(self, tensors: dict[str, torch.Tensor], arena: Arena) -> None:
        self.tensors, self.arena = tensors, arena
        self.snap: Optional[Snapshot] = None

    def take(self) -> None:
        self.snap = api.snapshot(self.tensors, arena=self.arena).wait()

    def free(self) -> None:
        if self.snap is not None:
            self.snap.free()
            self.snap = None

    def restore(self) -> None:
        if self.snap is None:
            raise RuntimeError("_HeldSnapshot.restore() before take()")
        api.restore(self.tensors, self.snap)


def limit_note(device: torch.device) -> str:
    """What the limit is on this device, in the words the output uses."""
    if device.type == "cuda":
        return "one contiguous copy of the same bytes over the link, pinned"
    return "one contiguous copy of the same bytes (on the CPU there is no link)"


def _limit_rows(b: Bench, method: str, note: str) -> list[Row]:
    flat_dev = torch.empty(b.nbytes, dtype=torch.uint8, device=b.device).fill_(7)
    flat_host = torch.empty(b.nbytes, dtype=torch.uint8, pin_memory=b.pinned)
    rows = [b.measure(method, "d2h", lambda: flat_host.copy_(flat_dev, non_blocking=True), note=note, kind="limit"),
            b.measure(method, "h2d", lambda: flat_dev.copy_(flat_host, non_blocking=True), note=note, kind="limit")]
    del flat_dev, flat_host
    _release_torch_pinned()
    return rows


def measure_limits(b: Bench) -> list[Row]:
    """The limit: one contiguous copy of the same bytes, each way."""
    return _limit_rows(b, "limit", limit_note(b.device))


def measure_limits_again(b: Bench) -> list[Row]:
    """The limit measured again after the engine's rows (ratio: to the first): a machine whose speed changed
    during the run shows here, and `limit_drift` says when by more than the spread of the repeats."""
    return _limit_rows(b, "limit again", "the limit again, after the engine's rows; x limit: to the first")


def measure_numa_limits(b: Bench) -> list[Row]:
    """GPU only, on a machine with more than one NUMA node: the limit again with the host buffer in an arena
    slab on the GPU's own node and on another node (copies from the far socket cross the inter-socket link)."""
    if b.device.type != "cuda":
        return []
    nodes = _topology.online_nodes()
    local = _topology.gpu_numa_node(b.device.index if b.device.index is not None else torch.cuda.current_device())
    if len(nodes) < 2 or local == _topology.UNKNOWN:
        return []
    remote = next(n for n in nodes if n != local)
    flat_dev = torch.empty(b.nbytes, dtype=torch.uint8, device=b.device).fill_(7)
    rows = []
    b.info["numa"] = {"gpu_node": local, "remote_node": remote}
    for where, node in (("local", local), ("remote", remote)):
        arena = Arena(pin="register")
        region = arena._allocate(b.nbytes, numa_node=node)
        host = torch.frombuffer(region.buffer(owner=region), dtype=torch.uint8)
        placed = arena.stats()["bytes_by_numa_node"]
        note = f"host buffer on NUMA node {node} ({where}); pages on {sorted(placed)}"
        rows.append(b.measure(f"limit from {where} memory", "d2h",
                              lambda: host.copy_(flat_dev, non_blocking=True), note=note))
        rows.append(b.measure(f"limit from {where} memory", "h2d",
                              lambda: flat_dev.copy_(host, non_blocking=True), note=note))
        del host
        region.release()
        arena.trim()
    del flat_dev
    return rows


def measure_engine(b: Bench) -> list[Row]:
    """The engine, on a warm arena (first cycle pins; steady state is what a training loop sees)."""
    tensors, arena = b.tensors, b.arena
    held = _HeldSnapshot(tensors, arena)

    def ensure_resident() -> None:
        if api.is_offloaded(tensors):
            api.reload(tensors)

    def ensure_offloaded() -> None:
        if not api.is_offloaded(tensors):
            api.offload(tensors, arena=arena)

    rows = [b.measure("go.snapshot+wait", "d2h", held.take, setup=held.free, note="snapshot(t).wait(), warm arena"),
            b.measure("go.restore", "h2d", held.restore, note="restore(t, snap)")]
    held.free()
    rows.append(b.measure("go.offload", "d2h", lambda: api.offload(tensors, arena=arena),
                          setup=ensure_resident, note="copy out, free the storages, empty_cache"))
    rows.append(b.measure("go.reload", "h2d", lambda: api.reload(tensors), setup=ensure_offloaded,
                          note="re-allocate the storages, copy back"))
    ensure_resident()
    b.info["arena"] = arena.stats()  # num_slab_allocations: pinned once, flat from the second cycle
    return rows


def measure_both_ways(b: Bench) -> list[Row]:
    """GPU only. Both directions at once: the limit is one D2H and one H2D of the same bytes on two streams;
    the engine swaps this layout out while a second copy of it comes back in."""
    if b.device.type != "cuda":
        return []
    device, nbytes, tensors, arena = b.device, b.nbytes, b.tensors, b.arena
    a, c = (torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2))
    ha, hc = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def both() -> None:
        with torch.cuda.stream(s1):
            ha.copy_(a, non_blocking=True)
        with torch.cuda.stream(s2):
            c.copy_(hc, non_blocking=True)

    rows = [b.measure("limit", "both", both, note="one D2H and one H2D of the same bytes on two streams",
                      moved=2 * nbytes)]
    del a, c, ha, hc
    _release_torch_pinned()
    other = make_tensors(b.layout, device)
    api.offload(other, arena=arena)
    pair = [tensors, other]

    def swap_once() -> None:
        api.swap(pair[0], pair[1], arena=arena)
        pair.reverse()

    rows.append(b.measure("go.swap", "both", swap_once, note="offload one while reloading another",
                          moved=2 * nbytes))
    if api.is_offloaded(tensors):
        api.swap(other, tensors, arena=arena)
    if api.is_offloaded(other):
        api.reload(other)
    return rows


def measure_first_use(b: Bench) -> list[Row]:
    """GPU only. A fresh arena: the first snapshot pins its memory (what a new process pays once), against
    allocating a pinned buffer with torch and copying into it. Timed once each: there is only one first."""
    if b.device.type != "cuda":
        return []
    tensors = b.tensors
    cold = Arena()

    def first() -> None:
        api.snapshot(tensors, arena=cold).wait().free()

    rows = [b.measure("go.first snapshot", "d2h", first, repeats=1, warmup=0,
                      note="a fresh arena: pinning included")]
    b.info["cold_arena"] = cold.stats()
    del cold

    def torch_pinned() -> None:
        host = torch.empty(b.nbytes, dtype=torch.uint8, pin_memory=True)
        off = 0
        for t_ in tensors.values():
            n = t_.numel() * t_.element_size()
            host[off:off + n].copy_(t_.reshape(-1).view(torch.uint8), non_blocking=True)
            off += n

    rows.append(b.measure("torch pinned + copy_", "d2h", torch_pinned, repeats=1, warmup=0,
                          note="torch.empty(pin_memory=True), then copy_ per tensor: pinning included"))
    _release_torch_pinned()
    return rows


def measure_baselines(b: Bench) -> list[Row]:
    """The per-tensor ways the engine replaces."""
    values = list(b.tensors.values())
    rows = []
    # p.cpu().clone() per tensor is what RL frameworks do today (verl's DetachActorWorker, the code this
    # project replaces).
    if b.device.type == "cuda":
        rows.append(b.measure("p.cpu().clone()", "d2h", lambda: [p.cpu().clone() for p in values], repeats=1,
                              note="per tensor, into pageable memory, as RL frameworks do (verl); timed once"))
        rows.append(b.measure("p.to(cpu,non_blocking)", "d2h",
                              lambda: [p.to("cpu", non_blocking=True) for p in values],
                              note="per tensor, then one synchronize"))
    else:
        rows.append(b.measure("p.cpu().clone()", "d2h", lambda: [p.cpu().clone() for p in values],
                              note="per tensor, as RL frameworks do (verl); on the CPU .cpu() is a no-op, "
                                   "so one clone each"))
    host = [torch.empty_like(p, device="cpu", pin_memory=b.pinned) for p in values]
    where = "pinned " if b.pinned else ""
    rows.append(b.measure(COPY_TO, "d2h", lambda: [h.copy_(p, non_blocking=True) for h, p in zip(host, values)],
                          note=f"copy_ per tensor into {where}host tensors allocated beforehand"))
    rows.append(b.measure(COPY_FROM, "h2d", lambda: [p.copy_(h, non_blocking=True) for h, p in zip(host, values)],
                          note=f"copy_ per tensor back from the {where}host tensors"))
    del host
    if b.pinned:
        _release_torch_pinned()
    return rows


# The best a per-tensor loop does: the baselines the engine's small-tensor layouts are compared with.
COPY_TO, COPY_FROM = "copy_ to preallocated", "copy_ from preallocated"


def measure_host_cost(b: Bench) -> list[Row]:
    """The engine's own host work per call for this layout's number of tensors: as many one-element tensors
    (the copies then cost next to nothing), as a dict, cached after the first call. In ms and in Y, Y being
    one Python pass `[t.data_ptr() for t in tensors]` over the same tensors in the same run: what any
    per-tensor Python code pays at least. On a GPU the calls are timed until they return (the host's
    share), snapshot+wait until its copies are done."""
    tensors = {name: torch.empty(1, dtype=b.layout.dtype, device=b.device) for name in b.tensors}
    values = list(tensors.values())
    arena = Arena()
    n = len(values)
    repeats = max(b.repeats, 5)
    y = b.measure("host: Y", "host", lambda: [t.data_ptr() for t in values], moved=0, repeats=repeats, sync=False,
                  note=f"one Python data_ptr() pass over {n} tensors")
    rows = [y]

    def in_y(what: str) -> Callable[[float], str]:
        return lambda seconds: f"{seconds / y.seconds:.2f} Y; {what}" if y.seconds > 0 else what

    def snapshot() -> None:
        api.snapshot(tensors, arena=arena).wait().free()

    # The cache is emptied before each call, untimed: a first call on a target drops no plan of its own.
    rows.append(b.measure("host: first snapshot", "host", snapshot, setup=_plan.clear_cache, moved=0,
                          repeats=min(3, repeats), sync=False,
                          note_of=in_y("uncached: the target read and laid out")))
    rows.append(b.measure("host: snapshot+wait+free", "host", snapshot, moved=0, repeats=repeats, sync=False,
                          note_of=in_y("cached target")))
    snap = api.snapshot(tensors, arena=arena).wait()
    rows.append(b.measure("host: restore", "host", lambda: api.restore(tensors, snap), moved=0, repeats=repeats,
                          sync=False, note_of=in_y("cached target")))
    snap.free()

    def cycle() -> None:
        api.offload(tensors, arena=arena, empty_cache=False)
        api.reload(tensors)

    rows.append(b.measure("host: offload+reload", "host", cycle, moved=0, repeats=repeats, sync=False,
                          note_of=in_y("cached target; the allocator's own work included")))
    return rows


# The groups `run` measures, in order; the limits come first (every ratio is to them) and are measured again
# after the engine's rows (see limit_drift); the host-cost rows, which move nothing, last.
GROUPS: list[Callable[[Bench], list[Row]]] = [measure_limits, measure_numa_limits, measure_engine, measure_both_ways,
                                              measure_first_use, measure_limits_again,
                                              measure_host_cost]


def run(layout: Layout, device: torch.device, *, repeats: int = 5, baselines: bool = True,
        progress: Optional[Callable[[str], None]] = None, on_row: Optional[Callable[[Row], None]] = None,
        groups: Optional[Sequence[Callable[[Bench], list[Row]]]] = None,
        extra_groups: Sequence[Callable[[Bench], list[Row]]] = ()) -> Result:
    """Measures every group on one layout; returns rows with GB/s, their spread and the ratio to the limit.

    `groups` replaces the default groups (GROUPS, then the baselines); `extra_groups` are measured after
    them (e.g. `gather_sweep(...)`, `bench_stager.measure_stager`). `progress(name)` is called before each
    group, `on_row(row)` after each finished measurement."""
    monitor = LoadMonitor()
    b = Bench(layout, device, repeats, on_row)
    dtype = str(layout.dtype).replace("torch.", "")
    result = Result(layout.name, str(device), layout.num_tensors, layout.nbytes, layout.scale, repeats, dtype)
    chosen = list(groups) if groups is not None else GROUPS + ([measure_baselines] if baselines else [])
    chosen += list(extra_groups)
    for group in chosen:
        if progress is not None:
            progress(group.__name__.replace("measure_", "").replace("_", " "))
        result.rows.extend(group(b))
    result.info.update(b.info)
    result.info["limits_gbps"] = dict(b.limits)
    result.info["load"] = monitor.stop()
    return result


def slower_than_per_tensor(result: Result) -> list[tuple[Row, Row]]:
    """The engine's snapshot, restore, offload and reload rows that moved fewer GB/s than a preallocated
    per-tensor copy_ in the same direction (which allocates and frees nothing), each with that baseline."""
    rows = {(r.method, r.direction): r for r in result.rows}
    out = []
    for method, direction, baseline in (("go.snapshot+wait", "d2h", COPY_TO), ("go.offload", "d2h", COPY_TO),
                                        ("go.restore", "h2d", COPY_FROM), ("go.reload", "h2d", COPY_FROM)):
        mine, theirs = rows.get((method, direction)), rows.get((baseline, direction))
        if mine is not None and theirs is not None and mine.gbps < theirs.gbps:
            out.append((mine, theirs))
    return out


def limit_drift(result: Result) -> list[dict[str, Any]]:
    """The directions whose limit, measured again after the engine's rows, moved by more than the spread of
    the repeats of either measurement (and by more than DRIFT_FLOOR): the machine's speed changed during the
    run, so ratios measured at different moments do not compare. Each: direction, the two medians in GB/s,
    their ratio (larger over smaller) and the spread it exceeded."""
    first = {r.direction: r for r in result.rows if r.method == "limit"}
    out = []
    for again in (r for r in result.rows if r.method == "limit again"):
        before = first.get(again.direction)
        if before is None:
            continue
        drift = max(before.gbps, again.gbps) / min(before.gbps, again.gbps)
        spread = max(before.spread, again.spread, DRIFT_FLOOR)
        if drift > spread:
            out.append({"direction": again.direction, "before_gbps": before.gbps, "after_gbps": again.gbps,
                        "drift": drift, "spread": spread})
    return out


def _cpu_seconds() -> Optional[tuple[float, float]]:
    """(busy seconds of the CPUs this process may run on, summed, from /proc/stat; this process's own CPU
    seconds, all threads); None where /proc/stat cannot be read (not Linux)."""
    import resource

    try:
        allowed = os.sched_getaffinity(0)
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except (OSError, AttributeError):
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in allowed:
            # user nice system idle iowait irq softirq steal: everything but idle and iowait is busy.
            values = [int(v) for v in fields[:8]] + [0] * (8 - len(fields[:8]))
            busy += sum(values) - values[3] - values[4]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return busy / tick, usage.ru_utime + usage.ru_stime


class LoadMonitor:
    """How busy the machine was during a run: the load average at its start and end and, on Linux, the
    cores that *other* processes kept busy on average (all busy CPU time of the CPUs this process may use,
    less this process's own, over the wall time): a process holding a core while the benchmark runs shows
    up here even when the repeats agree with each other."""

    def __init__(self) -> None:
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.load_start = _loadavg()
        self._t0 = time.perf_counter()
        self._cpu0 = _cpu_seconds()

    def stop(self) -> dict[str, Any]:
        cpu1, wall = _cpu_seconds(), time.perf_counter() - self._t0
        others = None
        if self._cpu0 is not None and cpu1 is not None and wall > 0:
            others = max(0.0, ((cpu1[0] - self._cpu0[0]) - (cpu1[1] - self._cpu0[1])) / wall)
        return {"cores": self.cores, "load_average_start": self.load_start, "load_average_end": _loadavg(),
                "other_processes_cores": others, "seconds": wall}


def busy_threshold(cores: int) -> float:
    """Cores kept busy by other processes above which a run is flagged: half a core, or a tenth of the
    machine's cores where that is more."""
    return max(0.5, 0.1 * cores)


def machine_busy(load: dict[str, Any]) -> Optional[str]:
    """Why the machine counts as busy for this run (None when it was quiet): other processes' cores during
    the run where they are known, else the load average at the start."""
    cores = load["cores"]
    others = load.get("other_processes_cores")
    if others is not None:
        if others >= busy_threshold(cores):
            return f"other processes kept {others:.1f} of its {cores} cores busy on average during the run"
        return None
    start = load.get("load_average_start")
    if start and start[0] >= busy_threshold(cores):
        return f"its load average was {start[0]:.1f} on {cores} cores at the start"
    return None


def _loadavg() -> Optional[list[float]]:
    return [round(v, 2) for v in os.getloadavg()] if hasattr(os, "getloadavg") else None


def run_metadata(device: torch.device) -> dict[str, Any]:
    """Where and when: timestamp, host, the package's git commit (in a checkout), torch, CUDA and driver."""
    import datetime
    import platform
    import shutil
    import subprocess

    meta: dict[str, Any] = {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "package_version": __version__,
        "commit": None,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "driver": None,
        "device_name": None,
        # How busy the machine was as the run began (1, 5, 15 minutes): a shared machine's figures swing.
        "load_average": _loadavg(),
    }
    src = Path(__file__).resolve().parent.parent
    if (src / ".git").exists() and shutil.which("git"):
        try:
            head = subprocess.run(["git", "-C", str(src), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                  text=True, timeout=10)
            dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10)
            if head.returncode == 0:
                meta["commit"] = head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
        except (OSError, subprocess.SubprocessError):
            pass
    if device.type == "cuda":
        meta["device_name"] = torch.cuda.get_device_name(device)
        if shutil.which("nvidia-smi"):
            try:
                smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                     capture_output=True, text=True, timeout=20)
                meta["driver"] = smi.stdout.split("\n")[0].strip() or None
            except (OSError, subprocess.SubprocessError):
                pass
    return meta


def default_scale(layout_name: str, device: torch.device) -> int:
    """How much to shrink a layout on this device: on the CPU, to roughly 100-250 MB per layout."""
    if device.type == "cuda":
        return 1
    return {"qwen1.5b": 16, "qwen7b": 64, "small64k": 4, "tiny4k": 2, "mixed": 16}.get(layout_name, 1)


def gather_sweep(thresholds: Sequence[int]) -> Callable[[Bench], list[Row]]:
    """A group (GPU only): snapshot+wait and restore with GPU_OFFLOAD_GATHER_MAX_BYTES set to each threshold in
    turn (storages up to it go through the gather/scatter kernel), in this process; one row per threshold
    and direction."""

    def measure_gather_sweep(b: Bench) -> list[Row]:
        if b.device.type != "cuda":
            return []
        tensors, arena = b.tensors, b.arena
        rows: list[Row] = []
        before = os.environ.get("GPU_OFFLOAD_GATHER_MAX_BYTES")
        try:
            for limit in thresholds:
                os.environ["GPU_OFFLOAD_GATHER_MAX_BYTES"] = str(int(limit))
                _plan.clear_cache()  # plans read the threshold when they are built
                held = _HeldSnapshot(tensors, arena)
                note = f"GPU_OFFLOAD_GATHER_MAX_BYTES={int(limit)}"
                label = "gather off" if limit == 0 else f"gather<={format_bytes(limit).replace(' ', '')}"
                rows.append(b.measure(f"go.snapshot {label}", "d2h", held.take, setup=held.free, note=note))
                rows.append(b.measure(f"go.restore {label}", "h2d", held.restore, note=note))
                held.free()
        finally:
            if before is None:
                os.environ.pop("GPU_OFFLOAD_GATHER_MAX_BYTES", None)
            else:
                os.environ["GPU_OFFLOAD_GATHER_MAX_BYTES"] = before
            _plan.clear_cache()
        return rows

    return measure_gather_sweep
