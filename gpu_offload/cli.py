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
from typing import Optional, Sequence

from ._errors import OffloadError

logger = logging.getLogger("gpu_offload")


class UsageError(Exception):
    """A bad option: reported on one line, exit status 2."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu-offload", description=__doc__)
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
    b.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    b.add_argument("--plot", type=Path, default=None, help="write a PNG plot of GB/s per method here")
    sub.add_parser("info", help="version, build, devices, pinned-memory limits, arena defaults")
    return p


def _device(name: Optional[str]):
    import torch

    name = name or "cpu"
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise UsageError(f"--device must be cpu or cuda, not {name!r}")
    if name.startswith("cuda"):
        from . import cuda_available

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available on this machine")
        if not cuda_available():
            raise UsageError("--device cuda: gpu_offload was built without CUDA (reinstall with nvcc, GPU_OFFLOAD_CUDA=1)")
    return torch.device(name)


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from . import bench

    device = _device(args.device)
    if args.repeats < 1:
        raise UsageError("--repeats must be at least 1")
    if args.scale is not None and args.scale < 1:
        raise UsageError("--scale must be at least 1")
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
    console = Console()
    results = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("bench", total=len(layouts) * 6)
        for layout in layouts:
            def step(what: str, layout=layout) -> None:
                progress.update(task, advance=1, description=f"{layout.name}: {what}")

            results.append(bench.run(layout, device, repeats=args.repeats, baselines=not args.no_baselines,
                                     progress=step))
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
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"results": [r.to_json() for r in results], "info": info_dict()},
                                        indent=1, default=str))
        console.print(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot)
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
    fig.savefig(path, dpi=110)
    plt.close(fig)


def info_dict() -> dict:
    import platform

    import torch

    from . import _C, build_info, cuda_available
    from .arena import _DEFAULT_MIN_SLAB_BYTES

    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
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
            "max_bytes": os.environ.get("GPU_OFFLOAD_ARENA_MAX_BYTES") or None,
            "min_slab_bytes": int(os.environ.get("GPU_OFFLOAD_MIN_SLAB_BYTES") or _DEFAULT_MIN_SLAB_BYTES),
            "pin": os.environ.get("GPU_OFFLOAD_PIN", "auto"),
        },
    }


def cmd_info(args: argparse.Namespace) -> int:
    from rich.console import Console
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
    Console().print(table)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return {"bench": cmd_bench, "info": cmd_info}[args.command](args)
    except (UsageError, OffloadError) as exc:
        print(f"gpu-offload: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
