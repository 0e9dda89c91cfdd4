"""Snapshots on disk: round trips, the safetensors format, atomic saves (SIGKILL in the middle), and clear
errors for truncated, corrupt, foreign and missing files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import gpu_offload as go
from conftest import assert_bitwise_equal, random_tensor
from gpu_offload import persist


def _state(device: torch.device) -> dict[str, torch.Tensor]:
    base = random_tensor((3000,), torch.float32, device, seed=1)
    return {
        "w": random_tensor((65, 33), torch.bfloat16, device, seed=2),
        "base": base,
        "view": base[100:200].view(10, 10).t(),  # non-contiguous view sharing base's storage
        "i64": random_tensor((17,), torch.int64, device, seed=3),
        "f8": random_tensor((5, 3), torch.float8_e4m3fn, device, seed=4),
        "flag": random_tensor((3,), torch.bool, device, seed=5),
        "empty": torch.empty(0, 4, device=device),
        "big": random_tensor((40_000,), torch.float16, device, seed=6),  # > 64 KiB: the large alignment
    }


@pytest.fixture
def saved(tmp_path: Path, arena: go.Arena) -> tuple[Path, dict[str, torch.Tensor]]:
    state = _state(torch.device("cpu"))
    path = tmp_path / "state.snap"
    with go.snapshot(state, arena=arena, checksum=True) as snap:
        go.save(snap, path)
    return path, state


def _rewrite(src: Path, dst: Path, *, metadata=None, tensors=None) -> None:
    """Writes a safetensors file with the same tensors/metadata as src, except what is given."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        meta = dict(f.metadata())
        data = {k: f.get_tensor(k) for k in f.keys()}
    if metadata is not None:
        meta = metadata(meta)
    if tensors is not None:
        data = tensors(data)
    save_file(data, str(dst), metadata=meta)


def test_round_trip_restores_bitwise_into_a_twin(device, tmp_path, arena):
    state = _state(device)
    expected = {k: v.clone() for k, v in state.items()}
    snap = go.snapshot(state, arena=arena, checksum=True)
    path = tmp_path / "a.snap"
    go.save(snap, path)
    loaded = go.load(path, arena=arena)
    assert loaded.names == snap.names and loaded.nbytes == snap.nbytes
    assert [(t.shape, t.stride, t.offset, t.dtype, t.storage) for t in loaded.layout.tensors] == \
           [(t.shape, t.stride, t.offset, t.dtype, t.storage) for t in snap.layout.tensors]
    assert [(s.name, s.nbytes, s.device) for s in loaded.layout.storages] == \
           [(s.name, s.nbytes, s.device) for s in snap.layout.storages]
    assert loaded.checksums == snap.checksums
    loaded.verify()
    for k, v in loaded.tensors().items():
        assert_bitwise_equal(v.to(device), expected[k])
    snap.free()
    del v  # views keep their snapshot's memory alive
    twin_base = torch.zeros(3000, device=device)
    twin = {k: torch.zeros_like(v) for k, v in state.items() if k not in ("base", "view")}
    twin.update(base=twin_base, view=twin_base[100:200].view(10, 10).t())
    go.restore(twin, loaded, verify=True)
    for k in state:
        assert_bitwise_equal(twin[k], expected[k])
    loaded.free()
    assert arena.used_bytes == 0


def test_a_snapshot_without_checksums_is_saved_with_host_checksums(tmp_path, arena):
    state = {"a": torch.arange(10.0)}
    snap = go.snapshot(state, arena=arena)
    go.save(snap, tmp_path / "a.snap")
    loaded = go.load(tmp_path / "a.snap", arena=arena)
    assert loaded.checksums is not None and len(loaded.checksums) == 1
    layout = json.loads(_metadata(tmp_path / "a.snap")["layout"])
    assert layout["checksum_source"] == "host copy"


def _metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata())


def test_the_file_is_plain_safetensors(saved):
    from safetensors.torch import load_file

    path, state = saved
    tensors = load_file(str(path))
    assert sorted(tensors) == [f"storage.{i}" for i in range(len(tensors))]
    meta = _metadata(path)
    assert meta["format"] == "gpu_offload.snapshot" and meta["format_version"] == "1"
    assert meta["package_version"] == go.__version__
    layout = json.loads(meta["layout"])
    assert [t["name"] for t in layout["tensors"]] == list(state)
    assert layout["tensors"][0]["dtype"] == "bfloat16" and layout["tensors"][0]["shape"] == [65, 33]
    assert layout["checksum_source"] == "source"
    assert all(len(s["checksum"]) == 16 for s in layout["storages"])
    # storage.1 holds base's bytes (base and view share it)
    assert torch.equal(tensors["storage.1"], state["base"].view(torch.uint8))


def test_save_replaces_atomically_and_leaves_no_temporary(tmp_path, arena):
    path = tmp_path / "x.snap"
    go.save(go.snapshot({"a": torch.zeros(100)}, arena=arena), path)
    go.save(go.snapshot({"a": torch.ones(100)}, arena=arena), path)
    assert sorted(os.listdir(tmp_path)) == ["x.snap"]
    loaded = go.load(path, arena=arena)
    assert bool((loaded.tensors()["a"] == 1).all())


def test_a_failed_save_leaves_the_previous_file(tmp_path, arena, monkeypatch):
    path = tmp_path / "x.snap"
    go.save(go.snapshot({"a": torch.zeros(100)}, arena=arena), path)
    before = path.read_bytes()

    def failing_replace(src, dst):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(persist.os, "replace", failing_replace)
    with pytest.raises(OSError, match="injected"):
        go.save(go.snapshot({"a": torch.ones(100)}, arena=arena), path)
    monkeypatch.undo()
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["x.snap"]


def test_a_corrupt_host_copy_is_not_saved(tmp_path, arena):
    path = tmp_path / "x.snap"
    snap = go.snapshot({"a": torch.zeros(100)}, arena=arena, checksum=True)
    go.save(snap, path)
    before = path.read_bytes()
    snap.tensors()["a"].view(torch.uint8)[17] ^= 1
    with pytest.raises(go.OffloadError, match=r"host copy is corrupt.*\(a,"):
        go.save(snap, path)
    assert path.read_bytes() == before
    snap.free()
    with pytest.raises(go.OffloadError, match="freed"):
        go.save(snap, path)


def test_stale_temporaries_of_dead_processes_are_removed(tmp_path, arena):
    path = tmp_path / "x.snap"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"x.snap.tmp-{dead.pid}-0"
    stale.write_bytes(b"partial")
    alive = tmp_path / f"x.snap.tmp-{os.getppid()}-0"  # a live process (pytest's parent): left alone
    alive.write_bytes(b"partial")
    go.save(go.snapshot({"a": torch.zeros(3)}, arena=arena), path)
    assert not stale.exists() and alive.exists()


_KILL_CHILD = textwrap.dedent("""
    import sys, torch, gpu_offload as go
    path = sys.argv[1]
    arena = go.Arena(pin="none")
    w = torch.empty(16 << 20)  # 64 MiB: a save takes long enough to be caught in the middle
    version = 0
    while True:
        w.fill_(float(version))
        go.save(go.snapshot({"w": w}, arena=arena, checksum=True), path)
        if version == 0:
            print("saved", flush=True)
        version += 1
""")


@pytest.mark.timeout(120)
def test_sigkill_in_the_middle_of_a_save_leaves_the_previous_file_loadable(tmp_path, arena):
    path = tmp_path / "w.snap"
    hits = 0
    for attempt in range(5):
        child = subprocess.Popen([sys.executable, "-c", _KILL_CHILD, str(path)], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "saved"
            # Wait until a save is under way (its temporary exists), then kill at once.
            deadline = time.monotonic() + 30
            while not any(".tmp-" in n for n in os.listdir(tmp_path)) and time.monotonic() < deadline:
                time.sleep(0.001)
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.kill()
            child.wait()
        temporaries = [n for n in os.listdir(tmp_path) if ".tmp-" in n]
        hits += bool(temporaries)
        loaded = go.load(path, arena=arena)  # complete and checked, whichever version it is
        w = loaded.tensors()["w"]
        assert w.numel() == 16 << 20 and bool((w == w[0]).all())
        loaded.free()
        del w  # views keep their snapshot's memory alive
        for n in temporaries:
            os.unlink(tmp_path / n)
        if hits >= 2:
            break
    assert hits >= 1, "the kill never landed in the middle of a save"
    assert arena.used_bytes == 0


# -- bad files ----------------------------------------------------------------------------------------------
def _assert_refused(path: Path, arena: go.Arena, match: str) -> None:
    used = arena.used_bytes
    with pytest.raises(go.OffloadError, match=match) as info:
        go.load(path, arena=arena)
    assert str(path) in str(info.value)
    assert arena.used_bytes == used  # the region taken for the data (if any) was given back


def test_missing_file_is_file_not_found(tmp_path, arena):
    with pytest.raises(FileNotFoundError):
        go.load(tmp_path / "nope.snap", arena=arena)


@pytest.mark.parametrize("keep", [0, 5, 8, 20, "header-1", "data-1", "half"])
def test_truncated_files_are_refused(saved, tmp_path, arena, keep):
    path, _ = saved
    raw = path.read_bytes()
    header = 8 + int.from_bytes(raw[:8], "little")
    n = {"header-1": header - 1, "data-1": len(raw) - 1, "half": (header + len(raw)) // 2}.get(keep, keep)
    bad = tmp_path / "bad.snap"
    bad.write_bytes(raw[:n])
    _assert_refused(bad, arena, "truncated|too short")


def test_bytes_appended_are_refused(saved, tmp_path, arena):
    path, _ = saved
    bad = tmp_path / "bad.snap"
    bad.write_bytes(path.read_bytes() + b"\0" * 8)
    _assert_refused(bad, arena, "unexpected bytes after the data")


def test_a_flipped_data_byte_is_caught_by_its_checksum(saved, tmp_path, arena):
    path, _ = saved
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01  # the last byte of the last storage ("big")
    bad = tmp_path / "bad.snap"
    bad.write_bytes(bytes(raw))
    _assert_refused(bad, arena, r"data corrupt: checksum mismatch in 1 of \d+ storages: storage \d+ \(big,")


@pytest.mark.parametrize("what", ["not-json", "not-object", "layout-json", "layout-field", "bad-dtype",
                                  "view-out-of-bounds", "bad-checksum-text"])
def test_corrupt_headers_are_refused(saved, tmp_path, arena, what):
    path, _ = saved
    bad = tmp_path / "bad.snap"
    if what in ("not-json", "not-object"):
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        head = b"{" + b" " * (n - 1) if what == "not-json" else (b"[]" + b" " * (n - 2))
        bad.write_bytes(raw[:8] + head + raw[8 + n:])
        _assert_refused(bad, arena, "not JSON|not an object")
        return

    def edit(meta):
        layout = json.loads(meta["layout"])
        if what == "layout-json":
            meta["layout"] = meta["layout"][:-3]
            return meta
        if what == "layout-field":
            del layout["tensors"][0]["stride"]
        elif what == "bad-dtype":
            layout["tensors"][0]["dtype"] = "float128"
        elif what == "view-out-of-bounds":
            layout["tensors"][0]["offset"] = 10_000
        elif what == "bad-checksum-text":
            layout["storages"][0]["checksum"] = "xyz"
        meta["layout"] = json.dumps(layout)
        return meta

    _rewrite(path, bad, metadata=edit)
    _assert_refused(bad, arena, "corrupt layout")


def test_a_wrong_checksum_in_the_layout_is_caught(saved, tmp_path, arena):
    path, _ = saved

    def edit(meta):
        layout = json.loads(meta["layout"])
        layout["storages"][0]["checksum"] = "0" * 16
        meta["layout"] = json.dumps(layout)
        return meta

    bad = tmp_path / "bad.snap"
    _rewrite(path, bad, metadata=edit)
    _assert_refused(bad, arena, r"checksum mismatch.*storage 0 \(w,")


@pytest.mark.parametrize("change, match", [
    (lambda d: d.pop("storage.2"), "missing storage.2"),
    (lambda d: d.update(extra=torch.zeros(3, dtype=torch.uint8)), "unexpected 'extra'"),
    (lambda d: d.update({"storage.0": d["storage.0"][:-1].clone()}), r"storage.0 \(w\): the file holds U8 \[4289\]"),
    (lambda d: d.update({"storage.0": d["storage.0"].view(torch.int16)}), r"storage.0 \(w\): the file holds I16"),
], ids=["missing", "extra", "size", "dtype"])
def test_tensors_that_do_not_match_the_layout_are_refused(saved, tmp_path, arena, change, match):
    path, _ = saved

    def edit(data):
        change(data)
        return data

    bad = tmp_path / "bad.snap"
    _rewrite(path, bad, tensors=edit)
    _assert_refused(bad, arena, match)


def test_foreign_files_are_refused(tmp_path, arena):
    from safetensors.torch import save_file

    plain = tmp_path / "plain.safetensors"
    save_file({"weight": torch.ones(3)}, str(plain))
    _assert_refused(plain, arena, "not a gpu_offload snapshot")
    pickle = tmp_path / "model.pt"
    torch.save({"weight": torch.ones(3)}, pickle)
    _assert_refused(pickle, arena, "not a safetensors file|truncated|not JSON")
    text = tmp_path / "notes.txt"
    text.write_text("hello, these are not tensors\n")
    _assert_refused(text, arena, "not a safetensors file|truncated|not JSON")
    empty = tmp_path / "empty.snap"
    empty.write_bytes(b"")
    _assert_refused(empty, arena, "too short")


def test_a_newer_format_version_is_refused(saved, tmp_path, arena):
    path, _ = saved
    bad = tmp_path / "bad.snap"
    _rewrite(path, bad, metadata=lambda m: {**m, "format_version": "2"})
    _assert_refused(bad, arena, "format version 2.*newer gpu_offload")
    _rewrite(path, bad, metadata=lambda m: {**m, "format_version": "one"})
    _assert_refused(bad, arena, "format_version 'one' is not a number")


def test_load_into_an_arena_too_small_changes_nothing(saved):
    path, _ = saved
    small = go.Arena(max_bytes=4096, min_slab_bytes=4096)
    with pytest.raises(go.OffloadError, match="arena cap exceeded"):
        go.load(path, arena=small)
    assert small.used_bytes == 0
