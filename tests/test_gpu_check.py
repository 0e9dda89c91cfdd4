"""benchmarks/gpu_check.sh records each stage with its own command's status: a GPU window is rare, and a
check that reports green over failures wastes it. Run here with a stand-in nvidia-smi (so the GPU stages
run) and a stand-in interpreter whose pytest is a failing test file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_a_stage_whose_command_fails_is_recorded_as_failed(tmp_path: Path) -> None:
    for tool in ("bash", "timeout", "tee"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # Answers `nvidia-smi -L` and the machine stage's queries: the GPU stages run.
    _executable(bin_dir / "nvidia-smi", "#!/bin/sh\necho 'GPU 0: Stand-in H200 (UUID: GPU-00000000)'\n")
    failing = tmp_path / "test_fails.py"
    failing.write_text("def test_passes():\n    pass\n\n\n"
                       "def test_fails():\n    assert False, 'the stand-in cuda test failed'\n")
    # `python -m pytest ...` runs the failing file instead of the cuda tests; anything else is the real
    # interpreter (the machine stage, and the benchmark, which fails here without a GPU).
    python = _executable(bin_dir / "python-stand-in", f"""#!/bin/sh
case " $* " in
  *" -m pytest "*) exec "{sys.executable}" -m pytest -q -p no:cacheprovider "{failing}" ;;
esac
exec "{sys.executable}" "$@"
""")
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHON=str(python), OUT=str(out),
               GPU_CHECK_COMMIT="0" * 40, GPU_CHECK_STAGES="machine cuda-first bench-small")
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    record = json.loads((out / "record.json").read_text())
    status = {s["stage"]: s["status"] for s in record["stages"]}
    assert status["machine"] == "ok", (status, proc.stdout[-4000:])
    assert status["cuda-first"] == "fail-rc1", (status, proc.stdout[-4000:])  # pytest's own status
    assert status["bench-small"].startswith("fail-rc"), (status, proc.stdout[-4000:])  # the bench's own status
    assert status["build"] == status["cuda-rest"] == "not-selected", status
    assert proc.returncode == 1, proc.returncode  # the script itself says that a stage failed
    log = (out / "check.log").read_text()
    assert "the stand-in cuda test failed" in log  # the test's own report reached the log
    assert "MemAvailable" in log and "ulimit -l" in log and "setuptools" in log  # the machine stage's facts
    # The summary table (its last row: the last stage) is the last thing written, and it reached the log before
    # the script ended.
    assert log.rstrip().splitlines()[-1].split()[0] == "baselines", log[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["check.log", "record.json"]
