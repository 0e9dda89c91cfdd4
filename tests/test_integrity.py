"""Checksums: the algorithm (host and GPU agree with a reference), snapshot(checksum=True), Snapshot.verify()
and restore(verify=True) catching a flipped byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpu_offload as go
from conftest import _cuda_ok, assert_bitwise_equal, random_tensor
from cuda_gates import hold, warm
from gpu_offload import plan as _plan
from gpu_offload._ext import _C

_P, _M, _L = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def reference(data: bytes) -> int:
    """The checksum as specified (csrc/core/checksum.hpp), in numpy: little-endian words, zero-padded."""
    n = len(data)
    words = np.frombuffer(data + b"\0" * (-n % 8), dtype="<u8")
    index = np.arange(len(words), dtype=np.uint64)
    terms = (words ^ (index * np.uint64(_P))) * np.uint64(_M)
    total = int(terms.sum(dtype=np.uint64)) if len(words) else 0
    return total ^ (n * _L % (1 << 64))


def storage_bytes(t: torch.Tensor) -> bytes:
    """All the bytes of the tensor's storage (not only its view)."""
    whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    return whole.cpu().numpy().tobytes()


def _state(device: torch.device) -> dict[str, torch.Tensor]:
    base = random_tensor((1000,), torch.float32, device, seed=1)
    return {
        "w": random_tensor((33, 17), torch.bfloat16, device, seed=2),
        "base": base,
        "view": base[10:20],  # shares base's storage
        "odd": random_tensor((7,), torch.uint8, device, seed=3),  # 7 bytes: a zero-padded tail word
        "empty": torch.empty(0, device=device),
    }


def test_host_checksum_matches_the_reference_for_odd_sizes_and_alignments():
    rng = np.random.default_rng(0)
    backing = rng.integers(0, 256, size=(9 << 20) + 64, dtype=np.uint8)
    base = backing.ctypes.data
    cases = [(0, 0), (0, 1), (3, 7), (1, 8), (5, 9), (0, 4096), (7, 12345), (16, 5 << 20), (1, (9 << 20) - 3)]
    sums = _C.checksum_host([base + off for off, _ in cases], [n for _, n in cases])
    for (off, n), value in zip(cases, sums):
        assert value == reference(backing[off:off + n].tobytes()), (off, n)
    assert reference(b"\x01") == _M ^ _L  # a pinned value, so the reference cannot drift with the code


def test_a_flipped_bit_or_swapped_words_change_the_checksum():
    data = bytearray(np.random.default_rng(1).integers(0, 256, 256, dtype=np.uint8).tobytes())
    h = reference(bytes(data))
    for pos in (0, 7, 8, 100, 255):
        data[pos] ^= 0x10
        assert reference(bytes(data)) != h
        data[pos] ^= 0x10
    swapped = data[8:16] + data[0:8] + data[16:]
    assert reference(bytes(swapped)) != h


def test_snapshot_records_the_source_checksums(device, arena):
    state = _state(device)
    snap = go.snapshot(state, arena=arena, checksum=True)
    assert snap.checksums is not None and len(snap.checksums) == snap.num_storages == 4
    expected = {}
    for name in ("w", "base", "odd", "empty"):
        expected[name] = reference(storage_bytes(state[name]))
    by_storage_name = {s.name: c for s, c in zip(snap.layout.storages, snap.checksums)}
    assert by_storage_name == expected
    snap.verify()
    plain = go.snapshot(state, arena=arena)
    assert plain.checksums is None
    with pytest.raises(go.OffloadError, match="no checksums"):
        plain.verify()


@pytest.mark.parametrize("where", ["first", "last", "middle"])
def test_verify_catches_one_flipped_byte_and_names_the_storage(device, arena, where):
    state = _state(device)
    snap = go.snapshot(state, arena=arena, checksum=True)
    host = snap.tensors()
    raw = host["odd"].view(torch.uint8).reshape(-1)
    i = {"first": 0, "last": raw.numel() - 1, "middle": 3}[where]
    raw[i] ^= 0x01
    with pytest.raises(go.OffloadError, match=r"storage 2 \(odd, 7 bytes.*expected 0x[0-9a-f]{16}, got 0x"):
        snap.verify()
    raw[i] ^= 0x01
    snap.verify()
    # A flip in a large storage is seen too, and reported with how many storages differ.
    big = host["base"].view(torch.uint8)
    big[2345] ^= 0x80
    host["w"].view(torch.uint8).reshape(-1)[0] ^= 0x04
    with pytest.raises(go.OffloadError, match=r"mismatch in 2 of 4 storages: storage 0 \(w,.*storage 1 \(base,"):
        snap.verify()


def test_restore_verify_refuses_a_corrupt_host_copy_before_anything_moves(device, arena):
    state = _state(device)
    snap = go.snapshot(state, arena=arena, checksum=True)
    for t in state.values():
        if t.numel():
            t.reshape(-1).view(torch.uint8).fill_(0)
    before = {k: v.clone() for k, v in state.items()}
    snap.tensors()["w"].view(torch.uint8).reshape(-1)[10] ^= 0xFF
    with pytest.raises(go.OffloadError, match=r"host copy is corrupt.*\(w,"):
        go.restore(state, snap, verify=True)
    for k in state:
        assert_bitwise_equal(state[k], before[k])
    snap.tensors()["w"].view(torch.uint8).reshape(-1)[10] ^= 0xFF
    go.restore(state, snap, verify=True)


def test_restore_verify_checks_the_restored_data(device, arena, monkeypatch):
    state = _state(device)
    expected = {k: v.clone() for k, v in state.items()}
    snap = go.snapshot(state, arena=arena, checksum=True)
    original = _plan.CopyPlans.run

    def corrupting_run(self, to_host, *args, **kwargs):  # a copy that damages what it writes
        events = original(self, to_host, *args, **kwargs)
        if not to_host:
            state["base"].view(torch.uint8)[5] ^= 0x20
        return events

    monkeypatch.setattr(_plan.CopyPlans, "run", corrupting_run)
    with pytest.raises(go.OffloadError, match=r"restored data differs.*storage 1 \(base,"):
        go.restore(state, snap, verify=True)
    monkeypatch.setattr(_plan.CopyPlans, "run", original)
    go.restore(state, snap, verify=True)
    for k in state:
        assert_bitwise_equal(state[k], expected[k])


def test_restore_verify_onto_a_twin_with_storages_in_another_order(device, arena):
    state = _state(device)
    snap = go.snapshot(state, arena=arena, checksum=True)
    twin_base = torch.zeros(1000, device=device)
    twin = {"odd": torch.zeros(7, dtype=torch.uint8, device=device), "empty": torch.empty(0, device=device),
            "view": twin_base[10:20], "w": torch.zeros(33, 17, dtype=torch.bfloat16, device=device), "base": twin_base}
    go.restore(twin, snap, verify=True)
    for k in state:
        assert_bitwise_equal(twin[k], state[k])


def test_restore_verify_needs_checksums(arena):
    state = {"a": torch.ones(4)}
    snap = go.snapshot(state, arena=arena)
    with pytest.raises(go.OffloadError, match="needs a snapshot with checksums"):
        go.restore(state, snap, verify=True)


def test_checksums_of_a_freed_snapshot_and_bad_arguments(arena):
    snap = go.snapshot({"a": torch.ones(4)}, arena=arena, checksum=True)
    snap.free()
    with pytest.raises(go.OffloadError, match="freed"):
        snap.verify()
    with pytest.raises(go.OffloadError, match="differ in length"):
        _C.checksum_host([1, 2], [1])
    with pytest.raises(go.OffloadError, match="null pointer"):
        _C.checksum_host([0], [8])


def test_device_checksum_without_a_gpu_is_a_clear_error():
    if _cuda_ok():
        pytest.skip("a GPU answers: covered by the cuda tests below")
    t = torch.ones(4)
    with pytest.raises(go.OffloadError, match="CUDA"):
        _C.checksum_device(0, [t.data_ptr()], [16])


# -- on a GPU: the kernel ---------------------------------------------------------------------------------
@pytest.mark.cuda
def test_kernel_matches_the_host_for_odd_sizes_and_alignments():
    g = torch.Generator().manual_seed(0)
    backing_cpu = torch.randint(0, 256, ((9 << 20) + 4096,), generator=g, dtype=torch.uint8)
    backing = backing_cpu.cuda()
    # Sizes around the kernel's 1 MiB chunks and 16-byte vectors, at 16-, 8- and 1-byte aligned starts.
    cases = [(0, 0), (0, 1), (16, 15), (8, 17), (3, 33), (1, 4096), (0, 1 << 20), (64, (1 << 20) + 1),
             (9, (1 << 20) - 1), (4096, (5 << 20) + 13), (24, 7), (2, 3 << 20)]
    ptrs = [backing.data_ptr() + off for off, _ in cases]
    sizes = [n for _, n in cases]
    stream = torch.cuda.current_stream().cuda_stream
    device_sums = _C.checksum_device(torch.cuda.current_device(), ptrs, sizes, stream)
    host_sums = _C.checksum_host([backing_cpu.data_ptr() + off for off, _ in cases], sizes)
    assert device_sums == host_sums
    for (off, n), value in zip(cases, host_sums):
        assert value == reference(backing_cpu[off:off + n].numpy().tobytes())
    # Many small storages in one launch, and an empty batch.
    many = [(i * 48, 1 + i % 40) for i in range(3000)]
    assert (_C.checksum_device(0, [backing.data_ptr() + o for o, _ in many], [n for _, n in many], stream)
            == _C.checksum_host([backing_cpu.data_ptr() + o for o, _ in many], [n for _, n in many]))
    assert _C.checksum_device(0, [], [], stream) == []


@pytest.mark.cuda
def test_kernel_sums_are_in_stream_order():
    w = torch.zeros(64 << 20, device="cuda")  # 256 MiB
    warm()
    go.snapshot({"x": torch.ones(16, device="cuda")}, checksum=True).wait().free()  # the checksum kernel loaded
    go.default_arena().reserve(256 << 20)
    torch.cuda.synchronize()
    # The current stream held: the fill, the checksum kernel and the copy all wait; a sum or a copy that
    # did not wait for the stream would read the zeros.
    with hold(torch.cuda.current_stream()) as gate:
        w.fill_(1.0)  # enqueued before the snapshot: in its checksums
        snap = go.snapshot({"w": w}, checksum=True)
        w.fill_(2.0)  # after: not
        gate.release()
    expected = reference(torch.ones(64 << 20).numpy().tobytes())
    assert snap.checksums == [expected]
    snap.verify()
    torch.cuda.synchronize()
    go.restore({"w": w}, snap, verify=True)
    assert bool((w == 1.0).all())
    snap.free()


@pytest.mark.cuda
def test_cuda_snapshot_checksums_and_a_flipped_byte():
    state = _state(torch.device("cuda"))
    snap = go.snapshot(state, checksum=True)
    host_sums = go.integrity.host_checksums(snap.layout, snap._live().ptr)
    assert snap.checksums == host_sums
    snap.tensors()["base"].view(torch.uint8)[999] ^= 1
    with pytest.raises(go.OffloadError, match=r"\(base,"):
        snap.verify()
    snap.free()


@pytest.mark.cuda
def test_many_jobs_in_flight_reuse_scratch_safely():
    ts = [torch.full((1 << 18,), float(i), device="cuda") for i in range(8)]
    stream = torch.cuda.current_stream().cuda_stream
    jobs = []
    for i in range(50):  # more jobs than scratch buffers at first; every third dropped unread
        t = ts[i % 8]
        job = _C.checksum_device_async(0, [t.data_ptr()], [t.numel() * 4], stream)
        if i % 3:
            jobs.append((i % 8, job))
        del job
    want = [reference(torch.full((1 << 18,), float(i)).numpy().tobytes()) for i in range(8)]
    assert [job.result()[0] for _, job in jobs] == [want[i] for i, _ in jobs]
    assert all(job.done() for _, job in jobs)
