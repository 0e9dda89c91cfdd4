"""plan.py's device groups and the arena's deferred frees on the simulated driver: events per device,
joins and deferred joins, the events of a failed run, regions given back only after their copies."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

import gpu_offload as go
from gpu_offload import OffloadError, plan
from gpu_offload._ext import _C

from conftest import Storages, pattern, sim

GATHER = 256 << 10
SIZES = [1, 100, 4096, 70000, 300000, 1 << 20, 7]
CUDA_ERROR_OUT_OF_MEMORY = 2


def wait_until(cond, what: str) -> None:
    for _ in range(60000):  # a minute: the simulator's workers are never that slow
        if cond():
            return
        time.sleep(0.001)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def arena() -> go.Arena:
    return go.Arena(min_slab_bytes=8 << 20, pin="register")


def test_two_devices_round_trip_with_an_event_each(user_streams, arena):
    a, b = Storages(0, SIZES, 1), Storages(1, SIZES, 2)
    ra, rb = arena._allocate(a.extent), arena._allocate(b.extent)
    plans = plan.CopyPlans([(0, a.plan(GATHER))])
    plans_b = plan.CopyPlans([(1, b.plan(GATHER))])
    events = plans.run(True, ra.ptr) + plans_b.run(True, rb.ptr)
    assert [e.device for e in events] == [0, 1]
    for e in events:
        e.synchronize()
    assert a.host_is(ra.ptr, 1) and b.host_is(rb.ptr, 2)
    a.clear()
    for e in plans.run(False, ra.ptr):
        e.synchronize()
    assert a.device_is(1)
    assert sim.sticky_error(0) == 0 and sim.sticky_error(1) == 0


def test_the_current_stream_waits_for_the_copy(user_streams, arena):
    s = Storages(0, [1 << 20], 3)
    r = arena._allocate(s.extent)
    plans = plan.CopyPlans([(0, s.plan())])
    spins = sim.spinning_waits()
    held = sim.gate(_C.engine_streams(0)[0])
    (done,) = plans.run(True, r.ptr)  # stream_waits=True: later work on the stream waits for the copy
    sim.enqueue_fill(0, user_streams[0], s.ptrs[0], 0xEE, s.sizes[0])
    time.sleep(0.2)
    assert sim.read(s.ptrs[0], 4) != b"\xee" * 4  # the write is held behind the copy
    sim.release(held)
    done.synchronize()
    assert sim.spinning_waits() == spins  # snap.wait()'s event is blocking-sync: the thread slept
    sim.synchronize()
    assert s.host_is(r.ptr, 3)  # the snapshot is the state as of the call
    assert sim.read(s.ptrs[0], 4) == b"\xee" * 4


def test_without_stream_waits_the_callers_stream_runs_ahead(user_streams, arena):
    s = Storages(0, [1 << 20], 4)
    r = arena._allocate(s.extent)
    held = sim.gate(_C.engine_streams(0)[0])
    (done,) = plan.CopyPlans([(0, s.plan())]).run(True, r.ptr, stream_waits=False)
    sim.enqueue_fill(0, user_streams[0], s.ptrs[0], 0xEE, s.sizes[0])
    wait_until(lambda: sim.read(s.ptrs[0], 4) == b"\xee" * 4, "the caller's stream")
    assert not done.query()
    sim.release(held)
    done.synchronize()


def test_deferred_join_collects_then_joins_at_the_end(user_streams, arena):
    s = Storages(0, [4096, 1 << 20], 5)
    r = arena._allocate(s.extent)
    plans = plan.CopyPlans([(0, s.plan(GATHER))])
    held = sim.gate(_C.engine_streams(0)[0])
    with plan.deferred_join() as events:
        plans.run(True, r.ptr)
        assert len(events) == 1
        # Inside the scope the stream does not wait yet: its own work runs ahead of the held copy.
        sim.enqueue_fill(0, user_streams[0], s.ptrs[0], 0x11, 1)
        wait_until(lambda: sim.read(s.ptrs[0], 1) == b"\x11", "work inside the scope")
        sim.write(s.ptrs[0], pattern(1, 5))
    # The scope's end made the stream wait: this write is held until the copy ran.
    sim.enqueue_fill(0, user_streams[0], s.ptrs[1], 0x22, 16)
    time.sleep(0.2)
    assert sim.read(s.ptrs[1], 16) != b"\x22" * 16
    sim.release(held)
    events[0].synchronize() if events else None
    sim.synchronize()
    assert sim.read(s.ptrs[1], 16) == b"\x22" * 16


def test_a_failed_device_group_carries_the_earlier_groups_events(user_streams, arena):
    a, b = Storages(0, [4096, 8192, 100], 6), Storages(1, [4096, 8192, 100], 7)
    r = arena._allocate(a.extent + b.extent)
    plans = plan.CopyPlans([(0, a.plan()), (1, _C.CopyPlan(1, b.ptrs, [a.extent + o for o in b.offsets], b.sizes, 0))])
    _C.engine_streams(0), _C.engine_streams(1)
    batch = sim.calls("cuMemcpyBatchAsync")
    copies = sim.calls("cuMemcpyAsync")
    # Device 0's batched copy goes through; device 1's is refused, and so is its one-by-one fallback.
    sim.fail("cuMemcpyBatchAsync", 2, CUDA_ERROR_OUT_OF_MEMORY)
    sim.fail("cuMemcpyAsync", 1, CUDA_ERROR_OUT_OF_MEMORY)
    with pytest.raises(OffloadError, match="CUDA_ERROR_OUT_OF_MEMORY") as info:
        plans.run(True, r.ptr)
    assert sim.calls("cuMemcpyBatchAsync") == batch + 2 and sim.calls("cuMemcpyAsync") == copies + 1
    enqueued = plan.enqueued(info.value)
    assert [e.device for e in enqueued] == [0]
    enqueued[0].synchronize()
    assert a.host_is(r.ptr, 6)


def test_a_region_is_reused_only_after_its_copies(user_streams, arena):
    s = Storages(0, [1 << 20], 8)
    r = arena._allocate(s.extent)
    ptr = r.ptr
    held = sim.gate(_C.engine_streams(0)[0])
    events = plan.CopyPlans([(0, s.plan())]).run(True, ptr, stream_waits=False)
    r.release(events)  # the copy still writes it
    assert arena.used_bytes >= s.extent
    other = arena._allocate(s.extent)
    assert other.ptr != ptr  # not handed out again while the held copy may write into it
    sim.release(held)
    events[0].synchronize()
    assert arena.used_bytes == other.nbytes + (-other.nbytes % 256)
    again = arena._allocate(s.extent)
    assert again.ptr == ptr  # best fit gives the same memory back once the copy is done


def test_capturing_stream_is_refused_with_nothing_enqueued(user_streams, arena):
    s = Storages(0, [4096, 70000], 9)
    r = arena._allocate(s.extent)
    plans = plan.CopyPlans([(0, s.plan(GATHER))])
    stream = plan.current_stream(0)
    records = sim.calls("cuEventRecord")
    sim.begin_capture(stream)
    try:
        with pytest.raises(OffloadError, match=r"capturing a CUDA graph: call gpu_offload.join\(\) / snap.wait\(\)"):
            plans.run(True, r.ptr)
        assert sim.calls("cuEventRecord") == records
        assert sim.capture_status(stream) == 1  # still capturing: nothing invalidated it
    finally:
        sim.end_capture(stream)
    for e in plans.run(True, r.ptr):
        e.synchronize()
    assert s.host_is(r.ptr, 9)


def test_engine_synchronize_waits_for_a_lost_event(user_streams, arena):
    s = Storages(0, [4096, 1 << 20], 10)
    r = arena._allocate(s.extent)
    held = sim.gate(_C.engine_streams(0)[0])
    plan.CopyPlans([(0, s.plan(GATHER))]).run(True, r.ptr)  # the event is dropped, as an interrupt would
    done = threading.Event()
    t = threading.Thread(target=lambda: (_C.engine_synchronize(0, True), done.set()))
    t.start()
    time.sleep(0.2)
    assert not done.is_set()
    sim.release(held)
    t.join()
    assert s.host_is(r.ptr, 10)


def test_device_checksums_match_the_host_copy(user_streams, arena):
    s = Storages(0, [0, 5, 4096, 3 << 20, 777], 11)
    stream = plan.current_stream(0)
    held = sim.gate(stream)
    job = _C.checksum_device_async(0, s.ptrs, s.sizes, stream)
    assert not job.done()
    sim.release(held)
    r = arena._allocate(s.extent)
    for e in plan.CopyPlans([(0, s.plan())]).run(True, r.ptr):
        e.synchronize()
    assert job.result() == _C.checksum_host([r.ptr + o for o in s.offsets], s.sizes)
    assert job.done()


def test_build_info_reports_the_simulated_driver():
    d = go.build_info()["cuda_driver"]
    assert d["driver"] and d["driver_source"] == "simulated"
    assert "cuMemcpyBatchAsync" in d["entry_points"] and d["batched_copies"]
    assert {k["device"] for k in d["devices"]} <= {0, 1}
    assert all(k["source"] in ("fatbin", "simulated", "nvrtc", "nvrtc-cache") for k in d["devices"])
    expected = os.environ.get("GPU_OFFLOAD_EXPECT_KERNELS")  # the CI build without a toolkit: nvrtc
    if expected:
        assert d["devices"] and all(k["source"].startswith(expected) for k in d["devices"]), d["devices"]
        assert d["nvrtc_path"] and d["fatbin_architectures"] == ""


def test_pinning_before_any_device_creates_no_context():
    # A fresh process: an arena reserved at start-up, before any tensor, must not create GPU 0's context.
    code = (
        "import gpu_offload as go\n"
        "from gpu_offload._ext import _C\n"
        "a = go.Arena(min_slab_bytes=4 << 20)\n"
        "a.reserve(1 << 20)\n"
        "assert a.pin_mode == 'register', a.pin_mode\n"
        "assert not _C._sim.primary_context_active(0) and not _C._sim.primary_context_active(1)\n"
        "assert _C._sim.calls('cuMemHostRegister') == 0\n"
        "p = _C._sim.mem_alloc(1, 4096)\n"
        "r = a._allocate(4096)\n"
        "for e in _C.CopyPlan(1, [p], [0], [4096], 0).run(True, r.ptr, _C._sim.stream_create(1)), :\n"
        "    e.synchronize()\n"
        "assert _C._sim.calls('cuMemHostRegister') == 1 and _C._sim.host_mapped(r.ptr, 4096)\n"
        "assert not _C._sim.primary_context_active(0)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, GPU_OFFLOAD_SIM="2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize("call", ["stats", "free", "region_bytes", "pin_mode"])
def test_waiting_for_the_arena_lock_lets_other_threads_run(call):
    """A thread that pins a slab holds the arena's lock for as long as the driver takes (seconds for GBs);
    another thread that then calls stats/free/region_bytes/pin_mode waits for that lock without the GIL, so
    every other Python thread runs on. Here the pin is parked in cuMemHostRegister until the test releases
    it; were the GIL held by the waiting thread, this test's own thread could not run until the park timed
    out, and would find the pin no longer parked."""
    sim.mem_alloc(0, 512)  # a device in use: the slab is registered at once, under its context
    impl = _C.HostArena(0, 4 << 20, "register")
    region = impl.allocate(1 << 20)  # the first slab
    gate = sim.block("cuMemHostRegister", 1, 30.0)
    pinning = threading.Thread(target=impl.allocate, args=(8 << 20,))  # a second slab, parked while pinned
    pinning.start()
    wait_until(lambda: sim.parked(gate), "the pin to be parked")
    started = threading.Event()

    def wait_for_the_lock() -> None:
        started.set()
        if call == "free":
            impl.free(region)
        elif call == "region_bytes":
            impl.region_bytes(region)
        elif call == "pin_mode":
            impl.pin_mode
        else:
            impl.stats()

    waiter = threading.Thread(target=wait_for_the_lock)
    waiter.start()
    started.wait()
    time.sleep(0.2)  # the waiter is now blocked on the arena's lock
    parked = sim.parked(gate)
    sim.release(gate)
    pinning.join()
    waiter.join()
    assert parked, "this thread could not run while another one waited for the arena's lock"
