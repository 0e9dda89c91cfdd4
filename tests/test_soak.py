"""Soak, the short version: 50 cycles of snapshot/restore/offload/reload/free (benchmarks/soak.py runs 1000).
Host RSS, arena bytes, pinned bytes, slabs, cached plans and (on a GPU) the caching allocator's figures stay
flat after warm-up, and the values stay bitwise right."""

from __future__ import annotations

from typing import Any

from conftest import load_script


def _soak_module() -> Any:
    return load_script("soak")


def test_fifty_cycles_leak_nothing(device):
    soak = _soak_module()
    result = soak.soak(50, device=str(device), width=256, depth=4, warmup=10, check_every=5)
    assert result["wrong_values"] == 0
    after, final = result["after_warmup"], result["final"]
    # Exactly flat: nothing held between cycles, nothing pinned or planned anew after warm-up.
    assert final["arena_used_bytes"] == 0 and result["max"]["arena_used_bytes"] == 0
    assert final["offloaded_bytes"] == 0
    assert result["min"]["pinned_bytes"] == result["max"]["pinned_bytes"] == after["pinned_bytes"] > 0
    assert result["max"]["slab_allocations"] == after["slab_allocations"]
    assert result["max"]["cached_plans"] == after["cached_plans"]
    if device.type == "cuda":
        assert result["drift"]["cuda_memory_allocated"] == 0.0
        assert result["drift"]["cuda_memory_reserved"] <= 0.01
    # Within 1% (the allocator and the interpreter move RSS by a page or so between cycles).
    assert result["drift"]["rss_bytes"] <= 0.01, (result["min"]["rss_bytes"], result["max"]["rss_bytes"])
    assert result["ok"], result


def test_drift_and_flatness_are_computed_as_documented():
    soak = _soak_module()
    assert soak.drift([100, 101, 99, 100]) == 0.01
    assert soak.drift([100, 100, 98]) == 0.02
    assert soak.drift([0, 0, 0]) == 0.0 and soak.drift([]) == 0.0
    assert soak.trend([5, 5, 5]) == 0.0 and soak.trend([0, 1, 2, 3]) == 1000.0
