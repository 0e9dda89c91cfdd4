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


def _version_line() -> str:
    """`gpu-offload --version`: the package, how it was built, and the torch and Python it runs with."""
    import platform

    import torch

    from . import __version__, build_info

    b = build_info()
    cuda = "built without CUDA"
    if b["cuda"]:
        fatbin = (b.get("cuda_driver") or {}).get("fatbin_architectures")
        cuda = "CUDA on the driver API, " + (f"kernels for {fatbin}" if fatbin else "kernels by NVRTC at first use")
    return f"gpu-offload {__version__} ({cuda}; torch {torch.__version__}, Python {platform.python_version()})"


class _VersionAction(argparse.Action):
    """--version, computed only when asked (it imports torch)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(_version_line())  # on stdout, as --version does everywhere
        parser.exit(0)


def _parser() -> argparse.ArgumentParser:
    verbose_help = "debug logging (plan sizes, bytes, GB/s per call)"
    p = _Parser(prog="gpu-offload", description=__doc__)
    p.add_argument("--version", action=_VersionAction, help="print the version, the build, torch and Python, then exit")
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
                   help="timed repetitions per method, after one untimed warm-up; the median, the slowest and "
                        "the fastest are reported (default: %(default)s)")
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
    i = sub.add_parser("info", parents=[common], help="version, build, devices, pinned-memory limits, arena defaults, "
                       "and a check of every GPU_OFFLOAD_* setting")
    i.add_argument("--json", action="store_true", help="print the same facts as one JSON object")
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
    if len(r.samples) < 2:
        return "-"  # one repeat: no spread to show
    return f"{_gb(r.gbps_min)}-{_gb(r.gbps_max)}" + (" !" if r.wide else "")


def _gbps(r: Any) -> str:
    return _gb(r.gbps) if r.nbytes else "-"  # a host-cost row: nothing moved


def _bench_table(res: Any) -> Any:
    """One layout's table. The method column is never cut (short names, no wrapping): at 80 columns the
    numbers fold before a name would; what each method does is listed once, under the last table."""
    from rich.table import Table

    size = f"{res.nbytes / 1e9:.3g} GB" + (f" (scaled 1/{res.scale})" if res.scale > 1 else "")
    table = Table(title=f"{res.layout} on {res.device}: {res.num_tensors} tensors, {size}, {res.repeats} "
                        f"repeat{'s' if res.repeats != 1 else ''}")
    width = max([len("method")] + [len(r.method) for r in res.rows])
    table.add_column("method", no_wrap=True, min_width=width)
    table.add_column("dir", no_wrap=True)
    for col in ("ms", "GB/s", "min-max", "x limit"):
        table.add_column(col, justify="right", overflow="fold")
    kind = None
    for r in res.rows:
        if kind is not None and r.kind != kind:
            table.add_section()  # the limits, gpu_offload's own methods and the per-tensor baselines apart
        kind = r.kind
        table.add_row(r.method, r.direction, f"{r.seconds * 1e3:.2f}", _gbps(r), _gbps_range(r),
                      "" if r.ratio is None else f"{r.ratio:.3g}")
    return table


def _method_notes(results: list) -> list[tuple[str, str]]:
    """(method, what it does) for every method measured, once each, in table order."""
    notes: dict[str, str] = {}
    for res in results:
        for r in res.rows:
            if r.note and r.method not in notes:
                notes[r.method] = r.note
    return list(notes.items())


def _bench_summary(results: list, device: Any, load: dict, repeats: int, layouts_asked: Sequence[str]) -> list[str]:
    """What to print under the tables: how to read them, how busy the machine was, and warnings."""
    from . import bench

    lines = ["ms, GB/s and x limit: the median of the repeats; min-max: the slowest and the fastest repeat (! more "
             f"than {bench.WIDE_SPREAD}x apart); x limit: to the limit of the same direction in the same run, "
             f"the limit being {bench.limit_note(device)}."]
    end = load.get("load_average_end")
    others = load.get("other_processes_cores")
    facts = [f"load average {end[0]:.2f} at the end"] if end else []
    if others is not None:
        facts.append(f"other processes kept {others:.1f} of its {load['cores']} cores busy on average")
    if facts:
        lines.append(f"machine during the run ({load['seconds']:.0f} s): {'; '.join(facts)}.")
    busy = bench.machine_busy(load)
    if busy is not None:
        lines.append(f"warning: the machine was busy ({busy}): every figure, the limit included, is slower and "
                     "noisier than on a quiet machine; rerun when it is quiet before relying on them.")
    for res in results:
        drift = bench.limit_drift(res)
        if drift:
            moves = ", ".join(f"{d['direction']} {_gb(d['before_gbps'])} -> {_gb(d['after_gbps'])} GB/s "
                              f"({d['drift']:.2f}x, spread {d['spread']:.2f}x)" for d in drift)
            lines.append(f"warning: {res.layout}: the limit measured before and after the engine's rows differs by "
                         f"more than the spread of its repeats ({moves}): the machine's speed changed during the "
                         "run, so the ratios do not compare; rerun on a quiet machine.")
    wide = [f"{res.layout}: {r.method} ({r.direction}) {r.spread:.1f}x" for res in results for r in res.rows if r.wide]
    if wide:
        lines.append(f"warning: {len(wide)} measurement(s) varied more than {bench.WIDE_SPREAD}x between repeats "
                     f"(fastest/slowest, marked !): {'; '.join(wide)}. The machine was busy or noisy; rerun with "
                     "more --repeats on a quiet machine before reading much into them.")
    if repeats == 1:
        lines.append("note: one repeat per method says nothing about the spread; use --repeats 5 or more.")
    for res in results:
        lost = bench.slower_than_per_tensor(res)
        if lost:
            parts = ", ".join(f"{mine.method} {mine.ratio:.3g}x against {theirs.ratio:.3g}x"
                              for mine, theirs in lost)
            lines.append(f"note: {res.layout}: slower than a preallocated per-tensor copy_ of the same direction "
                         f"(x limit): {parts}.")
    measured = [res.layout for res in results]
    if device.type == "cpu" and set(layouts_asked) <= {"qwen1.5b", "qwen7b", "mixed"}:
        lines.append(f"note: {', '.join(measured)}: few, large tensors, where the CPU engine does well. With thousands "
                     "of small "
                     "ones (tiny4k, small64k) it can be slower than a preallocated per-tensor copy_ (offload and "
                     "reload free and re-allocate every tensor): run with --layout all to measure them here.")
    return lines


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.progress import Progress

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
    monitor = bench.LoadMonitor()
    load = meta.get("load_average")
    import platform

    console.print(f"gpu-offload bench {info['build']['version']} on {device} ({platform.machine()}): {meta['cores']} "
                  "cores" + (f", load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1, 5, 15 min)" if load else ""))
    for line in info["unknown_environment"]:
        console.print(f"warning: {line}")
    extra: list[Any] = []
    if args.gather_sweep:  # GPU only: the group measures nothing on the CPU
        if device.type != "cuda":
            console.print("warning: --gather-sweep measures the GPU's gather kernel: nothing to sweep on the CPU")
        extra.append(bench.gather_sweep(args.gather_sweep))
    if args.stager:  # checkpoint staging (gpu_offload/bench_stager.py), in the same table
        from .bench_stager import measure_stager

        extra.append(measure_stager)
    results = []
    # Each layout's table as soon as it is measured, once: on a terminal under a progress bar that then
    # disappears, in a log (CI, `| tee`) as the layouts finish.
    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("bench", total=len(layouts) * (len(bench.GROUPS) + 1 + len(extra)))
        for layout in layouts:
            def step(what: str, layout=layout) -> None:
                progress.update(task, advance=1, description=f"{layout.name}: {what}")

            res = bench.run(layout, device, repeats=args.repeats, baselines=not args.no_baselines, progress=step,
                            extra_groups=extra)
            results.append(res)
            console.print(_bench_table(res))
    load_info = monitor.stop()
    meta["load"] = load_info
    notes = _method_notes(results)
    if notes:
        from rich.table import Table

        legend = Table(box=None, show_header=False, padding=(0, 1, 0, 0), title="methods", title_justify="left")
        legend.add_column(no_wrap=True)
        legend.add_column()
        for method, note in notes:
            legend.add_row(method, note)
        console.print(legend)
    for line in _bench_summary(results, device, load_info, args.repeats, names):
        console.print(line)
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
             f"driver {meta.get('driver')}, {meta.get('cores')} cores"
             + (f", load average {meta['load_average'][0]:.1f} at the start" if meta.get("load_average") else "")
             + (f", other processes kept {meta['load']['other_processes_cores']:.1f} cores busy during the run"
                if (meta.get("load") or {}).get("other_processes_cores") is not None else ""), "",
             "GB/s and x limit: median of the repeats; min-max: slowest and fastest repeat (! = more than "
             "1.5x apart); x limit: to the limit of the same direction in the same run (`limit again`: the limit "
             "measured after the engine's rows, to the first).", ""]
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


# Colours told apart at a glance (and in grey, by their hatching): gpu_offload's methods in blues, the
# baselines in oranges, the re-measured limit in grey; both lists repeat with another hatching if needed.
_ENGINE_COLORS = ("#08306b", "#2171b5", "#6baed6", "#c6dbef", "#08519c", "#4292c6", "#9ecae1")
_BASELINE_COLORS = ("#7f2704", "#d94801", "#fd8d3c", "#fdd0a2", "#a63603", "#f16913")
_HATCHES = ("", "//", "..", "xx", "\\\\", "++", "oo")


def plot(results: list, path: Path, meta: Optional[dict] = None) -> None:
    """Writes `figure(results, meta)` as a 1400 x 800 px PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = figure(results, meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        # PNG whatever the name says: matplotlib would otherwise pick (or reject) a format by the suffix.
        fig.savefig(path, dpi=100, format="png")
    finally:
        plt.close(fig)


def figure(results: list, meta: Optional[dict] = None) -> Any:
    """One figure: for each layout, every method's throughput as a fraction of the limit measured in the
    same run, on a linear axis from 0 (a bar's length is its ratio; the limit is the line at 1.0), each bar
    labelled with its value; gpu_offload in blues, the per-tensor baselines in oranges, each method with its
    own shade and hatching; whiskers span the slowest and the fastest repeat. The legend lists the methods
    in the order of the bars. The limit measured again after the engine's rows is no bar (a ratio to the
    limit itself, which would set the axis when the machine's speed moved): its GB/s are under the layout,
    beside the first limit's, marked `!` where bench.limit_drift flags them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from . import bench

    meta = meta or {}
    methods: list[tuple[str, str, str]] = []  # (method, direction, kind), in order of first appearance
    for res in results:
        for r in res.rows:
            key = (r.method, r.direction, r.kind)
            if r.ratio is not None and r.kind != "limit" and key not in methods:
                methods.append(key)
    order = [m for m in methods if m[2] == "engine"] + [m for m in methods if m[2] == "baseline"]
    style: dict[tuple[str, str, str], tuple[str, str]] = {}
    counts = {"engine": 0, "baseline": 0}
    for key in order:
        i = counts[key[2]]
        counts[key[2]] += 1
        palette = _ENGINE_COLORS if key[2] == "engine" else _BASELINE_COLORS
        style[key] = (palette[i % len(palette)], _HATCHES[i % len(_HATCHES)])

    # Constrained layout keeps the legend beside the axes inside the 1400 x 800 px figure.
    fig, ax = plt.subplots(figsize=(14, 8), dpi=100, layout="constrained")
    width = 0.84 / max(1, len(order))
    handles: dict[tuple[str, str, str], Any] = {}
    top = 1.0
    for li, res in enumerate(results):
        by = {(r.method, r.direction, r.kind): r for r in res.rows}
        for mi, key in enumerate(order):
            r = by.get(key)
            if r is None or r.ratio is None:
                continue
            x = li + (mi - (len(order) - 1) / 2) * width
            limit = r.gbps / r.ratio
            lo, hi = r.gbps_min / limit, r.gbps_max / limit
            color, hatch = style[key]
            bar = ax.bar(x, r.ratio, width * 0.92, color=color, hatch=hatch, edgecolor="white", linewidth=0.5)
            handles.setdefault(key, bar)
            ax.errorbar(x, r.ratio, yerr=[[r.ratio - lo], [hi - r.ratio]], fmt="none", ecolor="black",
                        elinewidth=0.9, capsize=2)
            ax.annotate(f"{r.ratio:.3g}" if r.ratio < 100 else f"{r.ratio:.0f}", (x, hi), xytext=(0, 2),
                        textcoords="offset points", ha="center", va="bottom", fontsize=7,
                        rotation=90 if len(order) > 6 else 0)
            top = max(top, hi)
    line = ax.axhline(1.0, color="black", linestyle="--", linewidth=1.4)
    ax.set_ylim(0, top * 1.15)
    ax.grid(axis="y", color="0.85", linewidth=0.8)
    ax.set_axisbelow(True)
    labels = []
    for res in results:
        lim = res.info.get("limits_gbps", {})
        parts = [f"{d} {_gb(lim[d])}" for d in ("d2h", "h2d", "both") if d in lim]
        moved = {d["direction"] for d in bench.limit_drift(res)}
        again = [f"{r.direction} {_gb(r.gbps)}" + (" !" if r.direction in moved else "")
                 for r in res.rows if r.method == "limit again"]
        labels.append(f"{res.layout}\n{res.num_tensors} tensors\n{res.nbytes / 1e9:.3g} GB"
                      + (f" (1/{res.scale})" if res.scale > 1 else "") + f"\nlimit GB/s:\n{', '.join(parts)}"
                      + (f"\nagain after the engine:\n{', '.join(again)}" if again else ""))
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels(labels, fontsize=10)
    ax.set_xlim(-0.5, len(results) - 0.5)
    device = results[0].device if results else "?"
    ax.set_ylabel("throughput / limit in the same run (linear, from 0)\nbar: median of the repeats; whisker: "
                  "slowest to fastest repeat", fontsize=11)
    ax.tick_params(axis="y", labelsize=10)
    limit_label = ("limit = 1.0: one contiguous copy\nof the same bytes"
                   + (" (no link on the CPU)" if device == "cpu" else " over the link"))
    fig.legend([line] + [handles[k] for k in order if k in handles],
               [limit_label] + [f"{k[0]} ({k[1]})" for k in order if k in handles],
               loc="outside right upper", ncol=1, fontsize=9, frameon=False,
               title="blue: gpu_offload\norange: per-tensor baselines", title_fontsize=9)
    machine = meta.get("device_name") or (f"CPU only ({meta.get('machine', '')})" if device == "cpu" else device)
    when = (meta.get("timestamp") or "")[:10]
    load = meta.get("load_average")
    busy = f", load average {load[0]:.1f} at the start" if load else ""
    repeats = results[0].repeats if results else 0
    version = meta.get("package_version") or "?"
    commit = meta.get("commit")
    source = f"commit {commit}" if commit else "installed from a release"
    ax.set_title(f"gpu_offload {version} ({source}) on {machine}: each method as a fraction of the limit\n"
                 f"{when}, host {meta.get('host', '?')}, {repeats} repeats, torch {meta.get('torch', '?')}{busy}",
                 fontsize=12)
    return fig


def info_dict() -> dict:
    """What `gpu-offload info` shows (and `info --json` prints), every setting read and checked the way the
    library reads it. Keys ending in `_bytes` are byte counts (None: no limit); `cuda_*version` values are
    CUDA's integers (13000 for 13.0)."""
    import platform

    import torch

    from . import _C, _env, _topology, build_info, cuda_available, torch_ext
    from .arena import _DEFAULT_MIN_SLAB_BYTES, Arena, _env_arena_bytes, memory_stats, node_budget_from_env
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
    max_bytes = _env_arena_bytes("GPU_OFFLOAD_ARENA_MAX_BYTES")
    min_slab = _env_arena_bytes("GPU_OFFLOAD_MIN_SLAB_BYTES")
    pin = os.environ.get("GPU_OFFLOAD_PIN", "auto")
    node_max, ledger_dir = node_budget_from_env()  # GPU_OFFLOAD_NODE_MAX_BYTES, GPU_OFFLOAD_LEDGER_DIR
    try:
        Arena(max_bytes, min_slab_bytes=min_slab, pin=pin)
    except OffloadError as exc:
        raise OffloadError(f"the default arena's environment (GPU_OFFLOAD_ARENA_MAX_BYTES, GPU_OFFLOAD_MIN_SLAB_BYTES, "
                           f"GPU_OFFLOAD_PIN) is refused: {exc}") from None
    devices = []
    gpus = []
    if cuda_available():
        import torch.cuda

        devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        for i, name in enumerate(devices):
            address = _topology.pci_address(i)
            node, why = _topology.read_numa_node(address)
            gpus.append({"index": i, "name": name, "pci_address": address,
                         "numa_node": None if node == _topology.UNKNOWN else node, "numa_unknown_why": why or None})
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
            # What "auto" becomes at the first slab: register when a CUDA device answers, else none.
            "pin_resolved": pin if pin != "auto" else ("register" if cuda_available() else "none"),
        },
        "host_threads": host_threads,
        "gather_max_bytes": gather,
        "node_budget": {"max_bytes": node_max, "ledger_dir": ledger_dir},
        "numa_nodes": _topology.online_nodes(),
        "gpus": gpus,  # each GPU's PCI address and NUMA node
        "memory": memory_stats(),  # this process's arenas (empty in a fresh `info`) and the node's ledger
        "torch_ext": torch_ext.status(),  # the torch-aware helper: loaded, or why not
        # The GPU_OFFLOAD_* variables set, and those gpu_offload does not know (ignored; a typo?).
        "environment": {k: v for k, v in sorted(os.environ.items()) if k in _env.VARIABLES},
        "unknown_environment": _env.describe_unknown(),
    }


def driver_summary(build: dict) -> str:
    """One line for build_info()["cuda_driver"]: the driver's version and how copies are enqueued."""
    d = build.get("cuda_driver")
    if not d:
        return "-"
    simulated = " (simulated)" if d["driver_source"] == "simulated" else ""
    if not d["driver"]:
        # Why there is none (no libcuda.so.1, a driver older than R535, cuInit refused): the CPU path still works.
        why = f": {d['driver_error']}" if d.get("driver_error") else ""
        return "none" + simulated + why
    how = "batched copies" if d["batched_copies"] else "one call per copy"
    return f"{_cuda_version(d['driver_version'])}, {how}{simulated}"


def kernels_summary(build: dict) -> str:
    """Where the gather and checksum kernels come from: the fatbin, NVRTC at first use, or none."""
    d = build.get("cuda_driver")
    if not d:
        return "-"
    off = "copy engines only, GPU checksums refused"
    loaded = ", ".join(f"cuda:{k['device']} {k['source']} {k['arch']}" +
                       (f" (off: {off}; {k['error']})" if k["source"] == "none" else "") for k in d["devices"])
    if loaded:
        return loaded
    if d["fatbin_architectures"]:
        return "fatbin"
    if d["nvrtc_path"]:
        return f"NVRTC {d['nvrtc_version']} at first use"
    return f"none: {off}" + (f" ({d['nvrtc_error']})" if d.get("nvrtc_error") else "")


def _host_memory_rows(info: dict) -> list[tuple[str, str]]:
    """The node's budget and ledger, its NUMA nodes and GPUs, and what this process's arenas hold."""
    from ._bytes import format_bytes

    rows: list[tuple[str, str]] = []
    node = info["memory"]["node"]
    budget = info["node_budget"]["max_bytes"]
    rows.append(("node budget", "none (GPU_OFFLOAD_NODE_MAX_BYTES unset)" if budget is None else
                 f"{format_bytes(budget)}, {format_bytes(node['reserved_bytes'])} reserved by "
                 f"{len(node['by_pid'])} process(es), ledger {node['ledger']}"))
    rows += [(f"  pid {pid}", format_bytes(nbytes)) for pid, nbytes in list(node["by_pid"].items())[:8]]
    rows.append(("NUMA nodes", ", ".join(map(str, info["numa_nodes"])) or "-"))
    for g in info["gpus"]:
        where = f"node {g['numa_node']}" if g["numa_node"] is not None else f"unknown ({g['numa_unknown_why']})"
        rows.append((f"  cuda:{g['index']} NUMA", f"{where}, PCI {g['pci_address']}"))
    proc = info["memory"]["process"]
    by_node = ", ".join(f"node {n}: {format_bytes(b)}" if n >= 0 else f"unknown: {format_bytes(b)}"
                        for n, b in sorted(proc["bytes_by_numa_node"].items()))
    rows.append(("this process's arenas", f"{format_bytes(proc['pinned_bytes'])} pinned, "
                 f"{format_bytes(proc['pageable_bytes'])} pageable" + (f" ({by_node})" if by_node else "")))
    return rows


def _cuda_version(value: Any) -> str:
    """CUDA's version integer (13000, 12040) as people write it (13.0, 12.4)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1000:
        return f"{value // 1000}.{value % 1000 // 10}"
    return "-" if value is None else str(value)


# How `info` names and shows the keys of info_dict(), by dotted key; a key not listed here (one added to
# info_dict or build_info later) is shown by the generic rules of _info_value, named after its key.
_INFO_LABELS = {
    "build.version": "version", "build.core_version": "core version", "build.cuda": "built with CUDA",
    "build.cuda_architectures": "architectures", "torch_ext": "torch helper",
    "build.arena_alignment": "arena alignment", "cuda_available": "CUDA available",
    "host_memory_available_bytes": "host memory available", "memlock_limit_bytes": "ulimit -l",
    "arena.max_bytes": "arena max_bytes", "arena.min_slab_bytes": "arena min slab", "arena.pin": "arena pinning",
    "host_threads": "host copy threads", "gather_max_bytes": "gather max bytes",
}


def _info_value(key: str, value: Any, info: dict) -> str:
    """One value of info_dict() as `info` prints it: sizes in KiB/MiB/GiB, CUDA versions as 13.0, yes/no."""
    from ._bytes import format_bytes

    env = info.get("environment", {})
    if key == "memlock_limit_bytes" and value is None:
        return "unlimited"
    if key == "arena.max_bytes" and value is None:
        return "none (no cap)"
    if key == "arena.min_slab_bytes":
        return format_bytes(value) + ("" if "GPU_OFFLOAD_MIN_SLAB_BYTES" in env else " (default)")
    if key == "arena.pin":
        resolved = info.get("arena", {}).get("pin_resolved")
        return value if value != "auto" or not resolved else (
            f"auto: {resolved} (" + ("a CUDA device answers" if resolved == "register" else "no CUDA device") + ")")
    if key == "host_threads":
        return str(value) + (" (GPU_OFFLOAD_NUM_THREADS)" if "GPU_OFFLOAD_NUM_THREADS" in env
                             else " (default: one per core, at most 16)")
    if key == "build.arena_alignment":
        return f"{value} B"
    if key == "gather_max_bytes":
        if value == 0:
            return "off (every storage through the copy engines)"
        return format_bytes(value) + (" (GPU_OFFLOAD_GATHER_MAX_BYTES)" if "GPU_OFFLOAD_GATHER_MAX_BYTES" in env
                                      else " (default)")
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:
        return "-"
    if key.endswith("_bytes") and isinstance(value, int):
        return format_bytes(value)
    if "cuda" in key and key.endswith("version"):
        return _cuda_version(value)
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value)) or "-"
    return str(value)


def _info_rows(info: dict, part: Optional[dict] = None, prefix: str = "") -> list[tuple[str, str]]:
    """(label, text) for every key of info_dict(), nested dicts flattened in order."""
    rows: list[tuple[str, str]] = []
    for key, value in (info if part is None else part).items():
        dotted = prefix + key
        if dotted in ("arena.pin_resolved", "environment", "unknown_environment", "build.cuda_runtime_version",
                      "numa_nodes", "gpus", "memory"):
            continue  # shown with arena.pin, under the table, with node_budget; no runtime is linked in
        if dotted == "build.cuda_driver":
            rows += [("CUDA driver", driver_summary(info["build"])), ("kernels", kernels_summary(info["build"]))]
            continue
        if dotted == "node_budget":
            rows += _host_memory_rows(info)
            continue
        if isinstance(value, dict):
            rows += _info_rows(info, value, dotted + ".")
            continue
        rows.append((_INFO_LABELS.get(dotted, dotted.replace(".", " ").replace("_", " ")),
                     _info_value(dotted, value, info)))
    return rows


def cmd_info(args: argparse.Namespace) -> int:
    info = info_dict()
    if args.json:
        print(json.dumps(info, indent=1, default=str))
        return 0
    from rich.table import Table

    table = Table(show_header=False, title="gpu_offload")
    table.add_column(no_wrap=True)
    table.add_column()
    for label, text in _info_rows(info):
        table.add_row(label, text)
    console = _console()
    console.print(table)
    for name, value in info["environment"].items():
        console.print(f"set: {name}={value}")
    for line in info["unknown_environment"]:
        console.print(f"warning: {line}")
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
