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


def check_result(res: dict, *, layout: str, num_tensors: int, nbytes: int, scale: int, baselines: bool) -> None:
    """Structure of one layout's result, positive figures, and ratios equal to GB/s over the limit."""
    assert res["layout"] == layout
    assert res["device"] == "cpu"
    assert (res["num_tensors"], res["nbytes"], res["scale"], res["repeats"]) == (num_tensors, nbytes, scale, 1)
    rows = res["rows"]
    for r in rows:
        assert set(r) == {"method", "direction", "seconds", "nbytes", "gbps", "ratio", "note"}, r
        assert r["direction"] in ("d2h", "h2d"), r
        assert r["nbytes"] == nbytes
        assert r["seconds"] > 0 and r["gbps"] > 0 and math.isfinite(r["gbps"]), r
        assert r["gbps"] == pytest.approx(nbytes / r["seconds"] / 1e9, rel=1e-9), r
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


def check_table(stdout: str, res: dict) -> None:
    """The printed table shows the same methods, GB/s and ratios as the JSON, in the same order."""
    rows = table_rows(stdout)
    assert len(rows) == len(res["rows"]), stdout
    for cells, r in zip(rows, res["rows"]):
        method, direction, ms, gbps, ratio, _note = cells
        assert method == r["method"], "method names are printed in full (no truncation when piped)"
        assert direction == r["direction"]
        assert gbps == f"{r['gbps']:.2f}" and ms == f"{r['seconds'] * 1e3:.2f}"
        assert ratio == ("" if r["ratio"] is None else f"{r['ratio']:.2f}")


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
    proc = run_cli("bench", "--layout", "tiny.json", "--repeats", "1", "--json", "out/bench.json",
                   "--plot", "out/bench.png", cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "tiny-test on cpu: 9 tensors, 0.001 GB" in proc.stdout  # title: layout, device, count, size
    header = next(line for line in proc.stdout.splitlines() if "method" in line)
    for col in ("method", "dir", "ms", "GB/s", "x limit", "note"):
        assert col in header
    assert "wrote out/bench.json" in proc.stdout and "wrote out/bench.png" in proc.stdout

    data = json.loads((workdir / "out/bench.json").read_text())
    assert set(data) == {"results", "info"}
    assert len(data["results"]) == 1
    res = data["results"][0]
    check_result(res, layout="tiny-test", num_tensors=TINY_TENSORS, nbytes=TINY_BYTES, scale=1, baselines=True)
    check_table(proc.stdout, res)
    assert data["info"]["build"]["version"] == go.__version__

    png = (workdir / "out/bench.png").read_bytes()
    assert png[:8] == PNG_MAGIC
    import matplotlib.image

    image = matplotlib.image.imread(workdir / "out/bench.png")
    height, width = image.shape[:2]
    assert image.ndim == 3 and image.shape[2] in (3, 4)
    assert 300 <= width <= 4000 and 200 <= height <= 4000, image.shape
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
    env = _env(GPU_OFFLOAD_ARENA_MAX_BYTES=str(1 << 30), GPU_OFFLOAD_MIN_SLAB_BYTES=str(64 << 20),
               GPU_OFFLOAD_PIN="none")
    proc = run_cli("info", cwd=workdir, env=env, module=True)
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
                    "info bad pin mode"]


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
