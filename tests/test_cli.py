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
import resource
import subprocess
import sys
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
ENGINE_METHODS = {"gpu_offload.snapshot+wait", "gpu_offload.restore", "gpu_offload.offload", "gpu_offload.reload"}
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
                          "gbps_max", "iqr_seconds", "spread"}, r
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
    assert any(m.startswith("seed:") for m in methods) == baselines
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
        assert r["nbytes"] == 0 and r["gbps"] == 0 and r["ratio"] is None, r
        assert r["seconds"] > 0 and min(r["samples"]) <= r["seconds"] <= max(r["samples"]), r
        assert r["spread"] == pytest.approx(max(r["samples"]) / min(r["samples"]), rel=1e-9), r
        if r is not rows[0]:
            assert r["note"].startswith(f"{r['seconds'] / y:.2f} Y; "), r
    assert len(rows[2]["samples"]) == max(repeats, 5)


def check_table(stdout: str, res: dict) -> None:
    """The printed table shows the same methods, GB/s and ratios as the JSON, in the same order."""
    rows = table_rows(stdout)
    assert len(rows) == len(res["rows"]), stdout
    for cells, r in zip(rows, res["rows"]):
        method, direction, ms, gbps, span, ratio, _note = cells
        assert method == r["method"], "method names are printed in full (no truncation when piped)"
        assert direction == r["direction"]
        assert ms == f"{r['seconds'] * 1e3:.2f}"
        wide = " !" if r["spread"] > 1.5 else ""
        if r["direction"] == "host":
            assert (gbps, span) == ("-", "-" + wide)
            continue
        assert gbps == f"{r['gbps']:.3g}"
        assert span == f"{r['gbps_min']:.3g}-{r['gbps_max']:.3g}" + wide
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
    assert "tiny-test on cpu: 9 tensors, 0.001 GB" in proc.stdout  # title: layout, device, count, size
    header = next(line for line in proc.stdout.splitlines() if "method" in line)
    for col in ("method", "dir", "ms", "GB/s", "min-max GB/s", "x limit", "note"):
        assert col in header
    assert "wrote out/bench.json" in proc.stdout and "wrote out/bench.png" in proc.stdout

    data = json.loads((workdir / "out/bench.json").read_text())
    assert {"schema_version", "timestamp", "host", "commit", "torch", "torch_cuda", "driver", "device", "repeats",
            "results", "info"} <= set(data)
    assert data["schema_version"] == 2 and data["repeats"] == 3 and data["device"] == "cpu"
    assert data["torch"] == torch.__version__ and data["timestamp"][:2] == "20"
    assert len(data["results"]) == 1
    res = data["results"][0]
    assert res["dtype"] == "float32"
    check_result(res, layout="tiny-test", num_tensors=TINY_TENSORS, nbytes=TINY_BYTES, scale=1, baselines=True,
                 repeats=3)
    check_table(proc.stdout, res)
    assert data["info"]["build"]["version"] == go.__version__

    # Piped (stdout is not a terminal): one line per finished measurement, printed as each one ends, so
    # all of them come before the tables, in the order of the rows.
    lines = proc.stdout.splitlines()
    first_table = next(i for i, line in enumerate(lines) if "tiny-test on cpu" in line)
    progress = [line for line in lines[:first_table] if line.startswith("tiny-test: ")]
    assert len(progress) == len(res["rows"]), lines[:first_table]
    for line, r in zip(progress, res["rows"]):
        if r["direction"] == "host":
            assert line.startswith(f"tiny-test: {r['method']} (host) {r['seconds'] * 1e3:.3f} ms median"), line
            assert f"repeat(s); {r['note']}" in line
            continue
        assert line.startswith(f"tiny-test: {r['method']} ({r['direction']}) {r['gbps']:.3g} GB/s median"), line
        assert f"min-max {r['gbps_min']:.3g}-{r['gbps_max']:.3g} GB/s" in line and "over 3 repeat(s)" in line
    wide = [r for r in res["rows"] if r["spread"] > 1.5]
    assert ("warning:" in proc.stdout) == bool(wide)

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
                   "--no-baselines", "--json", "named.json", cwd=workdir, module=True)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    count, nbytes = _layout_bytes("qwen1.5b", 512, 2)
    res = json.loads((workdir / "named.json").read_text())["results"][0]
    check_result(res, layout="qwen1.5b", num_tensors=count, nbytes=nbytes, scale=512, baselines=False)
    check_table(proc.stdout, res)
    assert "(scaled 1/512)" in proc.stdout
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
    assert fields["built with CUDA"] == str(build["cuda"])
    assert fields["CUDA runtime"] == str(build["cuda_runtime_version"])
    assert fields["architectures"] == (", ".join(build["cuda_architectures"]) or "-")
    assert fields["torch / python"].startswith(torch.__version__ + " / 3.")
    assert fields["CUDA available"] == str(go.cuda_available())
    assert (fields["devices"] == "-") == (not go.cuda_available())
    assert fields["host memory available"].endswith(" GiB") and float(fields["host memory available"][:-4]) > 0
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    assert fields["ulimit -l"] == ("unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**20:.1f} MiB")
    assert fields["arena max_bytes"] == str(1 << 30)
    assert fields["arena min slab"] == "64 MiB"
    assert fields["arena pinning"] == "none"
    assert fields["host copy threads"] == "1"
    assert fields["gather max bytes"] == str(64 << 10)


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
    positive integer is refused, by `info` and by the first arena, instead of becoming one thread."""
    for value in ("abc", "0", "-2", "4x"):
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
    "info zero cap": (("info",), {"GPU_OFFLOAD_ARENA_MAX_BYTES": "0"}, "max_bytes must be a positive int"),
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
