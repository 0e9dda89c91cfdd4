"""The `gpu-offload` command line, driven as a user drives it: the installed console script (or
`python -m gpu_offload`) in a subprocess, its table, its JSON, its PNG, `info`, and every bad option.

Every run uses `--repeats 1` and a tiny layout, so the whole file takes seconds of work; most of its time
is the interpreter importing torch once per process. Nothing here asserts on a timing: figures are checked
for being positive and for being consistent with each other.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Optional

import pytest
import torch

import gpu_offload as go

SCRIPT = Path(sys.executable).with_name("gpu-offload")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TIMEOUT = 120  # a hang (or a bad option that started a full benchmark) fails instead of stalling CI

# A small layout file: 9 tensors in 2 shapes, 0.79 MB of float32.
TINY_LAYOUT = {"name": "tiny-test", "dtype": "float32", "runs": [[[128, 256], 6], [[256], 3]]}
TINY_TENSORS = 9
TINY_BYTES = (6 * 128 * 256 + 3 * 256) * 4
ENGINE_METHODS = {"go.snapshot+wait", "go.restore", "go.offload", "go.reload"}
HOST_METHODS = ["host: Y", "host: first snapshot", "host: snapshot+wait+free", "host: restore", "host: offload+reload"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_OFFLOAD_")}
    env.pop("COLUMNS", None)  # the piped default width is part of what is tested
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_cli(*args: str, cwd: Path, module: bool = False, env: Optional[dict[str, str]] = None
            ) -> subprocess.CompletedProcess:
    """Runs the real command: the console script installed beside this interpreter, or `-m gpu_offload`."""
    if module or not SCRIPT.exists():
        cmd = [sys.executable, "-m", "gpu_offload", *args]
    else:
        cmd = [str(SCRIPT), *args]
    return subprocess.run(cmd, cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=TIMEOUT)


def table_rows(stdout: str) -> list[list[str]]:
    """The body rows of the rich tables in `stdout`, as lists of stripped cells."""
    return [[c.strip() for c in line.split("│")[1:-1]] for line in stdout.splitlines() if line.startswith("│")]


def bench_rows(stdout: str) -> list[list[str]]:
    """The rows of the bench tables (six cells: method, dir, ms, GB/s, min-max, x limit); a figure folded onto
    a second line (a narrow terminal) is joined back to its row."""
    rows: list[list[str]] = []
    for cells in table_rows(stdout):
        if len(cells) != 6:
            continue
        if cells[0] == "" and rows:
            rows[-1] = [a + b for a, b in zip(rows[-1], cells)]
        else:
            rows.append(cells)
    return rows


def check_result(res: dict, *, layout: str, num_tensors: int, nbytes: int, scale: int, baselines: bool,
                 repeats: int = 1) -> None:
    """Structure of one layout's result, positive figures, and ratios equal to GB/s over the limit."""
    assert res["layout"] == layout
    assert res["device"] == "cpu"
    assert (res["num_tensors"], res["nbytes"], res["scale"], res["repeats"]) == (num_tensors, nbytes, scale, repeats)
    rows = res["rows"]
    repeats = res["repeats"]
    check_host_rows([r for r in rows if r["direction"] == "host"], repeats)
    rows = [r for r in rows if r["direction"] != "host"]
    for r in rows:
        assert set(r) == {"method", "direction", "seconds", "nbytes", "gbps", "ratio", "note", "samples", "gbps_min",
                          "gbps_max", "iqr_seconds", "spread", "kind"}, r
        assert r["kind"] == ("limit" if r["method"].startswith("limit") else
                             "engine" if r["method"].startswith("go.") else "baseline"), r
        assert r["direction"] in ("d2h", "h2d"), r
        assert r["nbytes"] == nbytes
        assert r["seconds"] > 0 and r["gbps"] > 0 and math.isfinite(r["gbps"]), r
        assert r["gbps"] == pytest.approx(nbytes / r["seconds"] / 1e9, rel=1e-9), r
        # Spread: every repeat's seconds, the median among them, min/max GB/s from the slowest/fastest.
        samples = r["samples"]
        assert len(samples) == repeats and all(t > 0 for t in samples), r
        assert min(samples) <= r["seconds"] <= max(samples), r
        assert r["gbps_min"] == pytest.approx(nbytes / max(samples) / 1e9, rel=1e-9), r
        assert r["gbps_max"] == pytest.approx(nbytes / min(samples) / 1e9, rel=1e-9), r
        assert r["spread"] == pytest.approx(max(samples) / min(samples), rel=1e-9), r
        assert 0 <= r["iqr_seconds"] <= max(samples) - min(samples) + 1e-12, r
    limits = {r["direction"]: r["gbps"] for r in rows if r["method"] == "limit"}
    assert sorted(limits) == ["d2h", "h2d"], "one limit per direction"
    assert res["info"]["limits_gbps"] == pytest.approx(limits)
    methods = {r["method"] for r in rows}
    assert ENGINE_METHODS <= methods
    assert ("p.cpu().clone()" in methods) == baselines
    # The limit again after the engine's rows, its ratio to the first (how much the machine moved).
    assert [r["direction"] for r in rows if r["method"] == "limit again"] == ["d2h", "h2d"]
    for r in rows:
        if r["method"] == "limit":
            assert r["ratio"] is None
        else:
            assert r["ratio"] == pytest.approx(r["gbps"] / limits[r["direction"]], rel=1e-9), r
    arena = res["info"]["arena"]
    assert arena["used_bytes"] == 0, "the benchmark left arena memory in use"
    assert arena["capacity_bytes"] >= nbytes


def check_host_rows(rows: list[dict], repeats: int) -> None:
    """The host-cost rows: ms per call (nothing moved, no GB/s) and, in the note, the same in Y."""
    assert [r["method"] for r in rows] == HOST_METHODS
    y = rows[0]["seconds"]
    for r in rows:
        assert r["nbytes"] == 0 and r["gbps"] == 0 and r["ratio"] is None and r["kind"] == "host", r
        assert r["seconds"] > 0 and min(r["samples"]) <= r["seconds"] <= max(r["samples"]), r
        assert r["spread"] == pytest.approx(max(r["samples"]) / min(r["samples"]), rel=1e-9), r
        if r is not rows[0]:
            assert r["note"].startswith(f"{r['seconds'] / y:.2f} Y; "), r
    assert len(rows[2]["samples"]) == max(repeats, 5)


def check_table(stdout: str, res: dict) -> None:
    """The printed table shows the same methods, GB/s and ratios as the JSON, in the same order."""
    rows = bench_rows(stdout)
    assert len(rows) == len(res["rows"]), stdout
    for cells, r in zip(rows, res["rows"]):
        method, direction, ms, gbps, span, ratio = cells
        assert method == r["method"], "method names are printed in full (no truncation when piped)"
        assert direction == r["direction"]
        assert ms == f"{r['seconds'] * 1e3:.2f}"
        wide = " !" if r["spread"] > 1.5 else ""
        if r["direction"] == "host":
            assert (gbps, span) == ("-", "-" + wide)
            continue
        assert gbps == f"{r['gbps']:.3g}"
        assert span == ("-" if len(r["samples"]) == 1 else f"{r['gbps_min']:.3g}-{r['gbps_max']:.3g}" + wide)
        assert ratio == ("" if r["ratio"] is None else f"{r['ratio']:.3g}")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    files = {
        "tiny.json": json.dumps(TINY_LAYOUT),
        # Layout files for the bad options below.
        "broken.json": "{not json",
        "list.json": "[1, 2]",
        "negative.json": json.dumps({"runs": [[[-4, 8], 2]]}),
        "malformed.json": json.dumps({"runs": [[[4, 8]]]}),
        "empty.json": json.dumps({"runs": []}),
        "dtype.json": json.dumps({"dtype": "int7", "runs": [[[4, 8], 2]]}),
    }
    for name, text in files.items():
        (d / name).write_text(text)
    return d


def test_bench_table_json_and_png(workdir: Path) -> None:
    # -v after the command: global options are accepted there too.
    proc = run_cli("bench", "-v", "--layout", "tiny.json", "--repeats", "3", "--json", "out/bench.json",
                   "--plot", "out/bench.png", "--markdown", "out/bench.md", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "gpu_offload: snapshot: 9 tensors" in proc.stderr, "bench -v turns on the debug log"
    assert f"tiny-test on cpu: 9 tensors, {TINY_BYTES / 1e9:.3g} GB, 3 repeats" in proc.stdout  # layout, count, size
    header = next(line for line in proc.stdout.splitlines() if "method" in line)
    for col in ("method", "dir", "ms", "GB/s", "min-max", "x limit"):
        assert col in header
    assert "wrote out/bench.json" in proc.stdout and "wrote out/bench.png" in proc.stdout

    data = json.loads((workdir / "out/bench.json").read_text())
    assert {"schema_version", "timestamp", "host", "commit", "torch", "torch_cuda", "driver", "device", "repeats",
            "results", "info"} <= set(data)
    assert data["schema_version"] == 3 and data["repeats"] == 3 and data["device"] == "cpu"
    assert data["torch"] == torch.__version__ and data["timestamp"][:2] == "20"
    assert len(data["results"]) == 1
    res = data["results"][0]
    assert res["dtype"] == "float32"
    check_result(res, layout="tiny-test", num_tensors=TINY_TENSORS, nbytes=TINY_BYTES, scale=1, baselines=True,
                 repeats=3)
    check_table(proc.stdout, res)
    assert data["info"]["build"]["version"] == go.__version__

    # Piped (stdout is not a terminal): each measurement once, in the table (no line per measurement as
    # well), and what each method does once, under it.
    # (Two rows may round to the same figures: each set of figures is on as many lines as rows have it.)
    all_figures = [f"{r['gbps_min']:.3g}-{r['gbps_max']:.3g}" for r in res["rows"] if r["direction"] != "host"]
    for figures in set(all_figures):  # (host rows: no GB/s, their ms are their figures)
        alone = re.compile(rf"(?<![\d.]){re.escape(figures)}(?![\d])")
        found = sum(bool(alone.search(line)) for line in proc.stdout.splitlines())
        assert found == all_figures.count(figures), (figures, proc.stdout)
    legend = proc.stdout.split("\nmethods")[1].splitlines()
    for method in ("limit", "go.snapshot+wait", "p.cpu().clone()", "copy_ to preallocated", "host: Y"):
        assert sum(line.split("  ")[0] == method for line in legend) == 1, (method, legend)
    wide = [r for r in res["rows"] if r["spread"] > 1.5]
    assert ("varied more than 1.5x between repeats" in proc.stdout) == bool(wide)
    # The machine: cores and load average before the run, what other processes used during it.
    first = proc.stdout.splitlines()[0]
    assert first.startswith(f"gpu-offload bench {go.__version__} on cpu (") and " cores, load average " in first
    assert "machine during the run (" in proc.stdout and "cores busy on average" in proc.stdout
    assert data["load"]["cores"] >= 1 and data["load"]["load_average_end"] is not None

    # The Markdown table: the command, the commit, and one row per measurement with the same figures.
    md = (workdir / "out/bench.md").read_text()
    assert "--layout tiny.json --repeats 3" in md and f"commit {data['commit'] or 'unknown'}" in md
    md_rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    assert len(md_rows) == len(res["rows"])
    for line, r in zip(md_rows, res["rows"]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        gbps = "-" if r["direction"] == "host" else f"{r['gbps']:.3g}"
        assert cells[:4] == [r["method"], r["direction"], f"{r['seconds'] * 1e3:.2f}", gbps], line

    png = (workdir / "out/bench.png").read_bytes()
    assert png[:8] == PNG_MAGIC
    import matplotlib.image

    image = matplotlib.image.imread(workdir / "out/bench.png")
    height, width = image.shape[:2]
    assert image.ndim == 3 and image.shape[2] in (3, 4)
    # One figure readable at 100 % on a laptop screen (not a strip of panels 2750 px wide).
    assert 1000 <= width <= 1600 and 600 <= height <= 1000, image.shape
    assert float(image[..., :3].std()) > 0.01, "the plot is blank"


def test_bench_at_80_columns_keeps_every_method_name_whole(workdir: Path) -> None:
    """At 80 columns every method can be told apart: names are never cut (no "…"), nothing is wider than
    the terminal, and the stager's rows fit too."""
    proc = run_cli("bench", "--layout", "tiny.json", "--repeats", "1", "--stager", "--json", "narrow.json",
                   cwd=workdir, env=_env(COLUMNS="80"))
    assert proc.returncode == 0, proc.stderr
    assert "…" not in proc.stdout, proc.stdout
    assert max(map(len, proc.stdout.splitlines())) <= 80, proc.stdout
    res = json.loads((workdir / "narrow.json").read_text())["results"][0]
    check_table(proc.stdout, res)  # every method's name, whole, on its row
    assert {"ArenaStager first", "ArenaStager steady", "DCP stager first", "DCP stager steady"} <= \
        {r["method"] for r in res["rows"]}


def _row(method: str, direction: str, gbps: float, spread: float = 1.0, ratio: Optional[float] = None):
    from gpu_offload import bench

    seconds = 1.0 / gbps
    return bench.Row(method, direction, seconds, 10**9, gbps, ratio, samples=[seconds, seconds * spread],
                     gbps_min=gbps / spread, gbps_max=gbps,
                     kind="limit" if method.startswith("limit") else "engine" if method.startswith("go.") else
                     "baseline")


def _result(rows: list, layout: str = "tiny4k"):
    from gpu_offload import bench

    return bench.Result(layout, "cpu", 10, 10**9, 1, 2, rows=rows)


def test_a_limit_that_moved_more_than_its_spread_is_flagged() -> None:
    from gpu_offload import bench, cli

    steady = _result([_row("limit", "d2h", 3.0, 1.2), _row("limit again", "d2h", 2.7, 1.1)])
    assert bench.limit_drift(steady) == []  # 1.11x apart: within the 1.2x spread of the repeats
    moved = _result([_row("limit", "d2h", 3.0, 1.2), _row("limit", "h2d", 3.0, 1.05),
                     _row("limit again", "d2h", 1.5, 1.1), _row("limit again", "h2d", 3.1, 1.05)])
    (drift,) = bench.limit_drift(moved)  # d2h halved; h2d moved 3%, under the 10% floor
    assert drift["direction"] == "d2h" and drift["drift"] == pytest.approx(2.0) and drift["spread"] == 1.2
    load = {"cores": 2, "load_average_end": [0.1, 0.1, 0.1], "other_processes_cores": 0.0, "seconds": 3.0}
    lines = cli._bench_summary([moved], torch.device("cpu"), load, 2, ["tiny4k"])
    assert any(line.startswith("warning: tiny4k: the limit measured before and after the engine's rows differs by "
                               "more than the spread of its repeats (d2h 3 -> 1.5 GB/s (2.00x, spread 1.20x))")
               for line in lines), lines
    assert not any("the machine was busy" in line for line in lines), lines


def test_a_busy_machine_is_flagged() -> None:
    from gpu_offload import bench, cli

    quiet = {"cores": 2, "load_average_start": [3.0, 3.0, 3.0], "load_average_end": [0.2, 0.2, 0.2],
             "other_processes_cores": 0.1, "seconds": 10.0}
    assert bench.machine_busy(quiet) is None  # measured during the run: quiet, whatever the load before
    busy = dict(quiet, other_processes_cores=0.9)  # another process held most of a core
    assert bench.machine_busy(busy) == "other processes kept 0.9 of its 2 cores busy on average during the run"
    # Without /proc/stat, the load average at the start decides.
    assert bench.machine_busy(dict(quiet, other_processes_cores=None)) == \
        "its load average was 3.0 on 2 cores at the start"
    assert bench.machine_busy(dict(quiet, other_processes_cores=None, load_average_start=[0.3, 0, 0])) is None
    lines = cli._bench_summary([_result([_row("limit", "d2h", 3.0)])], torch.device("cpu"), busy, 5, ["tiny4k"])
    assert "machine during the run (10 s): load average 0.20 at the end; other processes kept 0.9 of its 2 cores busy " \
           "on average." in lines
    assert any(line.startswith("warning: the machine was busy (other processes kept 0.9") for line in lines), lines
    # The monitor itself: this process's own work is not counted as other processes'.
    monitor = bench.LoadMonitor()
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:
        pass
    load = monitor.stop()
    assert load["cores"] >= 1 and load["seconds"] >= 0.3
    if load["other_processes_cores"] is not None:
        assert 0 <= load["other_processes_cores"] <= load["cores"]


def test_the_cpu_engine_losing_to_per_tensor_copies_is_said() -> None:
    from gpu_offload import bench, cli

    load = {"cores": 2, "load_average_end": None, "other_processes_cores": None, "seconds": 1.0}
    big = _result([_row("limit", "d2h", 3.0), _row("go.snapshot+wait", "d2h", 3.5, ratio=1.17),
                   _row(bench.COPY_TO, "d2h", 2.0, ratio=0.67)], layout="qwen1.5b")
    lines = cli._bench_summary([big], torch.device("cpu"), load, 5, ["qwen1.5b"])
    assert not any("copy_ of the same direction" in line for line in lines), lines
    # The default run (one layout of large tensors) says where the CPU engine does not do well, and how to see it.
    assert any(line.startswith("note: qwen1.5b: few, large tensors, where the CPU engine does well. With thousands of "
                               "small ones (tiny4k, small64k) it can be slower than a preallocated per-tensor copy_")
               and "--layout all" in line for line in lines), lines
    small = _result([_row("limit", "d2h", 3.0), _row("go.snapshot+wait", "d2h", 0.6, ratio=0.2),
                     _row("go.offload", "d2h", 0.06, ratio=0.02), _row(bench.COPY_TO, "d2h", 0.3, ratio=0.1)])
    lines = cli._bench_summary([small], torch.device("cpu"), load, 5, ["tiny4k"])
    assert ("note: tiny4k: slower than a preallocated per-tensor copy_ of the same direction (x limit): go.offload "
            "0.02x against 0.1x.") in lines, lines
    assert not any("--layout all" in line for line in lines), lines  # it was measured


def test_the_plot_reads_linearly_in_order_with_its_version() -> None:
    """Bars from 0 on a linear axis (their lengths are the ratios), the legend in the order of the bars, every
    method its own colour and hatching, and the package's version and commit in the title."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from gpu_offload import bench, cli

    rows = [_row("limit", "d2h", 3.0), _row("limit", "h2d", 3.0)]
    rows += [_row(m, d, 1.0 + i, ratio=(1.0 + i) / 3) for i, (m, d) in enumerate(
        [("go.snapshot+wait", "d2h"), ("go.restore", "h2d"), ("go.offload", "d2h"), ("go.reload", "h2d"),
         ("p.cpu().clone()", "d2h"), (bench.COPY_TO, "d2h"), (bench.COPY_FROM, "h2d")])]
    # The limit again, 80x the first in d2h: under the layout (flagged), not a bar that would set the axis.
    rows.insert(6, _row("limit again", "d2h", 240.0, ratio=80.0))
    rows.insert(7, _row("limit again", "h2d", 3.0, ratio=1.0))
    res = _result(rows)
    res.info["limits_gbps"] = {"d2h": 3.0, "h2d": 3.0}
    fig = cli.figure([res], {"package_version": go.__version__, "commit": "abc123", "timestamp": "2026-12-01T00:00"})
    try:
        ax = fig.axes[0]
        assert ax.get_yscale() == "linear" and ax.get_ylim()[0] == 0
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert legend[0].startswith("limit = 1.0: one contiguous copy")
        assert legend[1:] == ["go.snapshot+wait (d2h)", "go.restore (h2d)", "go.offload (d2h)", "go.reload (h2d)",
                              "p.cpu().clone() (d2h)", "copy_ to preallocated (d2h)", "copy_ from preallocated (h2d)"]
        bars = [p for p in ax.patches]
        styles = [(tuple(p.get_facecolor()), p.get_hatch()) for p in bars]
        assert len(set(styles)) == len(styles) == 7
        assert len({s[0] for s in styles[:4]}) == 4  # four blues, each its own
        assert f"gpu_offload {go.__version__} (commit abc123)" in ax.get_title()
        heights = [p.get_height() for p in bars]
        assert heights == pytest.approx([(1.0 + i) / 3 for i in range(7)])
        assert ax.get_ylim()[1] < 3, "the limit again is no bar"
        label = ax.get_xticklabels()[0].get_text()
        assert label.endswith("limit GB/s:\nd2h 3, h2d 3\nagain after the engine:\nd2h 240 !, h2d 3"), label
    finally:
        plt.close(fig)
    fig = cli.figure([res], {"package_version": go.__version__, "commit": None})
    try:
        assert "(installed from a release)" in fig.axes[0].get_title()
    finally:
        plt.close(fig)


def _layout_bytes(name: str, scale: int, itemsize: int) -> tuple[int, int]:
    """Tensor count and bytes of a packaged layout after dividing first dimensions by `scale`."""
    table = json.loads(resources.files("gpu_offload").joinpath("data/layouts.json").read_text())
    count = nbytes = 0
    for shape, n in table[name]["runs"]:
        shape = list(shape)
        shape[0] = max(1, shape[0] // scale)
        count += n
        nbytes += n * math.prod(shape) * itemsize
    return count, nbytes


def test_bench_named_layout_scale_dtype_module_entry(workdir: Path) -> None:
    """`python -m gpu_offload`, a named layout scaled down, another dtype, no baselines, -v debug log."""
    proc = run_cli("-v", "bench", "--layout", "qwen1.5b", "--scale", "512", "--dtype", "float16", "--repeats", "1",
                   "--no-baselines", "--json", "named.json", "--gather-sweep", "0,1KiB", cwd=workdir, module=True)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    count, nbytes = _layout_bytes("qwen1.5b", 512, 2)
    res = json.loads((workdir / "named.json").read_text())["results"][0]
    check_result(res, layout="qwen1.5b", num_tensors=count, nbytes=nbytes, scale=512, baselines=False)
    check_table(proc.stdout, res)
    assert "(scaled 1/512)" in proc.stdout
    assert "--gather-sweep measures the GPU's gather kernel: nothing to sweep on the CPU" in proc.stdout
    # -v: the library's debug log reports each call's size.
    assert f"gpu_offload: snapshot: {count} tensors, {count} storages, {nbytes} bytes" in proc.stderr


def test_info(workdir: Path) -> None:
    # Sizes as people write them, and every variable `info` documents.
    env = _env(GPU_OFFLOAD_ARENA_MAX_BYTES="1GiB", GPU_OFFLOAD_MIN_SLAB_BYTES="64 MiB", GPU_OFFLOAD_PIN="none",
               GPU_OFFLOAD_NUM_THREADS="1", GPU_OFFLOAD_GATHER_MAX_BYTES="64KiB")
    proc = run_cli("info", "-v", cwd=workdir, env=env, module=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    fields = {row[0]: row[1] for row in table_rows(proc.stdout) if len(row) == 2}
    build = go.build_info()
    assert fields["version"] == go.__version__
    from gpu_offload.cli import driver_summary, kernels_summary

    assert fields["CUDA driver"] == driver_summary(build)
    assert fields["kernels"] == kernels_summary(build)
    assert fields["built with CUDA"] == ("yes" if build["cuda"] else "no")
    assert "CUDA runtime (linked in)" not in fields and "build cuda runtime version" not in fields  # none is
    assert fields["architectures"] == (", ".join(build["cuda_architectures"]) or "-")
    assert fields["torch"] == torch.__version__ and fields["python"].startswith("3.")
    assert fields["CUDA available"] == ("yes" if go.cuda_available() else "no")
    assert (fields["devices"] == "-") == (not go.cuda_available())
    # Sizes in one style: KiB, MiB, GiB with three significant digits.
    assert re.fullmatch(r"[\d.]+ (MiB|GiB|TiB)", fields["host memory available"]), fields
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    from gpu_offload._bytes import format_bytes

    assert fields["ulimit -l"] == ("unlimited" if soft == resource.RLIM_INFINITY else format_bytes(soft))
    assert fields["arena max_bytes"] == "1 GiB"
    assert fields["arena min slab"] == "64 MiB"
    assert fields["arena pinning"] == "none"
    assert fields["host copy threads"] == "1 (GPU_OFFLOAD_NUM_THREADS)"
    assert fields["gather max bytes"] == "64 KiB (GPU_OFFLOAD_GATHER_MAX_BYTES)"
    assert "warning" not in proc.stdout  # every variable set is one gpu_offload reads


def test_info_defaults_say_what_they_resolve_to(workdir: Path) -> None:
    proc = run_cli("info", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    fields = {row[0]: row[1] for row in table_rows(proc.stdout) if len(row) == 2}
    assert fields["arena max_bytes"] == "none (no cap)"
    assert fields["arena min slab"] == "256 MiB (default)"
    resolved = "register (a CUDA device answers)" if go.cuda_available() else "none (no CUDA device)"
    assert fields["arena pinning"] == f"auto: {resolved}"
    assert fields["host copy threads"].endswith("(default: one per core, at most 16)")
    assert fields["gather max bytes"] == "64 KiB (default)"
    proc = run_cli("info", cwd=workdir, env=_env(GPU_OFFLOAD_GATHER_MAX_BYTES="0"))
    assert proc.returncode == 0, proc.stderr
    fields = {row[0]: row[1] for row in table_rows(proc.stdout) if len(row) == 2}
    assert fields["gather max bytes"] == "off (every storage through the copy engines)"


def test_info_json_and_version(workdir: Path) -> None:
    env = _env(GPU_OFFLOAD_ARENA_MAX_BYTES="1GiB", GPU_OFFLOAD_MAX_BYTES="8GiB")
    proc = run_cli("info", "--json", cwd=workdir, env=env)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)  # nothing but the JSON object on stdout
    assert info["build"] == go.build_info()
    assert info["torch"] == torch.__version__ and info["cuda_available"] == go.cuda_available()
    assert info["arena"] == {"max_bytes": 1 << 30, "min_slab_bytes": 256 << 20, "pin": "auto",
                             "pin_resolved": "register" if go.cuda_available() else "none"}
    assert info["gather_max_bytes"] == 64 << 10 and info["host_threads"] >= 1  # the default threshold
    assert info["environment"] == {"GPU_OFFLOAD_ARENA_MAX_BYTES": "1GiB"}
    assert info["unknown_environment"] == ["GPU_OFFLOAD_MAX_BYTES is not a gpu_offload setting and is ignored "
                                           "(did you mean GPU_OFFLOAD_NODE_MAX_BYTES or GPU_OFFLOAD_ARENA_MAX_BYTES?)"]
    proc = run_cli("--version", cwd=workdir)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    build = go.build_info()
    fatbin = build["cuda_driver"]["fatbin_architectures"] if build["cuda"] else ""
    cuda = ("built without CUDA" if not build["cuda"] else
            "CUDA on the driver API, " + (f"kernels for {fatbin}" if fatbin else "kernels by NVRTC at first use"))
    assert proc.stdout == (f"gpu-offload {go.__version__} ({cuda}; torch {torch.__version__}, "
                           f"Python {platform.python_version()})\n")


def test_unknown_variables_are_flagged(workdir: Path) -> None:
    """A typo is ignored by the library: `info` (and `bench`) say so, and the default arena logs a warning."""
    env = _env(GPU_OFFLOAD_MAX_BYTES="8GiB", GPU_OFFLOAD_PINN="none")
    proc = run_cli("info", cwd=workdir, env=env)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: GPU_OFFLOAD_MAX_BYTES is not a gpu_offload setting and is ignored (did you mean "
                        "GPU_OFFLOAD_NODE_MAX_BYTES or GPU_OFFLOAD_ARENA_MAX_BYTES?)",
                        "warning: GPU_OFFLOAD_PINN is not a gpu_offload setting and is ignored (did you mean "
                        "GPU_OFFLOAD_PIN?)"], proc.stdout
    code = "import logging, gpu_offload\nlogging.basicConfig()\ngpu_offload.default_arena()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=TIMEOUT,
                          cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    assert "WARNING:gpu_offload:GPU_OFFLOAD_MAX_BYTES is not a gpu_offload setting and is ignored (did you mean " \
           "GPU_OFFLOAD_NODE_MAX_BYTES or GPU_OFFLOAD_ARENA_MAX_BYTES?)" in proc.stderr.splitlines(), proc.stderr


# Where the package, its build and its tests read environment variables: os.environ / getenv with a quoted
# name, _env_int("...") and _env_arena_bytes("..."), C's getenv("...") and a C++ env("...") helper in the sources; assignments and
# expansions ($NAME, ${NAME:-default}) in the Makefile and the shell scripts.
_ENV_READS = re.compile(r"""(?:environ(?:\.get|\.pop|\.setdefault)?\(?\[?|getenv\(|_env_int\(|_env_arena_bytes\(|\benv\()\s*["']"""
                        r"""(GPU_OFFLOAD_[A-Z0-9_]+)["']""")
_ENV_SETS = re.compile(r"(?:^|[\s;(])(GPU_OFFLOAD_[A-Z0-9_]+)=|\$\{?(GPU_OFFLOAD_[A-Z0-9_]+)", re.MULTILINE)


def test_every_variable_read_is_known_and_every_known_one_is_read() -> None:
    """gpu_offload._env.VARIABLES is the one list of GPU_OFFLOAD_* names (what `info` flags against): a
    variable read anywhere in the package, the build or the tests must be in it, and each name in it must
    be read somewhere."""
    from gpu_offload import _env

    root = Path(__file__).resolve().parent.parent
    sources = [*root.glob("gpu_offload/**/*.py"), *root.glob("csrc/**/*.[ch]pp"), *root.glob("csrc/**/*.cu"),
               root / "setup.py", *root.glob("benchmarks/*.py"), *root.glob("tests/**/*.py"), *root.glob("examples/*.py")]
    scripts = [root / "Makefile", root / ".ci" / "run", *root.glob("benchmarks/*.sh")]
    read: dict[str, str] = {}
    for files, pattern in ((sources, _ENV_READS), (scripts, _ENV_SETS)):
        for f in files:
            if f.is_file() and f.name != "_env.py":
                for m in pattern.finditer(f.read_text()):
                    read.setdefault(next(g for g in m.groups() if g), str(f.relative_to(root)))
    assert "GPU_OFFLOAD_NUM_THREADS" in read and "GPU_OFFLOAD_CUDA_ARCHS" in read, read  # the scan sees C and setup
    unknown = {name: where for name, where in read.items() if name not in _env.VARIABLES}
    assert not unknown, f"add these to gpu_offload/_env.py VARIABLES: {unknown}"
    unread = sorted(set(_env.VARIABLES) - set(read))
    assert not unread, f"listed in gpu_offload/_env.py but read nowhere: {unread}"


def test_repeats_help_shows_its_default(workdir: Path) -> None:
    from gpu_offload import cli

    text = " ".join(cli._parser()._subparsers._group_actions[0].choices["bench"].format_help().split())
    entry = text.split("--repeats REPEATS ")[1].split(" --")[0]
    assert entry.startswith("timed repetitions per method") and entry.endswith("(default: 5)"), entry


@pytest.mark.parametrize("text,expected", [
    ("8589934592", 8 << 30), ("8GiB", 8 << 30), ("8 GiB", 8 << 30), ("8gib", 8 << 30), ("8G", 8 << 30),
    ("8g", 8 << 30), ("2GB", 2 * 10**9), ("512MiB", 512 << 20), ("1.5KiB", 1536), ("1e9", 10**9), ("0", 0),
    ("100B", 100), ("4kb", 4000), ("1TiB", 1 << 40)])
def test_sizes_accept_units(text: str, expected: int) -> None:
    from gpu_offload._bytes import parse_bytes

    assert parse_bytes(text, "X") == expected


@pytest.mark.parametrize("text", ["", "lots", "8 GiBs", "-1", "GiB", "8 Gi B", "0x10", "1,000"])
def test_sizes_refuse_the_rest(text: str) -> None:
    from gpu_offload._bytes import parse_bytes

    with pytest.raises(go.OffloadError, match=r"X=.* is not a number of bytes \(e\.g\. 8589934592, 8GiB"):
        parse_bytes(text, "X")


def test_info_refuses_a_bad_thread_count(workdir: Path) -> None:
    """GPU_OFFLOAD_NUM_THREADS is read by the core, once per process (so only in a fresh one): anything but a
    positive integer is refused, by `info` and by the first arena, instead of becoming one thread. (Which
    values are refused is the C++ test a_thread_count_is_a_positive_integer_or_refused: each value here is
    an interpreter started.)"""
    value = "4x"
    proc = run_cli("info", cwd=workdir, env=_env(GPU_OFFLOAD_NUM_THREADS=value), module=True)
    assert proc.returncode == 2 and proc.stdout == "", (value, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert f"GPU_OFFLOAD_NUM_THREADS='{value}' is not a positive integer" in proc.stderr, proc.stderr
    code = "import gpu_offload as go\ntry:\n    go.Arena()\nexcept go.OffloadError as e:\n    print('refused:', e)"
    proc = subprocess.run([sys.executable, "-c", code], env=_env(GPU_OFFLOAD_NUM_THREADS="abc"), capture_output=True,
                          text=True, timeout=TIMEOUT, cwd=workdir)
    assert proc.stdout.startswith("refused: GPU_OFFLOAD_NUM_THREADS='abc'"), (proc.stdout, proc.stderr)


def test_outputs_checked_before_the_run_and_kept(workdir: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    """A refused --plot leaves an existing --json file as it was (the check opens it without truncating),
    and a missing matplotlib is reported before the run, not after it."""
    from gpu_offload import cli

    monkeypatch.chdir(workdir)
    for key in [k for k in os.environ if k.startswith("GPU_OFFLOAD_")]:
        monkeypatch.delenv(key)
    (workdir / "keep.json").write_text("keep")
    assert cli.main(["bench", *FAST, "--json", "keep.json", "--plot", "/proc/nosuch/x.png"]) == 2
    assert (workdir / "keep.json").read_text() == "keep"
    assert not (workdir / "new.json").exists()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ModuleNotFoundError
    assert cli.main(["bench", *FAST, "--json", "new.json", "--plot", "p.png"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "needs matplotlib: pip install 'gpu-offload[plot]'" in captured.err.splitlines()[-1]
    assert not (workdir / "new.json").exists() and not (workdir / "p.png").exists()


# Each bad option: arguments, extra environment, and what the one line on stderr must say. Where the
# defaults would start a real benchmark, a tiny layout and one repeat keep a regression short.
FAST = ("--layout", "tiny.json", "--repeats", "1")
BAD_OPTIONS: dict[str, tuple[tuple[str, ...], dict[str, str], str]] = {
    "unknown layout": (("bench", "--layout", "nosuch", "--repeats", "1"), {}, "unknown layout 'nosuch'"),
    "missing json": (("bench", "--layout", "missing.json"), {}, "missing.json does not exist"),
    "unreadable json": (("bench", "--layout", "broken.json"), {}, "is not readable JSON"),
    "json not an object": (("bench", "--layout", "list.json"), {}, "expected a JSON object"),
    "json bad dimension": (("bench", "--layout", "negative.json"), {}, "must be positive integers"),
    "json malformed runs": (("bench", "--layout", "malformed.json"), {}, "malformed runs"),
    "json no tensors": (("bench", "--layout", "empty.json"), {}, "has no tensors"),
    "json bad dtype": (("bench", "--layout", "dtype.json"), {}, "unknown dtype 'int7'"),
    "cuda without gpu": (("bench", "--device", "cuda", *FAST), {}, "no CUDA device"),
    "unknown device": (("bench", "--device", "tpu", *FAST), {}, "--device must be cpu or cuda"),
    "bad dtype": (("bench", "--dtype", "int7", *FAST), {}, "--dtype must be one of"),
    "zero repeats": (("bench", "--layout", "tiny.json", "--repeats", "0"), {}, "--repeats must be at least 1"),
    "zero scale": (("bench", "--scale", "0", *FAST), {}, "--scale must be at least 1"),
    "non-integer repeats": (("bench", "--repeats", "abc"), {}, "invalid int value: 'abc'"),
    "json is a directory": (("bench", "--json", ".", *FAST), {}, "is a directory"),
    # os.access says yes to root here; only opening the file tells.
    "json in /proc": (("bench", "--json", "/proc/x.json", *FAST), {}, "--json /proc/x.json: not writable"),
    "plot in /proc": (("bench", "--plot", "/proc/x.png", *FAST), {}, "--plot /proc/x.png: not writable"),
    "info bad gather size": (("info",), {"GPU_OFFLOAD_GATHER_MAX_BYTES": "lots"},
                             "GPU_OFFLOAD_GATHER_MAX_BYTES='lots' is not a number of bytes"),
    "info bad size unit": (("info",), {"GPU_OFFLOAD_ARENA_MAX_BYTES": "8 GiBs"}, "is not a number of bytes"),
    "unknown option after command": (("info", "--frob"), {}, "unrecognized arguments: --frob"),
    "unknown command": (("frob",), {}, "invalid choice: 'frob'"),
    "no command": ((), {}, "required"),
    "unknown option": (("bench", "--frob", *FAST), {}, "unrecognized arguments: --frob"),
    "info bad pin mode": (("info",), {"GPU_OFFLOAD_PIN": "bogus"}, "pin must be one of auto, none, hostalloc"),
    "info zero cap": (("info",), {"GPU_OFFLOAD_ARENA_MAX_BYTES": "0"}, "GPU_OFFLOAD_ARENA_MAX_BYTES='0' must be positive"),
    "info fractional cap": (("info",), {"GPU_OFFLOAD_ARENA_MAX_BYTES": "0.5"}, "GPU_OFFLOAD_NODE_MAX_BYTES"),
    "info bad slab size": (("info",), {"GPU_OFFLOAD_MIN_SLAB_BYTES": "lots"}, "not a number of bytes"),
    "info infinite cap": (("info",), {"GPU_OFFLOAD_ARENA_MAX_BYTES": "inf"}, "not a finite number of bytes"),
}


# Every bad option above is checked in this process through cli.main (the same code, milliseconds each);
# these, one of each kind (a layout, a file, the device, argparse, the environment), also through the
# installed command in a subprocess, where an escaped exception would print a traceback and exit 1.
SUBPROCESS_CASES = ["unknown layout", "unreadable json", "cuda without gpu", "non-integer repeats",
                    "info bad pin mode", "json in /proc"]


def _check_error(case: str, returncode: int, stdout: str, stderr: str) -> None:
    if case == "cuda without gpu" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    expected = BAD_OPTIONS[case][2]
    assert returncode == 2, (returncode, stdout[-2000:], stderr[-2000:])
    assert "Traceback" not in stderr + stdout
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("gpu-offload") and ": error: " in lines[0], lines[0]
    assert expected in lines[0], lines[0]
    assert stdout == "", "nothing is printed (or run) before the error"


@pytest.fixture(scope="module")
def bad_option_runs(workdir: Path) -> dict[str, subprocess.CompletedProcess]:
    """Runs the subprocess cases once, two at a time (each process spends its time importing torch)."""

    def one(case: str) -> subprocess.CompletedProcess:
        args, extra, _ = BAD_OPTIONS[case]
        return run_cli(*args, cwd=workdir, env=_env(**extra))

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(SUBPROCESS_CASES, pool.map(one, SUBPROCESS_CASES)))


@pytest.mark.parametrize("case", SUBPROCESS_CASES)
def test_bad_option_command(case: str, bad_option_runs: dict[str, subprocess.CompletedProcess]) -> None:
    proc = bad_option_runs[case]
    _check_error(case, proc.returncode, proc.stdout, proc.stderr)


@pytest.mark.parametrize("case", list(BAD_OPTIONS))
def test_bad_option(case: str, workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from gpu_offload import cli

    args, extra, _ = BAD_OPTIONS[case]
    for key in [k for k in os.environ if k.startswith("GPU_OFFLOAD_")]:
        monkeypatch.delenv(key)
    for key, value in extra.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(workdir)
    try:
        returncode = cli.main(list(args))
    except SystemExit as exc:  # argparse exits by itself
        returncode = exc.code
    captured = capsys.readouterr()
    _check_error(case, returncode, captured.out, captured.err)


def test_info_says_why_there_is_no_driver_or_no_kernels() -> None:
    # `info` gives the reason next to "none": the driver's load error, and for kernels that are off, that
    # the copy engines do every copy and GPU checksums are refused, with the loader's reason.
    from gpu_offload.cli import driver_summary, kernels_summary

    base = {"driver": False, "driver_source": "", "driver_error": "no CUDA driver: dlopen(libcuda.so.1) failed",
            "driver_version": 0, "batched_copies": False, "fatbin_architectures": "", "nvrtc_path": "",
            "nvrtc_version": "", "nvrtc_error": "no libnvrtc found", "devices": []}
    assert driver_summary({"cuda_driver": base}) == "none: no CUDA driver: dlopen(libcuda.so.1) failed"
    assert kernels_summary({"cuda_driver": base}) == \
        "none: copy engines only, GPU checksums refused (no libnvrtc found)"
    on = dict(base, driver=True, driver_version=12040, devices=[
        {"device": 0, "source": "fatbin", "arch": "sm_90", "error": ""},
        {"device": 1, "source": "none", "arch": "sm_70", "error": "GPU_OFFLOAD_KERNELS=off"}])
    assert driver_summary({"cuda_driver": on}) == "12.4, one call per copy"
    assert kernels_summary({"cuda_driver": on}) == (
        "cuda:0 fatbin sm_90, cuda:1 none sm_70 (off: copy engines only, GPU checksums refused; "
        "GPU_OFFLOAD_KERNELS=off)")
