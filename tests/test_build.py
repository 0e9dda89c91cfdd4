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
    if info["cuda"]:
        assert info["cuda_runtime_version"] >= 11000
        assert info["cuda_architectures"]
    assert info["arena_alignment"] >= 256


def test_ci_expectation_about_the_cuda_build(expect_cuda_build):
    """CI sets GPU_OFFLOAD_EXPECT_CUDA_BUILD=1 where nvcc exists, proving the CUDA code was compiled."""
    if expect_cuda_build is None:
        import pytest

        pytest.skip("GPU_OFFLOAD_EXPECT_CUDA_BUILD not set")
    info = go.build_info()
    assert info["cuda"] is expect_cuda_build
    if expect_cuda_build:
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
