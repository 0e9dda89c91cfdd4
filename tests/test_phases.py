"""benchmarks/phases.py, the GPU check's account of where each call's time goes, runs here on the CPU: every
call of the engine it names, each phase counted once (the phases of a call add up to no more than it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import load_script


def _load() -> Any:
    return load_script("phases")


def test_every_call_is_measured_and_its_phases_fit_in_it(tmp_path: Path) -> None:
    phases = _load()
    layout = tmp_path / "small.json"
    layout.write_text(json.dumps({"dtype": "float32", "runs": [[[4], 300], [[64, 64], 3]]}))
    result = phases.run_layout(str(layout), phases.torch.device("cpu"), repeats=2)
    assert result["num_tensors"] == 303 and result["limit_ms"] == {}  # (no link on the CPU)
    names = [row["name"] for row in result["rows"]]
    assert names == ["snapshot+wait", "restore", "offload", "offload, no empty_cache", "reload", "swap"]
    for row in result["rows"]:
        assert all(row[p] >= 0 for p in phases.PHASES) and row["call"] >= 0 and row["device"] >= 0, row
        # Each phase is an interval inside its call's, none inside another counted: what is left is never
        # negative in any call, so neither is its median.
        assert row["rest"] >= 0, row


def test_a_phase_inside_another_is_counted_once() -> None:
    phases = _load()
    counter = phases.Phases()
    inner = counter.wrap("resize", lambda: None)
    outer = counter.wrap("check", lambda: inner())
    outer()
    inner()
    assert counter.calls["check"] == 1 and counter.calls["resize"] == 1  # (inner on its own, not in outer)
    counter.reset()
    outer()
    assert counter.calls == {**dict.fromkeys(phases.PHASES, 0), "check": 1} and counter.seconds["resize"] == 0


def test_the_phases_are_put_back_after_a_call_that_raises() -> None:
    phases = _load()
    from gpu_offload import api, plan

    before = (api.named_tensors, plan.resolve, plan.CopyPlans.run)
    counter = phases.Phases()
    with pytest.raises(RuntimeError, match="inside"):
        with phases.instrumented(counter):
            assert plan.resolve is not before[1]
            raise RuntimeError("inside")
    assert (api.named_tensors, plan.resolve, plan.CopyPlans.run) == before
