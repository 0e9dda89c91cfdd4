"""What was built, and that importing made no CUDA call."""

from __future__ import annotations

import os
import subprocess
import sys

import gpu_offload as go


def test_build_info_fields():
    info = go.build_info()
    assert info["version"] == go.__version__ == info["core_version"]
    assert isinstance(info["cuda"], bool)
    assert info["arena_alignment"] >= 256
    assert info["cuda_runtime_version"] is None  # no runtime is linked; the key stays for its readers
    d = info["cuda_driver"]
    if not info["cuda"]:
        assert d is None and info["cuda_architectures"] == []
        return
    assert set(d) >= {"driver", "driver_version", "entry_points", "batched_copies", "fatbin_architectures",
                      "nvrtc_path", "devices"}
    assert d["fatbin_architectures"] == ",".join(info["cuda_architectures"])
    if d["driver"]:
        assert d["driver_version"] >= 12020 and "cuLaunchKernel" in d["entry_points"]
        assert d["batched_copies"] == (d["driver_version"] >= 12080 and "cuMemcpyBatchAsync" in d["entry_points"])
    else:
        assert d["driver_error"] and d["devices"] == []


def test_ci_expectation_about_the_cuda_build(expect_cuda_build):
    """CI sets GPU_OFFLOAD_EXPECT_CUDA_BUILD=1 where nvcc exists, proving the CUDA code was compiled."""
    if expect_cuda_build is None:
        import pytest

        pytest.skip("GPU_OFFLOAD_EXPECT_CUDA_BUILD not set")
    info = go.build_info()
    assert info["cuda"] is expect_cuda_build
    if expect_cuda_build and os.environ.get("GPU_OFFLOAD_EXPECT_FATBIN", "1") == "1":
        archs = " ".join(info["cuda_architectures"])
        assert "80" in archs and "90" in archs


def test_import_works_without_touching_cuda():
    # A fresh interpreter: importing and using the CPU path must work with no driver; with CUDA_VISIBLE_DEVICES
    # empty a CUDA build must report no device rather than fail.
    code = (
        "import torch, gpu_offload as go\n"
        "s = go.snapshot({'a': torch.arange(5.)})\n"
        "t = {'a': torch.zeros(5)}\n"
        "go.restore(t, s)\n"
        "assert t['a'].tolist() == [0., 1., 2., 3., 4.]\n"
        "print(go.cuda_available())\n"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_driver_is_loaded_at_first_use_not_at_import():
    # With the simulated driver chosen (GPU_OFFLOAD_SIM), _sim.enabled() is true only once the driver table
    # was loaded: importing the package and a CPU snapshot leave it unloaded; the first CUDA question loads it.
    if not go.build_info()["cuda"]:
        import pytest

        pytest.skip("a CPU-only build has no driver table")
    code = (
        "import torch, gpu_offload as go\n"
        "from gpu_offload._ext import _C\n"
        "s = go.snapshot({'a': torch.arange(5.)}, arena=go.Arena(pin='none'))\n"
        "print(_C._sim.enabled())\n"
        "print(go.cuda_available(), _C._sim.enabled())\n"
    )
    env = dict(os.environ, GPU_OFFLOAD_SIM="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True", "True"]


def test_forked_child_copies_without_the_parents_threads():
    # The host path splits large copies over a thread pool; a fork()ed child has none of its workers (and
    # may inherit its locks in any state), so the pool runs jobs serially there. This checks the child's
    # copy completes and is right; it does not force the unlucky fork timing. (The child avoids torch's
    # own parallel ops: OpenMP is not fork-safe.)
    code = (
        "import os, torch, gpu_offload as go\n"
        "a = go.Arena(pin='none')\n"
        "state = {'x': torch.arange(8 << 20, dtype=torch.float32)}\n"
        "go.snapshot(state, arena=a).free()\n"  # the pool is running in the parent now
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    s = go.snapshot(state, arena=a)\n"
        "    ok = s.tensors()['x'][::1 << 20].tolist() == [float(i) for i in range(0, 8 << 20, 1 << 20)]\n"
        "    os._exit(0 if ok else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(os.waitstatus_to_exitcode(status))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"
