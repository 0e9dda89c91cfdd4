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
    p = _Parser(prog="gpu-offload", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging (plan sizes, bytes, GB/s per call)")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="measure the link limit, the engine and the baselines side by side")
    b.add_argument("--device", default=None, help="cpu or cuda (default: cpu)")
    b.add_argument("--layout", action="append", default=None,
                   help="qwen1.5b, qwen7b, small64k, tiny4k, mixed, all, or a JSON file of runs; repeatable "
                        "(default: qwen1.5b)")
    b.add_argument("--dtype", default=None, help="bfloat16, float16, float32 or uint8 (default: the layout's)")
    b.add_argument("--scale", type=int, default=None, help="divide each shape's first dimension by this "
                   "(default: 1 on a GPU, a per-layout factor on the CPU)")
    b.add_argument("--repeats", type=int, default=5, help="timed repetitions per method (median reported)")
    b.add_argument("--no-baselines", action="store_true", help="skip the per-tensor baseline methods")
    b.add_argument("--gather-sweep", type=_byte_list, default=(), metavar="BYTES,...",
                   help="on a GPU, also time snapshot and restore with each gather threshold "
                        "(GPU_OFFLOAD_GATHER_MAX_BYTES), e.g. 0,65536,262144,1048576")
    b.add_argument("--stager", action="store_true", help="also time checkpoint staging: gpu_offload's ArenaStager "
                   "beside torch.distributed.checkpoint's own stager, first call and steady state")
    b.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    b.add_argument("--plot", type=Path, default=None, help="write a PNG plot of GB/s per method here")
    sub.add_parser("info", help="version, build, devices, pinned-memory limits, arena defaults")
    return p


def _byte_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated byte counts, got {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"byte counts must not be negative: {text!r}")
    return values


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
    """Refuses an output path that cannot be written before the benchmark runs, not after."""
    if path is None:
        return
    if path.is_dir():
        raise UsageError(f"{option} {path}: is a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot create {path.parent}: {exc.strerror or exc}") from None
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{option} {path}: not writable")


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
    # Last of the checks, as it creates the output folders.
    _writable("--json", args.json)
    _writable("--plot", args.plot)
    console = _console()
    results = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("bench", total=len(layouts) * 6)
        for layout in layouts:
            def step(what: str, layout=layout) -> None:
                progress.update(task, advance=1, description=f"{layout.name}: {what}")

            results.append(bench.run(layout, device, repeats=args.repeats, baselines=not args.no_baselines,
                                     progress=step, gather_sweep=args.gather_sweep))
            if args.stager:  # checkpoint staging (gpu_offload/bench_stager.py), in the same table
                from . import bench_stager

                results[-1].rows.extend(bench_stager.rows(
                    layout, device, repeats=args.repeats, progress=step,
                    limit_gbps=results[-1].info.get("limits_gbps", {}).get("d2h")))
    for res in results:
        table = Table(title=f"{res.layout} on {res.device}: {res.num_tensors} tensors, {res.nbytes / 1e9:.3f} GB"
                            + (f" (scaled 1/{res.scale})" if res.scale > 1 else ""))
        for col in ("method", "dir", "ms", "GB/s", "x limit", "note"):
            table.add_column(col, justify="right" if col in ("ms", "GB/s", "x limit") else "left")
        for r in res.rows:
            table.add_row(r.method, r.direction, f"{r.seconds * 1e3:.2f}", f"{r.gbps:.2f}",
                          "" if r.ratio is None else f"{r.ratio:.2f}", r.note)
        console.print(table)
    if args.json:
        text = json.dumps({"results": [r.to_json() for r in results], "info": info_dict()}, indent=1, default=str)
        try:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(text)
        except OSError as exc:
            raise UsageError(f"--json {args.json}: cannot write: {exc.strerror or exc}") from None
        console.print(f"wrote {args.json}")
    if args.plot:
        try:
            plot(results, args.plot)
        except OSError as exc:
            raise UsageError(f"--plot {args.plot}: cannot write: {exc.strerror or exc}") from None
        console.print(f"wrote {args.plot}")
    return 0


def plot(results: list, path: Path) -> None:
    """GB/s per method per layout, with each direction's limit drawn as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(max(6, 5 * len(results)), 4.5), squeeze=False)
    for ax, res in zip(axes[0], results):
        rows = [r for r in res.rows if r.method != "limit"]
        colors = ["tab:blue" if r.direction == "d2h" else "tab:orange" for r in rows]
        ax.barh([f"{r.method} ({r.direction})" for r in rows], [r.gbps for r in rows], color=colors)
        for r in res.rows:
            if r.method == "limit":
                ax.axvline(r.gbps, color="tab:blue" if r.direction == "d2h" else "tab:orange", linestyle="--",
                           label=f"limit {r.direction} {r.gbps:.1f} GB/s")
        ax.set_xlabel("GB/s")
        ax.set_title(f"{res.layout} ({res.device})")
        ax.legend(loc="lower right", fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        # PNG whatever the name says: matplotlib would otherwise pick (or reject) a format by the suffix.
        fig.savefig(path, dpi=110, format="png")
    finally:
        plt.close(fig)


def info_dict() -> dict:
    import platform

    import torch

    from . import _C, build_info, cuda_available
    from .arena import _DEFAULT_MIN_SLAB_BYTES, Arena, _env_int

    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    # Read the way default_arena() reads them, and checked by building (not using: nothing is allocated
    # before the first region) an arena from them, so a setting the default arena would refuse at its
    # first use is refused here, with the same message.
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
    _console().print(table)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return {"bench": cmd_bench, "info": cmd_info}[args.command](args)
    except (UsageError, OffloadError) as exc:
        # One line whatever the message (errors from the core may carry a newline).
        print(f"gpu-offload: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if exc.name not in ("rich", "matplotlib"):
            raise
        print(f"gpu-offload: error: the command line needs {exc.name}: pip install 'gpu-offload[all]'",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gpu-offload: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
