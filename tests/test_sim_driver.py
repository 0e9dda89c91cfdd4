"""The GPU path's Python side (plan.py's device groups, the arena's deferred frees) on the simulated CUDA
driver: tests/sim, run in a process of their own, because the driver is chosen once per process at its
first use (GPU_OFFLOAD_SIM=2: two simulated devices)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import gpu_offload as go

HERE = Path(__file__).resolve().parent


def test_simulated_driver_suite() -> None:
    if not go.build_info()["cuda"]:
        pytest.skip("built without the CUDA backend (GPU_OFFLOAD_CUDA=0)")
    env = dict(os.environ, GPU_OFFLOAD_SIM="2")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(HERE.parent),
                           "-c", str(HERE.parent / "pyproject.toml"), str(HERE / "sim")],
                          env=env, capture_output=True, text=True, timeout=900, cwd=HERE)
    print(proc.stdout[-20000:])
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout
