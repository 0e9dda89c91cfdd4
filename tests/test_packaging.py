"""The sdist is complete: it holds what building needs (the C++/CUDA sources, the CMake project, the build
script), the license the metadata declares, and no build outputs. Building it takes seconds (no compile)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sdist_names(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    if not (ROOT / "setup.py").exists():
        pytest.skip("not a source checkout")
    out = tmp_path_factory.mktemp("sdist")
    # From a copy holding only the tracked files: setuptools would otherwise also take what an earlier
    # build's *.egg-info/SOURCES.txt lists, and hide a file the manifest leaves out.
    src = tmp_path_factory.mktemp("src") / "gpu_offload"
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True)
    if tracked.returncode == 0 and tracked.stdout:
        for name in tracked.stdout.decode().split("\0"):
            if name and (ROOT / name).is_file():
                (src / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, src / name)
    else:
        shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns("build", "*.egg-info", ".venv", "*.so", ".git"))
    proc = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(out), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (archive,) = out.glob("gpu_offload-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    top = names[0].split("/")[0]
    return [n[len(top) + 1:] for n in names if "/" in n]


def test_sdist_holds_what_building_needs(sdist_names: list[str]) -> None:
    names = set(sdist_names)
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "csrc", "gpu_offload"], capture_output=True,
                             text=True)
    # Every file under csrc/ (whatever its suffix: a .cuh header was once left out), the package's sources.
    sources = [n for n in tracked.stdout.split() if n.startswith("csrc/") or n.endswith((".py", ".json"))]
    if tracked.returncode != 0 or not sources:  # not a git checkout: the files on disk
        sources = [str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*") if p.is_file()]
    assert sources
    missing = [n for n in sources if n not in names]
    assert not missing, f"the sdist leaves out {missing}"
    for needed in ("CMakeLists.txt", "setup.py", "pyproject.toml", "LICENSE", "README.md", "gpu_offload/py.typed",
                   "gpu_offload/data/layouts.json", "csrc/bindings.cpp"):
        assert needed in names, needed
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]


def test_sdist_has_no_build_outputs(sdist_names: list[str]) -> None:
    bad = [n for n in sdist_names if n.endswith((".so", ".o", ".pyc")) or n.startswith("build/")]
    assert not bad, bad
