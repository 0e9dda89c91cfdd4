"""Snapshots on disk: round trips, the safetensors format, atomic saves (SIGKILL in the middle), and clear
errors for truncated, corrupt, foreign and missing files."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import gpu_offload as go
import conftest
from conftest import assert_bitwise_equal, bits, every_interrupt, random_tensor
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


def _rewrite(src: Path, dst: Path, *, metadata=None, tensors=None, rehash: bool = True) -> None:
    """Writes a safetensors file with the same tensors/metadata as src, except what is given. An edited
    layout gets a matching layout_sha256 (a crafted file, not a damaged one) unless rehash is False."""
    import hashlib

    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        meta = dict(f.metadata())
        data = {k: f.get_tensor(k) for k in f.keys()}
    if metadata is not None:
        meta = metadata(meta)
        if rehash and isinstance(meta.get("layout"), str) and "layout_sha256" in meta:
            meta["layout_sha256"] = hashlib.sha256(meta["layout"].encode()).hexdigest()
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
    assert meta["format"] == "gpu_offload.snapshot" and meta["format_version"] == "2"
    assert meta["layout_sha256"] == hashlib.sha256(meta["layout"].encode()).hexdigest()
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


def _age(path: Path, seconds: float = 3600) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_stale_temporaries_are_removed_and_live_ones_kept(tmp_path, arena):
    import fcntl

    path = tmp_path / "x.snap"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"x.snap.tmp-{dead.pid}-0-5ca1ab1e"
    stale.write_bytes(b"partial")
    _age(stale)
    # A writer in another PID namespace (a container sharing the filesystem): its PID means nothing here,
    # may even be that of a dead process here, but it holds the lock on its temporary.
    foreign = tmp_path / f"x.snap.tmp-{dead.pid}-1-0badf00d"
    foreign.write_bytes(b"partial")
    _age(foreign)
    held = os.open(foreign, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    # Just created, not locked yet (a writer between its open and its flock): too young to judge.
    young = tmp_path / f"x.snap.tmp-{dead.pid}-2-0123abcd"
    young.write_bytes(b"partial")
    try:
        go.save(go.snapshot({"a": torch.zeros(3)}, arena=arena), path)
        assert not stale.exists() and foreign.exists() and young.exists()
    finally:
        os.close(held)
    go.save(go.snapshot({"a": torch.zeros(3)}, arena=arena), path)  # its writer is gone now
    assert not foreign.exists() and young.exists()


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
            # Wait until a save is under way (a temporary of any name exists), then kill at once.
            deadline = time.monotonic() + 30
            while os.listdir(tmp_path) == ["w.snap"] and time.monotonic() < deadline:
                time.sleep(0.001)
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.kill()
            child.wait()
        temporaries = [n for n in os.listdir(tmp_path) if n != "w.snap"]
        hits += bool(temporaries)
        # Only temporaries that the next save recognises (no writer library's own temporary file).
        assert all(n.startswith("w.snap.tmp-") for n in temporaries), temporaries
        loaded = go.load(path, arena=arena)  # complete and checked, whichever version it is
        w = loaded.tensors()["w"]
        assert w.numel() == 16 << 20 and bool((w == w[0]).all())
        loaded.free()
        del w  # views keep their snapshot's memory alive
        for n in temporaries:
            _age(tmp_path / n)
        again = go.load(path, arena=arena)
        go.save(again, path)  # sweeps them: their writer is gone
        again.free()
        assert os.listdir(tmp_path) == ["w.snap"]
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
    _rewrite(path, bad, metadata=lambda m: {**m, "format_version": "3"})
    _assert_refused(bad, arena, "format version 3.*newer gpu_offload")
    _rewrite(path, bad, metadata=lambda m: {**m, "format_version": "one"})
    _assert_refused(bad, arena, "format_version 'one' is not a number")


def test_load_into_an_arena_too_small_changes_nothing(saved):
    path, _ = saved
    small = go.Arena(max_bytes=4096, min_slab_bytes=4096)
    with pytest.raises(go.OffloadError, match="arena cap exceeded"):
        go.load(path, arena=small)
    assert small.used_bytes == 0


# -- the layout is checksummed; crafted and hostile headers ------------------------------------------------
def _header_span(raw: bytes) -> tuple[int, int]:
    return 8, 8 + int.from_bytes(raw[:8], "little")


def test_every_single_bit_flip_in_the_header_is_refused_or_harmless(tmp_path, arena):
    state = {"w": random_tensor((4, 3), torch.float32, torch.device("cpu"), seed=1),
             "v": random_tensor((6,), torch.int16, torch.device("cpu"), seed=2)}
    state["t"] = state["w"][1:].t()
    path = tmp_path / "x.snap"
    with go.snapshot(state, arena=arena) as snap:
        go.save(snap, path)
    raw = path.read_bytes()
    good = go.load(path, arena=arena)
    expected = {k: (v.shape, v.stride(), v.dtype, v.clone()) for k, v in good.tensors().items()}
    good.free()
    begin, end = _header_span(raw)
    bad = tmp_path / "bad.snap"
    accepted = []
    for i in range(begin, end):
        for bit in range(8):
            flipped = bytearray(raw)
            flipped[i] ^= 1 << bit
            bad.write_bytes(bytes(flipped))
            try:
                loaded = go.load(bad, arena=arena)
            except go.OffloadError:
                continue
            got = {k: (v.shape, v.stride(), v.dtype, v.clone()) for k, v in loaded.tensors().items()}
            loaded.free()
            same = got.keys() == expected.keys() and all(
                got[k][:3] == expected[k][:3] and torch.equal(bits(got[k][3]), bits(expected[k][3]))
                for k in got)
            if not same:
                accepted.append((i, bit, raw[i:i + 1]))
    assert not accepted, f"{len(accepted)} header bit flips loaded other tensors: {accepted[:5]}"
    assert arena.used_bytes == 0


def _crafted(path: Path, storages: list[dict], entries: list[list[int]], data: bytes, tensors=()) -> None:
    import hashlib

    layout = json.dumps({"checksum_algorithm": persist.CHECKSUM_ALGORITHM, "checksum_source": "host copy",
                         "tensors": list(tensors), "storages": storages, "shard_info": None})
    meta = {"format": persist.FORMAT, "format_version": "2", "package_version": go.__version__,
            "layout": layout, "layout_sha256": hashlib.sha256(layout.encode()).hexdigest()}
    header = {"__metadata__": meta}
    for i, (s, e) in enumerate(zip(storages, entries)):
        header[f"storage.{i}"] = {"dtype": "U8", "shape": [s["nbytes"]], "data_offsets": e}
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def test_overlapping_storages_are_refused_before_any_memory_is_taken(tmp_path):
    from gpu_offload import integrity

    n = 1 << 20
    data = bytes(range(256)) * (n // 256)
    arena = go.Arena(min_slab_bytes=1 << 20)
    probe = go.snapshot({"x": torch.frombuffer(bytearray(data), dtype=torch.uint8)}, arena=arena)
    checksum = integrity.host_checksums(probe.layout, probe._live().ptr)[0]
    probe.free()
    arena.trim()
    # 64 storages of 1 MiB declared, all at the same 1 MiB of the file: each would check out.
    storages = [{"name": f"s{i}", "nbytes": n, "device": "cpu", "checksum": f"{checksum:016x}"} for i in range(64)]
    bad = tmp_path / "bad.snap"
    _crafted(bad, storages, [[0, n]] * 64, data)
    with pytest.raises(go.OffloadError, match="overlaps"):
        go.load(bad, arena=arena)
    assert arena.capacity_bytes == 0  # nothing was pinned for it
    _crafted(bad, storages[:2], [[0, n], [n + 8, 2 * n + 8]], data + b"\0" * 8 + data)
    with pytest.raises(go.OffloadError, match="gap of 8 bytes"):
        go.load(bad, arena=arena)
    assert arena.capacity_bytes == 0


def test_a_refused_load_does_not_keep_the_slab_it_pinned(saved, tmp_path):
    path, _ = saved
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    bad = tmp_path / "bad.snap"
    bad.write_bytes(bytes(raw))
    arena = go.Arena(min_slab_bytes=1 << 20)
    with pytest.raises(go.OffloadError, match="data corrupt"):
        go.load(bad, arena=arena)
    assert arena.capacity_bytes == 0 and arena.used_bytes == 0


@pytest.mark.parametrize("version", [["1"], None, 1, "1.0", "١"], ids=["list", "null", "int", "float", "arabic-digit"])
def test_a_format_version_of_the_wrong_type_is_refused(saved, tmp_path, arena, version):
    path, _ = saved
    raw = path.read_bytes()
    begin, end = _header_span(raw)
    header = json.loads(raw[begin:end])
    header["__metadata__"]["format_version"] = version
    text = json.dumps(header).encode()
    bad = tmp_path / "bad.snap"
    bad.write_bytes(len(text).to_bytes(8, "little") + text + raw[end:])
    _assert_refused(bad, arena, "format_version")


@pytest.mark.parametrize("what", ["nested-header", "long-int-header", "nested-layout", "long-int-layout"])
def test_hostile_json_is_refused_with_an_offload_error(saved, tmp_path, arena, what):
    path, _ = saved
    raw = path.read_bytes()
    begin, end = _header_span(raw)
    bad = tmp_path / "bad.snap"
    if what.endswith("header"):
        junk = b"[" * 200_000 + b"]" * 200_000 if what == "nested-header" else b"1" + b"0" * 5000
        text = b'{"x":' + junk + b"," + raw[begin + 1:end]
        bad.write_bytes(len(text).to_bytes(8, "little") + text + raw[end:])
        _assert_refused(bad, arena, "not JSON")
        return

    def edit(meta):
        junk = "[" * 200_000 + "]" * 200_000 if what == "nested-layout" else "1" + "0" * 5000
        meta["layout"] = '{"x":' + junk + "," + meta["layout"][1:]
        return meta

    _rewrite(path, bad, metadata=edit)
    _assert_refused(bad, arena, "corrupt layout")


@pytest.mark.parametrize("shape, stride", [([2 ** 70], [0]), ([2 ** 62], [0]), ([2 ** 31, 2 ** 31], [0, 0]),
                                           ([1], [2 ** 64])], ids=["2**70", "2**62-bf16", "product", "stride"])
def test_a_shape_too_large_for_a_tensor_is_refused(saved, tmp_path, arena, shape, stride):
    path, _ = saved  # tensor 0 ("w") is bfloat16: 2**62 elements are 2**63 bytes

    def edit(meta):
        layout = json.loads(meta["layout"])
        layout["tensors"][0].update(shape=shape, stride=stride, offset=0)
        meta["layout"] = json.dumps(layout)
        return meta

    bad = tmp_path / "bad.snap"
    _rewrite(path, bad, metadata=edit)
    _assert_refused(bad, arena, r"corrupt layout.*w: (shape|stride)")


def test_a_load_beside_saves_of_the_same_path_sees_one_whole_version(tmp_path, arena):
    import threading

    path = tmp_path / "x.snap"
    versions = [{"a": torch.full((20_000,), float(v)), "b": torch.full((7,), -float(v))} for v in range(2)]
    snaps = [go.snapshot(s, arena=arena) for s in versions]
    go.save(snaps[0], path)
    stop = threading.Event()
    errors: list[BaseException] = []

    def saver() -> None:
        try:
            i = 0
            while not stop.is_set():
                i += 1
                go.save(snaps[i % 2], path)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=saver)
    thread.start()
    try:
        for _ in range(300):
            loaded = go.load(path, arena=arena)
            a, b = loaded.tensors()["a"], loaded.tensors()["b"]
            assert bool((a == a[0]).all()) and bool((b == -a[0]).all())
            loaded.free()
    finally:
        stop.set()
        thread.join()
    assert not errors
    for s in snaps:
        s.free()


# -- what save refuses to replace, and how it fails ----------------------------------------------------------
def test_save_never_replaces_a_fifo_a_device_or_a_directory(tmp_path, arena):
    snap = go.snapshot({"a": torch.zeros(3)}, arena=arena)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(go.OffloadError, match="FIFO"):
        go.save(snap, fifo)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    link = tmp_path / "null"
    link.symlink_to("/dev/null")
    with pytest.raises(go.OffloadError, match="device"):
        go.save(snap, link)
    assert os.path.islink(link) and stat.S_ISCHR(os.stat("/dev/null").st_mode)
    (tmp_path / "dir").mkdir()
    with pytest.raises(go.OffloadError, match="directory"):
        go.save(snap, tmp_path / "dir")
    assert sorted(os.listdir(tmp_path)) == ["dir", "fifo", "null"]
    snap.free()


def test_a_missing_directory_is_an_os_error(tmp_path, arena):
    with go.snapshot({"a": torch.zeros(3)}, arena=arena) as snap, pytest.raises(FileNotFoundError):
        go.save(snap, tmp_path / "no" / "such" / "x.snap")


def test_disk_full_is_an_os_error_and_leaves_the_previous_file(tmp_path, arena, monkeypatch):
    import errno

    path = tmp_path / "x.snap"
    go.save(go.snapshot({"a": torch.zeros(100_000)}, arena=arena), path)
    before = path.read_bytes()
    real_write = os.write
    written = [0]

    def filling_write(fd, data):
        if written[0] > 100_000:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        n = real_write(fd, data[:50_000])
        written[0] += n
        return n

    monkeypatch.setattr(persist.os, "write", filling_write)
    with go.snapshot({"a": torch.ones(100_000)}, arena=arena) as snap, pytest.raises(OSError) as info:
        go.save(snap, path)
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC and not isinstance(info.value, go.OffloadError)
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["x.snap"]


def test_a_version_1_file_is_still_read(saved, tmp_path, arena):
    path, state = saved

    def to_v1(meta):
        meta = {**meta, "format_version": "1"}
        del meta["layout_sha256"]
        return meta

    old = tmp_path / "old.snap"
    _rewrite(path, old, metadata=to_v1)
    with go.load(old, arena=arena) as loaded:
        assert torch.equal(loaded.tensors()["i64"], state["i64"])
    # ... while a version 2 file without its layout checksum is refused.
    _rewrite(path, old, metadata=lambda m: {k: v for k, v in m.items() if k != "layout_sha256"})
    _assert_refused(old, arena, "layout_sha256")


@pytest.mark.timeout(30)
def test_load_of_a_fifo_or_a_directory_is_refused_without_waiting(tmp_path, arena):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    _assert_refused(fifo, arena, "not a regular file")
    _assert_refused(tmp_path, arena, "not a regular file")


# -- nothing lost: interrupts, users' files, modes, the arena ---------------------------------------------------
def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_an_interrupt_anywhere_in_a_save_leaks_no_descriptor_and_leaves_the_file_whole(tmp_path, arena, monkeypatch):
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # thousands of saves: the syncs are not what is tested
    path = tmp_path / "x.snap"
    snap = go.snapshot({"a": torch.arange(100.0), "b": torch.arange(7)}, arena=arena, checksum=True)
    go.save(snap, path)
    good, fds, users = path.read_bytes(), _open_fds(), snap._region._users

    def check(k: int) -> None:
        where = f"interrupt {k} ({conftest.last_point})"
        assert _open_fds() == fds, f"{where} leaked a file descriptor"
        assert sorted(os.listdir(tmp_path)) == ["x.snap"], f"{where} left a temporary"
        assert path.read_bytes() == good, f"{where}: the file is not whole"
        assert snap._region._users == users, f"{where} kept a user of the snapshot's region"

    assert every_interrupt(lambda: go.save(snap, path), check) > 50
    snap.free()
    assert arena.used_bytes == 0


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_an_interrupt_anywhere_in_a_load_leaks_no_descriptor_and_no_memory(saved, arena):
    path, state = saved
    fds, used = _open_fds(), arena.used_bytes

    def check(k: int) -> None:
        where = f"interrupt {k} ({conftest.last_point})"
        if (_open_fds(), arena.used_bytes) != (fds, used):
            gc.collect()  # (slow: only where something is still held)
        assert _open_fds() == fds, f"{where} leaked a file descriptor"
        assert arena.used_bytes == used, f"{where} kept arena memory"

    assert every_interrupt(lambda: go.load(path, arena=arena).free(), check) > 50
    with go.load(path, arena=arena) as snap:
        for name, t in snap.tensors().items():
            assert_bitwise_equal(t, state[name])


def test_a_save_never_removes_a_users_file_named_like_a_temporary(tmp_path, arena):
    path = tmp_path / "policy"
    users = [tmp_path / n for n in ("policy.tmp-2024-06", "policy.tmp-1-2", "policy.tmp-12-3-abc", "policy.tmp-0-1-deadbeef",
                                    "policy.tmp-12-3-deadbeef.bak")]
    for f in users:
        f.write_bytes(b"the user's own")
        _age(f)
    go.save(go.snapshot({"a": torch.zeros(3)}, arena=arena), path)
    assert all(f.read_bytes() == b"the user's own" for f in users)
    leftover = tmp_path / "policy.tmp-12-3-deadbeef"  # a name save() makes: removed once stale and unlocked
    leftover.write_bytes(b"partial")
    _age(leftover)
    go.save(go.snapshot({"a": torch.zeros(3)}, arena=arena), path)
    assert not leftover.exists() and all(f.exists() for f in users)


def test_saving_over_a_file_keeps_its_mode_and_a_new_file_honours_the_umask(tmp_path, arena):
    path = tmp_path / "x.snap"
    snap = go.snapshot({"a": torch.zeros(3)}, arena=arena)
    old = os.umask(0o077)
    try:
        go.save(snap, path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600  # 0666 less the umask, as open() makes it
        os.umask(0o022)
        go.save(snap, path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600  # the checkpoint it replaced was private: still
        path.chmod(0o640)
        go.save(snap, path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o640
        fresh = tmp_path / "y.snap"
        go.save(snap, fresh)
        assert stat.S_IMODE(fresh.stat().st_mode) == 0o644
    finally:
        os.umask(old)


def test_a_refused_load_gives_back_only_the_slab_it_pinned(tmp_path):
    path = tmp_path / "big.snap"
    with go.snapshot({"w": torch.arange(3 << 18, dtype=torch.float32)}, arena=go.Arena(pin="none")) as snap:
        go.save(snap, path)  # 3 MiB: more than the slab reserved below
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    arena = go.Arena(min_slab_bytes=1 << 20)
    arena.reserve(1 << 20)  # pinned ahead by the user: an empty slab the load cannot use
    reserved = arena.capacity_bytes
    with pytest.raises(go.OffloadError, match="data corrupt"):
        go.load(path, arena=arena)
    assert (arena.capacity_bytes, arena.used_bytes) == (reserved, 0)


def test_a_lone_surrogate_in_the_layout_is_an_offload_error(saved, tmp_path, arena):
    path, _ = saved
    raw = path.read_bytes()
    begin, end = _header_span(raw)
    header = json.loads(raw[begin:end])
    header["__metadata__"]["layout"] += "\ud800"  # valid JSON (an escape), but no UTF-8 text
    text = json.dumps(header).encode()
    bad = tmp_path / "bad.snap"
    bad.write_bytes(len(text).to_bytes(8, "little") + text + raw[end:])
    _assert_refused(bad, arena, "not valid text")
# ------------------------------------------------------------------------------ errors that name the user's path


@pytest.mark.parametrize("write", ["save", "save_state_dict"])
def test_a_missing_directory_names_the_path_given_not_the_temporary(tmp_path, arena, write):
    path = tmp_path / "no" / "such" / "x.snap"
    with go.snapshot({"a": torch.zeros(3)}, arena=arena) as snap, pytest.raises(FileNotFoundError) as info:
        getattr(go, write)(snap, path)
    message = str(info.value)
    assert info.value.filename == str(path) and ".tmp-" not in message, message
    assert f"cannot save to {path}: the directory {tmp_path / 'no' / 'such'} does not exist" in message, message


# ------------------------------------------------------------------------------ progress of long saves and loads


def test_long_saves_and_loads_log_progress_at_info(tmp_path, arena, monkeypatch, caplog):
    import logging

    path = tmp_path / "x.snap"
    state = {f"t{i}": torch.full((64 << 10,), float(i)) for i in range(10)}  # 10 storages of 256 KiB
    with go.snapshot(state, arena=arena) as snap, caplog.at_level(logging.INFO, logger="gpu_offload"):
        go.save(snap, path)  # 2.5 MiB: under the threshold, nothing at INFO
        assert [r for r in caplog.records if r.levelno >= logging.INFO] == []
        monkeypatch.setattr(persist, "_PROGRESS_MIN_BYTES", 1 << 20)
        monkeypatch.setattr(persist, "_PROGRESS_INTERVAL_S", 0.0)
        go.save(snap, path)
        go.load(path, arena=arena).free()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert lines[0] == f"saving {path}: 2.5 MiB", lines
    assert [line.split(": ")[1].split(" ")[0] for line in lines[1:10]] == [f"{p}%" for p in range(10, 100, 10)], lines
    assert lines[10].startswith(f"saved {path}: 2.5 MiB in "), lines
    assert lines[11] == f"loading {path}: 2.5 MiB", lines
    assert lines[-1].startswith(f"loaded and checked {path}: 2.5 MiB in "), lines
    assert len(lines) == 22, lines  # a line per tenth each way, no more


# ------------------------------------------------------------------------------ plain safetensors state dicts


class _TiedLM(torch.nn.Module):
    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.proj = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.lm_head = torch.nn.Linear(8, 32, bias=False)
        self.register_buffer("steps", torch.tensor([3], dtype=torch.int64))
        self.register_buffer("cache", torch.ones(4), persistent=False)  # not part of state_dict()
        if tied:
            self.lm_head.weight = self.embed.weight


def _values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_save_state_dict_loads_with_load_file_and_load_state_dict(tmp_path, arena):
    from safetensors import safe_open
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = _TiedLM(tied=False)
    path = tmp_path / "model.safetensors"
    with go.snapshot(model, arena=arena) as snap:
        go.save_state_dict(snap, path)
    fresh = _TiedLM(tied=False)
    fresh.load_state_dict(load_file(path))  # strict: exactly the model's state_dict() names
    for name, value in _values(model).items():
        assert_bitwise_equal(fresh.state_dict()[name], value)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert "cache" not in f.keys()  # a non-persistent buffer is no part of the state dict
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]  # no temporary left


def test_save_state_dict_writes_tied_weights_once_as_save_model_does(tmp_path, arena):
    from safetensors import safe_open
    from safetensors.torch import load_file, load_model

    torch.manual_seed(0)
    model = _TiedLM(tied=True)
    path = tmp_path / "model.safetensors"
    with go.snapshot(model, arena=arena) as snap:
        go.save_state_dict(snap, path)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "lm_head.weight": "embed.weight"}
        assert "lm_head.weight" not in f.keys() and "embed.weight" in f.keys()
    fresh = _TiedLM(tied=True)
    load_model(fresh, str(path))  # strict, with the aliases of the metadata
    assert_bitwise_equal(fresh.lm_head.weight, model.embed.weight)
    fresh = _TiedLM(tied=True)
    missing, unexpected = fresh.load_state_dict(load_file(path), strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], [])  # the alias, tied to what was loaded
    for name, value in _values(model).items():
        assert_bitwise_equal(fresh.state_dict()[name], value)


def test_save_state_dict_of_views_and_dtypes(tmp_path, arena):
    """A state dict target: every name once with its own values, strided views made contiguous, exact
    aliases written once; the file as safetensors.torch.save_file would write it."""
    from safetensors.torch import load_file

    state = _state(torch.device("cpu"))
    state["alias"] = state["base"]  # the same tensor under a second name
    path = tmp_path / "state.safetensors"
    with go.snapshot(state, arena=arena) as snap:
        go.save_state_dict(snap, path, metadata={"step": 7})
    loaded = load_file(path)
    assert sorted(loaded) == sorted(k for k in state if k != "alias")
    for name, value in state.items():
        if name != "alias":
            assert_bitwise_equal(loaded[name], value)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "step": "7", "alias": "base"}


def test_save_state_dict_is_atomic_and_refuses_what_is_no_state_dict(tmp_path, arena, monkeypatch):
    path = tmp_path / "model.safetensors"
    with go.snapshot({"a": torch.zeros(100)}, arena=arena) as snap:
        go.save_state_dict(snap, path)
    before = path.read_bytes()

    def failing_replace(src, dst):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(persist.os, "replace", failing_replace)
    with go.snapshot({"a": torch.ones(100)}, arena=arena) as snap, pytest.raises(OSError, match="injected"):
        go.save_state_dict(snap, path)
    monkeypatch.undo()
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    with go.snapshot({"c": torch.zeros(2, dtype=torch.complex128)}, arena=arena) as snap, \
            pytest.raises(go.OffloadError, match="c is torch.complex128, which safetensors cannot store"):
        go.save_state_dict(snap, path)
    snap = go.snapshot({"a": torch.zeros(2)}, arena=arena)
    snap.free()
    with pytest.raises(go.OffloadError, match="freed"):
        go.save_state_dict(snap, path)
    assert path.read_bytes() == before


def test_save_state_dict_loads_into_a_fresh_hugging_face_model(tmp_path, arena):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install "
                                       "'gpu-offload[test]' brings it)")
    from safetensors.torch import load_file

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with go.snapshot(model, arena=arena) as snap:  # the module, as a training loop snapshots it
        go.save_state_dict(snap, tmp_path / "model.safetensors")
    model.config.save_pretrained(tmp_path)
    want = _values(model)
    # load_file + load_state_dict into a fresh model: only the tied lm_head.weight is not in the file.
    fresh = transformers.LlamaForCausalLM(config)
    missing, unexpected = fresh.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], [])
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    for name, value in want.items():
        assert_bitwise_equal(fresh.state_dict()[name], value)
    # from_pretrained of the directory: the same values, the weights still tied.
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for name, value in want.items():
        assert_bitwise_equal(loaded.state_dict()[name], value)


@pytest.mark.parametrize("what", ["module", "state_dict", "none"])
@pytest.mark.parametrize("op", ["save", "save_state_dict"])
def test_saving_something_other_than_a_snapshot_says_what_to_pass(tmp_path, what, op):
    model = torch.nn.Linear(2, 2)
    given = {"module": model, "state_dict": model.state_dict(), "none": None}[what]
    with pytest.raises(TypeError, match=rf"gpu_offload\.{op}\(\) takes a Snapshot, not \w+: "
                                        rf"gpu_offload\.{op}\(gpu_offload\.snapshot\(target\), path\)"):
        getattr(go, op)(given, tmp_path / "x.safetensors")
    assert not list(tmp_path.iterdir())
