"""The GPU path's safety (issue 9): each cuda-marked test reproduces one way the engine could hand out memory
a copy still uses, capture the wrong data, need device memory when the GPU is full, or create a stray
context. The bookkeeping behind them that needs no GPU is tested here on the CPU too.

The GPU tests hold a copy back with torch.cuda._sleep on the stream it waits for, then do what a user's
code would do meanwhile; a missing guard shows up as the sentinel in the data that comes back.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import weakref
from typing import Any

import pytest
import torch

import gpu_offload as go
from conftest import assert_bitwise_equal
from gpu_offload import overlap as _overlap
from gpu_offload import plan as _plan
from gpu_offload._ext import _C

_MIB = 1 << 20
SENTINEL = 12345.0
cuda = pytest.mark.cuda


def _hold_ms(ms: float) -> None:
    """Keeps the current stream busy for about `ms` (a spin kernel; ~2 GHz clock on an H100/H200)."""
    torch.cuda._sleep(int(ms * 2_000_000))


def _floats(mib: int) -> int:
    return mib * _MIB // 4


# -- CPU: the bookkeeping ---------------------------------------------------------------------------------
class FakeEvent:
    def __init__(self, device: int = 0) -> None:
        self.device = device
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_overlap_refuses_gradients(arena):
    model = torch.nn.Linear(4, 4)
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(go.OffloadError, match="overlap=True.*gradients|gradients.*overlap"):
        go.snapshot(model, include_grads=True, overlap=True, arena=arena)
    assert arena.used_bytes == 0
    go.snapshot(model, include_grads=True, arena=arena).free()  # without overlap: fine


def test_overlap_joins_per_stream_and_forgets_only_completed_copies(monkeypatch):
    """One stream's join must not hide a copy from another stream; an entry (and the sources it keeps
    alive) goes only once its copy has completed."""
    joined: list[tuple[int, list[Any]]] = []
    stream = {"now": 1}
    monkeypatch.setattr(_overlap, "_current_stream", lambda device: stream["now"])
    monkeypatch.setattr(_overlap._plan, "join", lambda events: joined.append((stream["now"], list(events))))
    monkeypatch.setattr(_overlap, "_pending", [])
    monkeypatch.setattr(_overlap, "_hook", object())  # no optimizer hook from a test

    source = torch.empty(16)
    alive = weakref.ref(source)
    event = FakeEvent(0)
    _overlap.defer([event], [source])
    del source
    assert alive() is not None  # held by the entry

    _overlap.join()  # stream 1 waits
    _overlap.join()  # stream 1 again: already waiting, nothing new to enqueue
    stream["now"] = 2
    _overlap.join()  # another stream (another thread's step): must wait too
    assert joined == [(1, [event]), (2, [event])]
    assert _overlap.pending() == 1 and alive() is not None

    event.done = True
    stream["now"] = 3
    _overlap.join()  # complete: dropped, nothing to wait for, the source released
    assert joined == [(1, [event]), (2, [event])]
    assert _overlap.pending() == 0 and alive() is None


def test_overlap_entries_do_not_pile_up_without_joins(monkeypatch):
    monkeypatch.setattr(_overlap, "_pending", [])
    monkeypatch.setattr(_overlap, "_hook", object())
    events = [FakeEvent() for _ in range(5)]
    for e in events:
        _overlap.defer([e])
        e.done = True
    assert _overlap.pending() == 1  # each defer drops the completed ones


class _EnqueuingPlan:
    """A device group whose batch is enqueued (an event not yet complete)."""

    def __init__(self, event: FakeEvent) -> None:
        self.event = event
        self.num_copies = 1

    def run(self, *args: Any) -> FakeEvent:
        return self.event


class _FailingPlan:
    num_copies = 1

    def run(self, *args: Any) -> None:
        raise go.OffloadError("injected: the second device refused the batch")


def test_a_failure_on_a_later_device_carries_the_earlier_devices_events():
    first = FakeEvent()
    plans = _plan.CopyPlans([(-1, _EnqueuingPlan(first)), (-1, _FailingPlan())])
    with pytest.raises(go.OffloadError, match="injected") as info:
        plans.run(True, 4096)
    assert _plan.enqueued(info.value) == [first]


@pytest.mark.parametrize("op", ["snapshot", "offload"])
def test_region_of_a_failed_multi_device_call_is_freed_only_after_the_enqueued_copies(arena, monkeypatch, op):
    state = {"w": torch.randn(1000)}
    first = FakeEvent()

    def copies(self: Any, host_offsets: Any = None) -> _plan.CopyPlans:
        return _plan.CopyPlans([(-1, _EnqueuingPlan(first)), (-1, _FailingPlan())])

    monkeypatch.setattr(_plan.TargetPlan, "copies", copies)
    with pytest.raises(go.OffloadError, match="injected"):
        getattr(go, op)(state, arena=arena)
    assert arena.used_bytes > 0  # the first device's copy still uses the region
    first.done = True
    assert arena.used_bytes == 0
    assert not go.is_offloaded(state)


# -- GPU: one scenario per defect -------------------------------------------------------------------------
@cuda
def test_1_offload_under_a_side_stream_keeps_the_block_from_the_allocating_stream(arena):
    """The model lives on the default stream; offload runs under a side stream. The allocator hands a
    freed block back to the stream that allocated it, which does not wait for the copy."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    model = {"w": torch.randn(_floats(64), device="cuda")}  # allocated on the default stream
    expected = model["w"].clone()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        _hold_ms(300)  # the offload's copy waits for this
        go.offload(model, arena=arena, empty_cache=False)
    # Back on the default stream, which waits for nothing: a block of the same size, filled at once.
    junk = torch.empty(_floats(64), device="cuda").fill_(SENTINEL)
    go.reload(model)
    torch.cuda.synchronize()
    assert_bitwise_equal(model["w"], expected)
    del junk


@cuda
def test_2_overlapped_snapshot_keeps_its_sources_until_the_copy_has_read_them(arena):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    w = torch.randn(_floats(64), device="cuda")
    expected = w.cpu()
    _hold_ms(300)  # the snapshot's copy waits for this
    snap = go.snapshot({"w": w}, overlap=True, arena=arena)
    del w  # the only reference: its block must not go to the next allocation before the copy read it
    junk = torch.empty(_floats(64), device="cuda").fill_(SENTINEL)
    snap.wait()
    assert_bitwise_equal(snap.tensors()["w"], expected)
    snap.free()
    del junk
    torch.cuda.synchronize()
    go.join()
    assert _overlap.pending() == 0  # complete: forgotten, its source released


@cuda
def test_3_failing_swap_waits_for_the_reload_before_offloading_again():
    """offload([model, opt]) shares one region; swap(out, model) reloads the model, then the arena cap
    rejects `out`, and the fallback offloads the model again: it must read the reloaded data, not the
    sentinel the cached blocks held before the (held back) host-to-device copy arrived."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    n = _floats(32)
    model = {"a": torch.randn(n, device="cuda"), "b": torch.randn(n, device="cuda")}
    opt = {"m": torch.randn(n, device="cuda")}
    out = {f"o{i}": torch.randn(n, device="cuda") for i in range(3)}
    expected = {k: v.clone() for k, v in {**model, **opt}.items()}
    # 96 MiB region for model+opt; the cap leaves room for the model again (64) but not for `out` (96).
    arena = go.Arena(max_bytes=176 * _MIB, min_slab_bytes=2 * _MIB)
    go.offload([model, opt], arena=arena)
    junk = [torch.empty(n, device="cuda").fill_(SENTINEL) for _ in range(2)]
    del junk  # cached blocks of the model's size, holding the sentinel: what the reload gets
    with torch.cuda.stream(_plan.copy_stream(0, to_host=False)):
        _hold_ms(300)  # the reload's copies wait; the offload's (other direction) would not
    with pytest.raises(go.OffloadError):
        go.swap(out, model, arena=arena)
    assert go.is_offloaded(model) and go.is_offloaded(opt) and not go.is_offloaded(out)
    go.reload(model)
    go.reload(opt)
    torch.cuda.synchronize()
    for k, v in {**model, **opt}.items():
        assert_bitwise_equal(v, expected[k])
    assert arena.used_bytes == 0


@cuda
def test_4_a_join_on_one_stream_does_not_release_another(arena):
    """Two threads, two streams: the first thread's join (its optimizer step) must not hide the copy from
    the second, which then writes the weights in place."""
    torch.cuda.synchronize()
    w = torch.randn(_floats(64), device="cuda")
    expected = w.cpu()
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    _hold_ms(300)
    snap = go.snapshot({"w": w}, overlap=True, arena=arena)

    def step(stream: torch.cuda.Stream, write: bool) -> None:
        with torch.cuda.stream(stream):
            go.join()
            if write:
                w.fill_(SENTINEL)  # an in-place update after its own join

    for stream, write in ((a, False), (b, True)):
        t = threading.Thread(target=step, args=(stream, write))
        t.start()
        t.join()
    snap.wait()
    assert_bitwise_equal(snap.tensors()["w"], expected)
    snap.free()
    torch.cuda.synchronize()


@cuda
@pytest.mark.parametrize("op", ["snapshot", "offload"])
def test_5_failure_on_a_second_device_frees_the_region_only_after_the_first(arena, monkeypatch, op):
    """A plan with a second group on a device that does not exist: device 0's batch is enqueued (and held
    back), then the second fails. The region must stay taken until device 0's copy has finished."""
    torch.cuda.synchronize()
    state = {"w": torch.randn(_floats(64), device="cuda")}
    expected = state["w"].clone()
    real = _plan.TargetPlan.copies
    missing = torch.cuda.device_count()

    def copies(self: Any, host_offsets: Any = None) -> _plan.CopyPlans:
        plans = real(self, host_offsets)
        return _plan.CopyPlans(plans.groups + [(missing, _C.CopyPlan(missing, [4096], [0], [16]))])

    monkeypatch.setattr(_plan.TargetPlan, "copies", copies)
    _hold_ms(300)
    with pytest.raises(Exception):
        getattr(go, op)(state, arena=arena)
    assert arena.used_bytes > 0  # device 0's copy is still held back and still uses the region
    torch.cuda.synchronize()
    assert arena.used_bytes == 0
    assert not go.is_offloaded(state)
    assert_bitwise_equal(state["w"], expected)


_PARTIAL_BATCH = r"""
import sys, torch, gpu_offload as go
from gpu_offload._ext import _C
arena = go.Arena(min_slab_bytes=4 << 20)
region = arena._allocate(2 << 20)
small = torch.arange(256, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
# The small storage goes through the gather kernel; the large one's device address is bogus, so the copy
# engines refuse it after the kernel was enqueued.
plan = _C.CopyPlan(0, [small.data_ptr(), 4096], [0, 1 << 20], [256, 1 << 20], 4096)
assert plan.num_kernel_copies == 1
torch.cuda._sleep(600_000_000)  # the kernel waits for this
try:
    plan.run(True, region.ptr, torch.cuda.current_stream().cuda_stream, [], True)
except Exception as exc:
    print("raised:", type(exc).__name__, exc)
else:
    print("the bogus copy was not refused at enqueue time: cannot test here")
    sys.exit(3)
# No synchronize: what was enqueued must have finished before the error reached the caller (who frees
# the region on an error).
host = torch.frombuffer(region.buffer(None), dtype=torch.uint8, count=256).clone()
ok = torch.equal(host, torch.arange(256, dtype=torch.uint8))
print("enqueued part finished before the error:", ok)
sys.exit(0 if ok else 1)
"""


@cuda
def test_5_a_partly_enqueued_batch_has_finished_when_the_error_is_raised():
    # In a subprocess: a refused copy must not leave the test session's CUDA context in doubt.
    proc = subprocess.run([sys.executable, "-c", _PARTIAL_BATCH], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "GPU_OFFLOAD_GATHER_MAX_BYTES": "4096"})
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _fill_device() -> list[torch.Tensor]:
    """Takes (nearly) every free byte of the current GPU through torch."""
    blocks: list[torch.Tensor] = []
    for size in (1 << 30, 64 << 20, 2 << 20):
        while True:
            try:
                blocks.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                break
    return blocks


def _trim_default_mem_pool() -> None:
    """Returns what the device's default stream-ordered pool holds to the driver (best effort)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return
    pool = ctypes.c_void_p()
    if lib.cuDeviceGetDefaultMemPool(ctypes.byref(pool), torch.cuda.current_device()) == 0:
        lib.cuMemPoolTrimTo(pool, ctypes.c_size_t(0))


@cuda
def test_6_gather_and_checksum_need_no_device_memory(arena, monkeypatch):
    """People offload when the GPU is full: the gather kernel's chunk table and the checksum's tables must
    not be allocated on the device (they were: cudaMallocAsync and cudaMalloc)."""
    monkeypatch.setenv("GPU_OFFLOAD_GATHER_MAX_BYTES", str(1 << 20))
    sizes = [17, 4096, 65537, 1 << 20, 3 << 20]
    state = {f"t{i}": torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda") for i, n in enumerate(sizes)}
    expected = {k: v.cpu() for k, v in state.items()}
    go.snapshot(state, arena=arena, checksum=True).verify().free()  # warm: streams, arena slab, tables
    torch.cuda.synchronize()
    _trim_default_mem_pool()  # memory a stream-ordered allocation kept would hide the old code's allocation
    free_before = torch.cuda.mem_get_info()[0]
    fill = _fill_device()
    try:
        assert torch.cuda.mem_get_info()[0] < 64 * _MIB
        snap = go.snapshot(state, arena=arena, checksum=True)
        snap.verify()
        for k in state:
            assert_bitwise_equal(snap.tensors()[k], expected[k])
        for v in state.values():
            v.zero_()
        go.restore(state, snap, verify=True)  # scatter kernel, then the checksum kernel on the device
        for k in state:
            assert_bitwise_equal(state[k], expected[k])
        snap.free()
    finally:
        del fill
        torch.cuda.empty_cache()
    torch.cuda.synchronize()
    assert torch.cuda.mem_get_info()[0] >= free_before - 64 * _MIB


def _libcuda() -> Any:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        pytest.skip("libcuda.so.1 cannot be loaded")


def _current_context(lib: Any) -> int:
    ctx = ctypes.c_void_p()
    assert lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0
    return ctx.value or 0


@cuda
def test_7_engine_leaves_a_fresh_thread_without_a_current_device(arena):
    """A copy (and the first pinning) from a fresh thread that has no current device: afterwards it still
    has none (restoring "device 0", as cudaGetDevice reports it, creates a context on GPU 0 in a rank
    that works on another GPU)."""
    lib = _libcuda()
    w = torch.randn(_floats(4), device="cuda:0")
    torch.cuda.synchronize()
    seen: dict[str, Any] = {}

    def body() -> None:
        try:
            seen["before"] = _current_context(lib)
            region = arena._allocate(4 * _MIB)  # the arena's first slab: pinned here
            event = _C.CopyPlan(0, [w.data_ptr()], [0], [4 * _MIB]).run(True, region.ptr, 0, [], False)
            event.synchronize()
            assert event.query()
            del event
            region.release()
            seen["after"] = _current_context(lib)
        except BaseException as exc:  # reported below
            seen["error"] = exc

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert "error" not in seen, seen.get("error")
    assert seen["before"] == 0  # a fresh thread starts without a context
    assert seen["after"] == 0, "the engine left a current context behind in a thread that had none"
    assert arena.pin_mode in ("register", "hostalloc")


_FRESH_THREAD = r"""
import ctypes, json, os, shutil, subprocess, sys, threading
import torch, gpu_offload as go
dev = torch.cuda.device_count() - 1
lib = ctypes.CDLL("libcuda.so.1")

def active(d):
    flags, on = ctypes.c_uint(), ctypes.c_int()
    assert lib.cuDevicePrimaryCtxGetState(d, ctypes.byref(flags), ctypes.byref(on)) == 0
    return bool(on.value)

def used_mib():
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    out = subprocess.run([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30).stdout
    rows = [line.split(",") for line in out.strip().splitlines() if line.strip()]
    mine = [int(m) for p, m in rows if p.strip().isdigit() and int(p) == os.getpid()]
    return sum(mine) if mine else None

model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).to(f"cuda:{dev}")
expected = [p.detach().clone() for p in model.parameters()]
torch.cuda.synchronize(dev)
before = used_mib()
errors = []

def work():
    try:
        go.offload(model, empty_cache=False)
        go.reload(model)
        torch.cuda.synchronize(dev)
    except BaseException as exc:
        errors.append(repr(exc))

t = threading.Thread(target=work)
t.start()
t.join()
after = used_mib()
ok = all(torch.equal(p, e) for p, e in zip(model.parameters(), expected))
print(json.dumps({"device": dev, "errors": errors, "equal": ok, "gpu0_context": active(0),
                  "used_before_mib": before, "used_after_mib": after}))
"""


@cuda
def test_7_offload_reload_from_a_fresh_thread_creates_no_second_context():
    """In a process of its own, on the last GPU: offload/reload from a fresh thread. With two or more GPUs
    no context may appear on GPU 0; on any machine the process's GPU memory (nvidia-smi) must not grow by
    a context's size (~500 MB)."""
    import json

    _libcuda()
    proc = subprocess.run([sys.executable, "-c", _FRESH_THREAD], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not report["errors"] and report["equal"], report
    if report["device"] > 0:
        assert not report["gpu0_context"], f"a context was created on GPU 0: {report}"
    if report["used_before_mib"] is None or report["used_after_mib"] is None:
        if report["device"] == 0:
            pytest.skip(f"nvidia-smi absent or not listing this process; GPU 0 is the only GPU: {report}")
        return
    assert report["used_after_mib"] - report["used_before_mib"] < 256, report


def test_gather_sweep_option_parses_byte_lists():
    import argparse

    from gpu_offload import cli

    assert cli._byte_list("0,65536, 262144,1048576") == (0, 65536, 262144, 1048576)
    assert cli._byte_list("0,64KiB,256KiB,1MiB") == (0, 65536, 262144, 1048576)
    for bad in ("64 apples", "-1", "1,x"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli._byte_list(bad)
