"""The driver-API backend on a real GPU: what build_info() reports, and each path the driver's version or the
environment selects (batched or per-copy copies; kernels from the fatbin, from NVRTC, or off). The driver is
loaded once per process, so each case runs in a fresh interpreter. Skipped without a GPU; the same paths run
on the simulated driver in ctest (sim_*)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.cuda

# Sizes from one byte to 12 MiB: with GPU_OFFLOAD_GATHER_MAX_BYTES the small ones go through the gather
# kernel, the large ones through the copy engines. A round trip, GPU checksums of the source, and a restore.
_CHILD = r"""
import json, sys, torch, gpu_offload as go
torch.manual_seed(0)
src = {f"t{i}": torch.randn(n, device="cuda") for i, n in enumerate([1, 7, 1000, 4096, 65536, 1 << 20, 3 << 20])}
src["b"] = torch.randint(0, 255, (12345,), dtype=torch.uint8, device="cuda")
expect = {k: v.cpu() for k, v in src.items()}
out = {}
try:
    snap = go.snapshot(src, checksum=sys.argv[1] == "1").wait()
    if sys.argv[1] == "1":
        snap.verify()
    host = snap.tensors()
    out["host_ok"] = all(torch.equal(host[k], expect[k]) for k in src)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    go.restore(dst, snap)
    torch.cuda.synchronize()
    out["restore_ok"] = all(torch.equal(dst[k].cpu(), expect[k]) for k in src)
except go.OffloadError as exc:
    out["error"] = str(exc)
out["driver"] = go.build_info()["cuda_driver"]
out["capability"] = list(torch.cuda.get_device_capability())
print(json.dumps(out))
"""


def _run(checksum: bool, **env: str) -> dict[str, Any]:
    e = dict(os.environ, GPU_OFFLOAD_GATHER_MAX_BYTES="65536", **env)
    e.pop("GPU_OFFLOAD_SIM", None)
    proc = subprocess.run([sys.executable, "-c", _CHILD, "1" if checksum else "0"], env=e, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _round_trip_ok(out: dict[str, Any]) -> None:
    assert "error" not in out, out["error"]
    assert out["host_ok"] and out["restore_ok"]


def test_the_real_driver_is_loaded_and_reports_what_it_offers():
    out = _run(True)
    _round_trip_ok(out)
    d = out["driver"]
    assert d["driver"] and d["driver_source"].endswith("libcuda.so.1") and not d["missing_entry_points"]
    assert d["driver_version"] >= 12020
    assert d["batched_copies"] == (d["driver_version"] >= 12080)
    major, minor = out["capability"]
    (k,) = [k for k in d["devices"] if k["device"] == 0]
    assert k["arch"] == f"sm_{major}{minor}"
    # The fatbin where the build has one for this architecture, else NVRTC: never none on a GPU with either.
    assert k["source"] in ("fatbin", "nvrtc"), k["error"]
    assert k["gather_regs"] > 0 and k["checksum_regs"] > 0
    assert d["num_failed_pins"] == 0, d["pin_error"]
    assert d["num_batch_fallbacks"] == 0, d["batch_error"]  # a refused batch is copied one by one: slower


def test_per_copy_path_of_older_drivers():
    out = _run(True, GPU_OFFLOAD_BATCHED_COPIES="0")
    _round_trip_ok(out)
    assert not out["driver"]["batched_copies"]


def test_kernels_compiled_by_nvrtc_and_cached(tmp_path: Path):
    cache = tmp_path / "kernels"
    out = _run(True, GPU_OFFLOAD_KERNELS="nvrtc", GPU_OFFLOAD_CACHE_DIR=str(cache))
    d = out["driver"]
    if not d["nvrtc_path"]:
        pytest.skip(f"no libnvrtc here: {d['nvrtc_error']}")
    _round_trip_ok(out)
    (k,) = [k for k in d["devices"] if k["device"] == 0]
    assert k["source"] == "nvrtc", k["error"]
    cached = sorted(p.name for p in cache.rglob("*") if p.is_file())
    assert cached, "NVRTC's image was not cached"
    # A second process loads the cached image.
    again = _run(True, GPU_OFFLOAD_KERNELS="nvrtc", GPU_OFFLOAD_CACHE_DIR=str(cache))
    _round_trip_ok(again)
    assert sorted(p.name for p in cache.rglob("*") if p.is_file()) == cached


def test_kernels_off_copies_with_the_engines_and_refuses_gpu_checksums():
    out = _run(False, GPU_OFFLOAD_KERNELS="off")
    _round_trip_ok(out)
    (k,) = [k for k in out["driver"]["devices"] if k["device"] == 0]
    assert k["source"] == "none"
    refused = _run(True, GPU_OFFLOAD_KERNELS="off")
    assert "checksum" in refused.get("error", ""), refused

