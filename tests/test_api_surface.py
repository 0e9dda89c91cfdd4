"""The public surface as a newcomer meets it: dir(gpu_offload), sizes with units, what pickling a snapshot
says, and the README's API table listing everything public."""

from __future__ import annotations

import copy
import pickle
import re
from pathlib import Path

import pytest
import torch

import gpu_offload as go

README = Path(__file__).resolve().parent.parent / "README.md"


def test_dir_shows_the_api_only():
    assert dir(go) == sorted(go.__all__)
    for name in go.__all__:
        assert hasattr(go, name), name


def test_arena_sizes_accept_the_units_the_environment_accepts():
    arena = go.Arena(max_bytes="1GiB", min_slab_bytes="4 MiB", pin="none")
    assert arena.max_bytes == 1 << 30 and arena.stats()["max_bytes"] == 1 << 30
    arena.reserve("1MiB")
    assert arena.capacity_bytes == 1 << 20  # a first slab of the request's size
    assert go.Arena(max_bytes="2GB").max_bytes == 2 * 10**9
    with pytest.raises(go.OffloadError, match=r"max_bytes='lots' is not a number of bytes \(e\.g\. 8589934592, 8GiB"):
        go.Arena(max_bytes="lots")
    with pytest.raises(go.OffloadError, match="num_bytes='8 GiBs' is not a number of bytes"):
        arena.reserve("8 GiBs")
    with pytest.raises(go.OffloadError, match=r"max_bytes must be an int from 1 to 2\*\*63-1 or None, got 0"):
        go.Arena(max_bytes="0")
    with pytest.raises(go.OffloadError, match=r"max_bytes must be an int .* got True"):  # (a bool is no size)
        go.Arena(max_bytes=True)
    with pytest.raises(go.OffloadError, match=r"min_slab_bytes must be an int .* got True"):
        go.Arena(min_slab_bytes=True)


def test_stats_max_bytes_is_none_without_a_cap():
    arena = go.Arena(min_slab_bytes=1 << 20)
    assert arena.max_bytes is None and arena.stats()["max_bytes"] is None


def test_pickling_a_snapshot_says_to_use_save(arena):
    snap = go.snapshot({"w": torch.zeros(4)}, arena=arena)
    for attempt in (pickle.dumps, lambda s: torch.save(s, "/dev/null")):
        with pytest.raises(TypeError, match=r"cannot be pickled.*gpu_offload\.save\(snap, path\).*gpu_offload\.load"):
            attempt(snap)
    with pytest.raises(go.OffloadError, match="cannot be deep-copied"):
        copy.deepcopy(snap)
    with pytest.raises(TypeError, match="Arena cannot be pickled"):
        pickle.dumps(arena)
    snap.free()


def _api_table() -> str:
    """The README's table of calls (from its header row to the first line that is not a table row)."""
    lines = README.read_text().splitlines()
    start = lines.index("| call | what it does |")
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    return "\n".join(lines[start:end])


def test_the_readme_api_table_lists_everything_public():
    """Every name gpu_offload exports, and every public method and property of Snapshot and Arena, is in the
    README's API table; a name added to __all__ (or a method) without a line there fails here."""
    table = _api_table()
    for name in go.__all__:
        if name in ("Snapshot", "Arena", "__version__"):
            pattern = rf"`(go\.)?{re.escape(name)}\b"
        else:
            pattern = rf"`go\.{re.escape(name)}\b"
        assert re.search(pattern, table), f"{name} is exported but not in the README's API table"
    for cls in (go.Snapshot, go.Arena):
        for attr in sorted(vars(cls)):
            if attr.startswith("_"):
                continue
            assert re.search(rf"`\.{attr}\b", table), f"{cls.__name__}.{attr} is public but not in the README's table"
