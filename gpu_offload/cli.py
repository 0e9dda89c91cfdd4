"""The `gpu-offload` command line: `bench` measures this machine's link and the engine; `info` says what
was built and what this machine allows."""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
from pathlib import Path
from typing import Any, NoReturn, Optional, Sequence

from ._errors import OffloadError

logger = logging.getLogger("gpu_offload")


class UsageError(Exception):
    """A bad option: reported on one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors, like every other bad option (argparse would print the usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _console() -> Any:
    """A rich console. Piped into a log (CI, `| tee`) rich assumes 80 columns and cuts the method names
    short; a log has room, so use a wide one unless COLUMNS says otherwise."""
    from rich.console import Console

    if not sys.stdout.isatty() and not os.environ.get("COLUMNS"):
        return Console(width=160)
    return Console()


def _parser() -> argparse.ArgumentParser:
    verbose_help = "debug logging (plan sizes, bytes, GB/s per call)"
    p = _Parser(prog="gpu-offload", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help=verbose_help)
    # The global options again for each command, so `gpu-offload bench -v` works too; SUPPRESS keeps a
    # command's parser from overwriting what was given before the command.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=verbose_help)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    b = sub.add_parser("bench", parents=[common],
                       help="measure the link limit, the engine and the baselines side by side")
    b.add_argument("--device", default=None, help="cpu or cuda (default: cpu)")
    b.add_argument("--layout", action="append", default=None,
                   help="qwen1.5b, qwen7b, small64k, tiny4k, mixed, all, or a JSON file of runs; repeatable "
                        "(default: qwen1.5b)")
    b.add_argument("--dtype", default=None, help="bfloat16, float16, float32 or uint8 (default: the layout's)")
    b.add_argument("--scale", type=int, default=None, help="divide each shape's first dimension by this "
                   "(default: 1 on a GPU, a per-layout factor on the CPU)")
    b.add_argument("--repeats", type=int, default=5,
                   help="timed repetitions per method (median, min and max reported)")
    b.add_argument("--no-baselines", action="store_true", help="skip the per-tensor baseline methods")
    b.add_argument("--gather-sweep", type=_byte_list, default=(), metavar="BYTES,...",
                   help="on a GPU, also time snapshot and restore with each gather threshold "
                        "(GPU_OFFLOAD_GATHER_MAX_BYTES), e.g. 0,64KiB,256KiB,1MiB")
    b.add_argument("--stager", action="store_true", help="also time checkpoint staging: gpu_offload's ArenaStager "
                   "beside torch.distributed.checkpoint's own stager, first call and steady state")
    b.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    b.add_argument("--markdown", type=Path, default=None, help="write the tables as Markdown here")
    b.add_argument("--plot", type=Path, default=None,
                   help="write a PNG of every method as a fraction of the limit here (needs matplotlib)")
    sub.add_parser("info", parents=[common], help="version, build, devices, pinned-memory limits, arena defaults, "
                   "and a check of every GPU_OFFLOAD_* setting")
    return p


def _byte_list(text: str) -> tuple[int, ...]:
    """Comma-separated byte counts, each with an optional unit (0,64KiB,256KiB,1MiB)."""
    from ._bytes import parse_bytes

    try:
        return tuple(parse_bytes(v.strip(), "byte count") for v in text.split(",") if v.strip())
    except OffloadError:
        raise argparse.ArgumentTypeError(f"expected comma-separated byte counts (e.g. 0,64KiB,1MiB), "
                                         f"got {text!r}") from None


def _device(name: Optional[str]):
    import torch

    name = name or "cpu"
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise UsageError(f"--device must be cpu or cuda, not {name!r}")
    if name.startswith("cuda"):
        from . import cuda_available

        if not torch.cuda.is_available():
            raise UsageError(f"--device {name}: no CUDA device is available on this machine")
        if not cuda_available():
            raise UsageError(f"--device {name}: gpu_offload was built without CUDA (reinstall with nvcc, "
                             "GPU_OFFLOAD_CUDA=1)")
        try:
            device = torch.device(name)
        except RuntimeError:
            raise UsageError(f"--device {name!r}: expected cuda or cuda:N") from None
        count = torch.cuda.device_count()
        if device.index is not None and not 0 <= device.index < count:
            raise UsageError(f"--device {name}: this machine has {count} CUDA device(s)")
        return device
    return torch.device(name)


def _writable(option: str, path: Optional[Path]) -> None:
    """Refuses an output path that cannot be written before the benchmark runs, not after: the folder is
    created and the file really opened for writing (os.access says yes to root in /proc). An existing file
    is opened without truncating; a new one is created and removed again."""
    if path is None:
        return
    if path.is_dir():
        raise UsageError(f"{option} {path}: is a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot create {path.parent}: {exc.strerror or exc}") from None
    existed = path.exists()
    try:
        fd = os.open(path, os.O_WRONLY | (0 if existed else os.O_CREAT | os.O_EXCL), 0o644)
    except OSError as exc:
        raise UsageError(f"{option} {path}: not writable: {exc.strerror or exc}") from None
    os.close(fd)
    if not existed:
        path.unlink()


def _gb(value: float) -> str:
    """GB/s with three significant digits (a 4 KiB-tensor baseline can be 0.004 GB/s)."""
    return f"{value:.3g}"


def _gbps_range(r: Any) -> str:
    if not r.nbytes:  # a host-cost row: nothing moved
        return "-" + (" !" if r.wide else "")
    return f"{_gb(r.gbps_min)}-{_gb(r.gbps_max)}" + (" !" if r.wide else "")


def _gbps(r: Any) -> str:
    return _gb(r.gbps) if r.nbytes else "-"


def _row_line(layout: str, r: Any) -> str:
    """One finished measurement on one line, for logs (stdout not a terminal)."""
    ratio = "" if r.ratio is None else f" = {r.ratio:.3g}x limit"
    wide = f" (spread {r.spread:.1f}x!)" if r.wide else ""
    if not r.nbytes:  # a host-cost row
        return (f"{layout}: {r.method} ({r.direction}) {r.seconds * 1e3:.3f} ms median{wide} over "
                f"{len(r.samples)} repeat(s); {r.note}")
    return (f"{layout}: {r.method} ({r.direction}) {_gb(r.gbps)} GB/s median{ratio}; min-max "
            f"{_gb(r.gbps_min)}-{_gb(r.gbps_max)} GB/s{wide} over {len(r.samples)} repeat(s); {r.seconds * 1e3:.2f} ms")


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.progress import Progress
    from rich.table import Table

    from . import _C, bench

    device = _device(args.device)
    if args.repeats < 1:
        raise UsageError("--repeats must be at least 1")
    if args.scale is not None and args.scale < 1:
        raise UsageError("--scale must be at least 1")
    if args.dtype is not None and args.dtype not in bench.DTYPE_NAMES:
        raise UsageError(f"--dtype must be one of {', '.join(bench.DTYPE_NAMES)}, not {args.dtype!r}")
    names = args.layout or ["qwen1.5b"]
    if "all" in names:
        names = list(bench.LAYOUT_NAMES)
    layouts = []
    for name in names:
        scale = args.scale if args.scale is not None else bench.default_scale(name, device)
        try:
            layouts.append(bench.load_layout(name, dtype=args.dtype, scale=scale))
        except OffloadError as exc:
            raise UsageError(str(exc)) from None
    # Refuse up front what would run the machine out of memory halfway through (layouts run one by one).
    available = int(_C.available_host_memory())
    for layout in layouts:
        needed = bench.host_bytes_needed(layout, device)
        if needed > available:
            raise UsageError(f"layout {layout.name}: {layout.nbytes / 1e9:.2f} GB needs about {needed / 1e9:.1f} GB "
                             f"of host memory, {available / 1e9:.1f} GB available; use a larger --scale")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401  (checked now: the results would be lost after the run)
        except ModuleNotFoundError:
            raise UsageError(f"--plot {args.plot}: needs matplotlib: pip install 'gpu-offload[plot]'") from None
    # The settings the engine will read, checked now rather than at its first copy.
    info = info_dict()
    # Last of the checks, as it creates the output folders.
    _writable("--json", args.json)
    _writable("--plot", args.plot)
    _writable("--markdown", args.markdown)
    console = _console()
    meta = bench.run_metadata(device)
    extra: list[Any] = []
    if args.gather_sweep:  # GPU only: the group measures nothing on the CPU
        extra.append(bench.gather_sweep(args.gather_sweep))
    if args.stager:  # checkpoint staging (gpu_offload/bench_stager.py), in the same table
        from .bench_stager import measure_stager

        extra.append(measure_stager)
    results = []
    if console.is_terminal:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("bench", total=len(layouts) * (len(bench.GROUPS) + 1 + len(extra)))
            for layout in layouts:
                def step(what: str, layout=layout) -> None:
                    progress.update(task, advance=1, description=f"{layout.name}: {what}")

                results.append(bench.run(layout, device, repeats=args.repeats, baselines=not args.no_baselines,
                                         progress=step, extra_groups=extra))
    else:
        # A log (CI, `| tee`): one line per finished measurement as it goes, not everything at the end.
        for layout in layouts:
            def line(row: Any, layout=layout) -> None:
                print(_row_line(layout.name, row), flush=True)

            results.append(bench.run(layout, device, repeats=args.repeats, baselines=not args.no_baselines,
                                     on_row=line, extra_groups=extra))
    wide = []
    for res in results:
        table = Table(title=f"{res.layout} on {res.device}: {res.num_tensors} tensors, {res.nbytes / 1e9:.3f} GB"
                            + (f" (scaled 1/{res.scale})" if res.scale > 1 else "")
                            + f", {res.repeats} repeat(s)")
        for col in ("method", "dir", "ms", "GB/s", "min-max GB/s", "x limit", "note"):
            table.add_column(col, justify="right" if col in ("ms", "GB/s", "min-max GB/s", "x limit") else "left")
        for r in res.rows:
            table.add_row(r.method, r.direction, f"{r.seconds * 1e3:.2f}", _gbps(r), _gbps_range(r),
                          "" if r.ratio is None else f"{r.ratio:.3g}", r.note)
            if r.wide:
                wide.append(f"{res.layout}: {r.method} ({r.direction}) {r.spread:.1f}x")
        console.print(table)
    console.print("ms, GB/s and x limit are the median of the repeats; min-max is the slowest and the fastest "
                  "repeat; x limit is to the limit of the same direction in the same run.")
    if wide:
        console.print(f"warning: {len(wide)} measurement(s) varied more than {bench.WIDE_SPREAD}x between repeats "
                      f"(fastest/slowest, marked !): {'; '.join(wide)}. The machine was busy or noisy; "
                      "rerun with more --repeats on a quiet machine before reading much into them.")
    if args.repeats == 1:
        console.print("note: one repeat per method says nothing about the spread; use --repeats 5 or more.")
    if args.json:
        record = {"schema_version": bench.SCHEMA_VERSION, **meta, "device": str(device), "repeats": args.repeats,
                  "results": [r.to_json() for r in results], "info": info}
        text = json.dumps(record, indent=1, default=str)
        try:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(text)
        except OSError as exc:
            raise UsageError(f"--json {args.json}: cannot write: {exc.strerror or exc}") from None
        console.print(f"wrote {args.json}")
    if args.markdown:
        try:
            args.markdown.write_text(markdown(results, meta, args))
        except OSError as exc:
            raise UsageError(f"--markdown {args.markdown}: cannot write: {exc.strerror or exc}") from None
        console.print(f"wrote {args.markdown}")
    if args.plot:
        try:
            plot(results, args.plot, meta=meta)
        except OSError as exc:
            raise UsageError(f"--plot {args.plot}: cannot write: {exc.strerror or exc}") from None
        console.print(f"wrote {args.plot}")
    return 0


def markdown(results: list, meta: dict, args: argparse.Namespace) -> str:
    """The tables as Markdown, headed by the command and the run's metadata."""
    layouts = " ".join(f"--layout {name}" for name in (args.layout or ["qwen1.5b"]))
    lines = [f"# gpu-offload bench, {meta.get('timestamp', '')}", "",
             f"`gpu-offload bench --device {args.device or 'cpu'} {layouts} --repeats {args.repeats}`"
             + (" `--no-baselines`" if args.no_baselines else ""), "",
             f"host {meta.get('host')} ({meta.get('machine')}), device {meta.get('device_name') or results[0].device}, "
             f"commit {meta.get('commit') or 'unknown'}, torch {meta.get('torch')}, CUDA {meta.get('torch_cuda')}, "
             f"driver {meta.get('driver')}"
             + (f", load average {meta['load_average'][0]:.1f} at the start" if meta.get("load_average") else ""), "",
             "GB/s and x limit: median of the repeats; min-max: slowest and fastest repeat (! = more than "
             "1.5x apart); x limit: to the limit of the same direction in the same run.", ""]
    for res in results:
        lines += [f"## {res.layout}: {res.num_tensors} tensors, {res.nbytes / 1e9:.3f} GB {res.dtype}"
                  + (f", scaled 1/{res.scale}" if res.scale > 1 else "") + f", {res.repeats} repeats", "",
                  "| method | dir | ms | GB/s | min-max GB/s | x limit | note |", "|---|---|---:|---:|---:|---:|---|"]
        for r in res.rows:
            ratio = "" if r.ratio is None else f"{r.ratio:.3g}"
            lines.append(f"| {r.method} | {r.direction} | {r.seconds * 1e3:.2f} | {_gbps(r)} | {_gbps_range(r)} "
                         f"| {ratio} | {r.note} |")
        lines.append("")
    return "\n".join(lines)


# gpu_offload's own rows (blue in the plot): the engine group, the first snapshot, the gather-threshold sweep
# and the checkpoint stager; everything else is a baseline.
_ENGINE_PREFIXES = ("gpu_offload.", "first snapshot", "snapshot+wait, gather", "restore, gather", "ArenaStager")


def _is_engine(method: str) -> bool:
    return method.startswith(_ENGINE_PREFIXES)


def plot(results: list, path: Path, meta: Optional[dict] = None) -> None:
    """One figure: for each layout, every method's throughput as a fraction of the limit measured in the
    same run (the limit is the line at 1.0), gpu_offload in blues, the per-tensor baselines in oranges, on a
    log scale (baselines can be 30x slower); whiskers span the slowest and the fastest repeat."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    meta = meta or {}
    methods: list[tuple[str, str]] = []  # (method, direction), in order of first appearance
    for res in results:
        for r in res.rows:
            if r.ratio is not None and (r.method, r.direction) not in methods:
                methods.append((r.method, r.direction))
    engine = [m for m in methods if _is_engine(m[0])]
    baselines = [m for m in methods if not _is_engine(m[0])]
    order = engine + baselines
    colors = {m: plt.cm.Blues(0.45 + 0.5 * i / max(1, len(engine) - 1)) for i, m in enumerate(engine)}
    colors.update({m: plt.cm.Oranges(0.35 + 0.5 * i / max(1, len(baselines) - 1)) for i, m in enumerate(baselines)})

    # Constrained layout keeps the legend under the axes inside the 1400 x 800 px figure.
    fig, ax = plt.subplots(figsize=(14, 8), dpi=100, layout="constrained")
    width = 0.84 / max(1, len(order))
    labelled: set = set()
    lows, highs = [1.0], [1.0]
    for li, res in enumerate(results):
        by = {(r.method, r.direction): r for r in res.rows}
        for mi, key in enumerate(order):
            r = by.get(key)
            if r is None or r.ratio is None:
                continue
            x = li + (mi - (len(order) - 1) / 2) * width
            limit = r.gbps / r.ratio
            lo, hi = r.gbps_min / limit, r.gbps_max / limit
            ax.bar(x, r.ratio, width * 0.92, color=colors[key], edgecolor="white", linewidth=0.5,
                   label=None if key in labelled else f"{key[0]} ({key[1]})")
            labelled.add(key)
            ax.errorbar(x, r.ratio, yerr=[[r.ratio - lo], [hi - r.ratio]], fmt="none", ecolor="black",
                        elinewidth=0.9, capsize=2)
            lows.append(lo)
            highs.append(hi)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1.4,
               label="limit = 1.0: one contiguous copy of the same bytes")
    ax.set_yscale("log")
    steps = [m * 10.0**e for e in range(-5, 3) for m in (1, 2, 5)]
    bottom = max([v for v in steps if v <= max(min(lows), 1e-5) * 0.8] or [1e-5])
    top = max(highs) * 1.6
    ax.set_ylim(bottom, top)
    ticks = [v for v in steps if bottom <= v <= top]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.grid(axis="y", color="0.85", linewidth=0.8)
    ax.set_axisbelow(True)
    labels = []
    for res in results:
        lim = res.info.get("limits_gbps", {})
        parts = [f"{d} {_gb(lim[d])}" for d in ("d2h", "h2d", "both") if d in lim]
        labels.append(f"{res.layout}\n{res.num_tensors} tensors\n{res.nbytes / 1e9:.2f} GB"
                      + (f" (1/{res.scale})" if res.scale > 1 else "") + f"\nlimit GB/s:\n{', '.join(parts)}")
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels(labels, fontsize=10)
    ax.set_xlim(-0.5, len(results) - 0.5)
    ax.set_ylabel("throughput / limit in the same run (log scale)\nbar: median of the repeats; whisker: "
                  "slowest to fastest repeat", fontsize=11)
    ax.tick_params(axis="y", labelsize=10)
    fig.legend(loc="outside lower center", ncol=4, fontsize=10, frameon=False,
               title="blue: gpu_offload    orange: per-tensor baselines", title_fontsize=10)
    device = results[0].device if results else "?"
    machine = meta.get("device_name") or (f"CPU only ({meta.get('machine', '')}; the link is host memory)"
                                          if device == "cpu" else device)
    when = (meta.get("timestamp") or "")[:10]
    load = meta.get("load_average")
    busy = f", load average {load[0]:.1f} at the start" if load else ""
    repeats = results[0].repeats if results else 0
    ax.set_title(f"gpu_offload bench on {machine}: each method as a fraction of the limit\n"
                 f"{when}, host {meta.get('host', '?')}, commit {meta.get('commit') or 'unknown'}, "
                 f"{repeats} repeats, torch {meta.get('torch', '?')}{busy}", fontsize=12)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        # PNG whatever the name says: matplotlib would otherwise pick (or reject) a format by the suffix.
        fig.savefig(path, dpi=100, format="png")
    finally:
        plt.close(fig)


def info_dict() -> dict:
    import platform

    import torch

    from . import _C, build_info, cuda_available, torch_ext
    from .arena import _DEFAULT_MIN_SLAB_BYTES, Arena, _env_int
    from .plan import gather_max_bytes

    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    # Read the way default_arena() reads them, and checked by building (not using: nothing is allocated
    # before the first region) an arena from them, so a setting the default arena would refuse at its
    # first use is refused here, with the same message.
    # Every variable `info` shows is read here as the library reads it, so a bad one is refused now.
    try:
        host_threads = int(_C.host_threads())  # GPU_OFFLOAD_NUM_THREADS, read by the core
    except OffloadError as exc:
        raise OffloadError(f"the host copy pool's environment is refused: {exc}") from None
    gather = gather_max_bytes()  # GPU_OFFLOAD_GATHER_MAX_BYTES
    max_bytes = _env_int("GPU_OFFLOAD_ARENA_MAX_BYTES")
    min_slab = _env_int("GPU_OFFLOAD_MIN_SLAB_BYTES")
    pin = os.environ.get("GPU_OFFLOAD_PIN", "auto")
    try:
        Arena(max_bytes, min_slab_bytes=min_slab, pin=pin)
    except OffloadError as exc:
        raise OffloadError(f"the default arena's environment (GPU_OFFLOAD_ARENA_MAX_BYTES, GPU_OFFLOAD_MIN_SLAB_BYTES, "
                           f"GPU_OFFLOAD_PIN) is refused: {exc}") from None
    devices = []
    if cuda_available():
        import torch.cuda

        devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "build": build_info(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda_available": cuda_available(),
        "devices": devices,
        "host_memory_available_bytes": int(_C.available_host_memory()),
        "memlock_limit_bytes": None if soft == resource.RLIM_INFINITY else soft,
        "arena": {
            "max_bytes": max_bytes,
            "min_slab_bytes": min_slab if min_slab is not None else _DEFAULT_MIN_SLAB_BYTES,
            "pin": pin,
        },
        "host_threads": host_threads,
        "gather_max_bytes": gather,
        "torch_ext": torch_ext.status(),  # the torch-aware helper: loaded, or why not
    }


def cmd_info(args: argparse.Namespace) -> int:
    from rich.table import Table

    info = info_dict()
    table = Table(show_header=False, title="gpu_offload")
    b = info["build"]
    table.add_row("version", b["version"])
    table.add_row("built with CUDA", str(b["cuda"]))
    table.add_row("CUDA runtime", str(b["cuda_runtime_version"]))
    table.add_row("architectures", ", ".join(b["cuda_architectures"]) or "-")
    table.add_row("torch / python", f"{info['torch']} / {info['python']}")
    table.add_row("CUDA available", str(info["cuda_available"]))
    table.add_row("devices", ", ".join(info["devices"]) or "-")
    table.add_row("host memory available", f"{info['host_memory_available_bytes'] / 2**30:.1f} GiB")
    lim = info["memlock_limit_bytes"]
    table.add_row("ulimit -l", "unlimited" if lim is None else f"{lim / 2**20:.1f} MiB")
    a = info["arena"]
    table.add_row("arena max_bytes", str(a["max_bytes"] or "none"))
    table.add_row("arena min slab", f"{a['min_slab_bytes'] / 2**20:.0f} MiB")
    table.add_row("arena pinning", a["pin"])
    table.add_row("host copy threads", str(info["host_threads"]))
    table.add_row("gather max bytes", str(info["gather_max_bytes"]))
    table.add_row("torch helper", info["torch_ext"])
    _console().print(table)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    # -v is this library's debug log, not every library's (matplotlib's font search would drown it).
    logger.setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    try:
        return {"bench": cmd_bench, "info": cmd_info}[args.command](args)
    except (UsageError, OffloadError) as exc:
        # One line whatever the message (errors from the core may carry a newline).
        print(f"gpu-offload: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if exc.name not in ("rich", "matplotlib"):
            raise
        extra = "plot" if exc.name == "matplotlib" else "all"
        print(f"gpu-offload: error: needs {exc.name}: pip install 'gpu-offload[{extra}]'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gpu-offload: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
