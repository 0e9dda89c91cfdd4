"""The GPU path's safety (issue 9): each cuda-marked test reproduces one way the engine could hand out memory
a copy still uses, capture the wrong data, need device memory when the GPU is full, or create a stray
context. The bookkeeping behind them that needs no GPU is tested here on the CPU too.

The GPU tests hold a copy back with torch.cuda._sleep on the stream it waits for, then do what a user's
code would do meanwhile; a missing guard shows up as the sentinel in the data that comes back.
"""

from __future__ import annotations

import ctypes
import gc
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
    """A device group whose batch is enqueued (an event not yet complete). run_into does what the binding
    does with a device batch's event: appends it to every list it is given before returning."""

    def __init__(self, event: FakeEvent) -> None:
        self.event = event
        self.num_copies = 1

    def run(self, *args: Any) -> FakeEvent:
        return self.event

    def run_into(self, sinks: tuple[list[Any], ...], *args: Any) -> None:
        for sink in sinks:
            sink.append(self.event)


class _FailingPlan:
    num_copies = 1

    def run(self, *args: Any) -> None:
        raise go.OffloadError("injected: the second device refused the batch")

    def run_into(self, sinks: Any, *args: Any) -> None:
        self.run()


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


# -- CPU: interrupts, dropped arenas, graph capture, buffers under overlap (review 3) ----------------------
class _InterruptedAfterEnqueue:
    """A device group whose batch is enqueued and running when CPython raises the interrupt it held while the
    C call ran (Ctrl-C, ray.cancel, a signal-based timeout): as the call returns, dropping its return value.
    The real plan runs first; `event` stands for the running batch's event, which run_into (like the binding)
    has appended to the caller's lists before returning, unless `recorded` is False."""

    def __init__(self, real: Any, event: FakeEvent, recorded: bool = True) -> None:
        self.real, self.event, self.recorded = real, event, recorded
        self.num_copies = real.num_copies

    def run(self, *args: Any) -> Any:
        self.real.run(*args)
        raise KeyboardInterrupt  # the event it returned is lost

    def run_into(self, sinks: tuple[list[Any], ...], *args: Any) -> None:
        self.real.run_into(sinks, *args)
        if self.recorded:
            for sink in sinks:
                sink.append(self.event)
        raise KeyboardInterrupt


def _interrupt(plans: _plan.CopyPlans, event: FakeEvent, recorded: bool = True, device: int = -1) -> _plan.CopyPlans:
    return _plan.CopyPlans([(device, _InterruptedAfterEnqueue(p, event, recorded)) for _, p in plans.groups])


def _interrupt_target_copies(monkeypatch: pytest.MonkeyPatch, event: FakeEvent, **kwargs: Any) -> None:
    real = _plan.TargetPlan.copies
    monkeypatch.setattr(_plan.TargetPlan, "copies",
                        lambda self, host_offsets=None: _interrupt(real(self, host_offsets), event, **kwargs))


@pytest.mark.parametrize("op", ["snapshot", "offload"])
def test_an_interrupt_as_the_enqueue_returns_keeps_the_region_until_the_copy_ends(arena, monkeypatch, op):
    state = {"w": torch.randn(1000)}
    expected = state["w"].clone()
    event = FakeEvent()
    _interrupt_target_copies(monkeypatch, event)
    with pytest.raises(KeyboardInterrupt):
        getattr(go, op)(state, arena=arena)
    assert arena.used_bytes > 0, "the region was freed while the interrupted copy still writes it"
    event.done = True
    assert arena.used_bytes == 0
    assert not go.is_offloaded(state)
    assert_bitwise_equal(state["w"], expected)


def test_an_interrupted_restore_keeps_the_snapshot_region_until_its_copy_ends(arena, monkeypatch):
    state = {"w": torch.randn(1000)}
    snap = go.snapshot(state, arena=arena)
    event = FakeEvent()
    _interrupt_target_copies(monkeypatch, event)
    with pytest.raises(KeyboardInterrupt):
        go.restore(state, snap)
    snap.free()
    assert arena.used_bytes > 0, "a freed snapshot's region went back while an interrupted restore still reads it"
    event.done = True
    assert arena.used_bytes == 0


def test_an_interrupt_in_the_undo_of_an_offload_keeps_the_region_until_the_refill_ends(arena, monkeypatch):
    from gpu_offload import registry

    state = {"w": torch.randn(1000)}
    expected = state["w"].clone()
    go.snapshot(state, arena=arena).free()  # the target's plan is cached: only the refill below is interrupted
    event = FakeEvent()
    real_build = _plan.build_copies
    monkeypatch.setattr(_plan, "build_copies", lambda entries: _interrupt(real_build(entries), event))

    def failing_guard(target: Any) -> None:
        raise go.OffloadError("injected after the storages were released")

    monkeypatch.setattr(registry, "guard", failing_guard)
    with pytest.raises(KeyboardInterrupt):  # interrupted while putting the target back
        go.offload(state, arena=arena)
    assert arena.used_bytes > 0, "the region went back while the refill of the target still reads it"
    event.done = True
    assert arena.used_bytes == 0
    assert not go.is_offloaded(state)
    assert_bitwise_equal(state["w"], expected)


def test_a_device_batch_interrupted_without_its_event_is_waited_for_before_the_region_goes(arena, monkeypatch):
    """The belt: a device group that raised without leaving an event may have enqueued work; its engine
    streams are synchronized before the error reaches the caller, who then frees the region."""
    state = {"w": torch.randn(1000)}
    synced: list[tuple[int, bool, int]] = []
    monkeypatch.setattr(_plan, "current_stream", lambda device: 0)
    monkeypatch.setattr(_plan, "synchronize_engine",
                        lambda device, to_host: synced.append((device, to_host, arena.used_bytes)))
    _interrupt_target_copies(monkeypatch, FakeEvent(), recorded=False, device=0)
    with pytest.raises(KeyboardInterrupt):
        go.snapshot(state, arena=arena)
    assert [(d, h) for d, h, _ in synced] == [(0, True)]
    assert synced[0][2] > 0  # while the region was still held
    assert arena.used_bytes == 0


def test_an_interrupt_before_the_snapshot_object_exists_leaves_the_region_waiting_for_the_copy(arena, monkeypatch):
    from gpu_offload import api

    event = FakeEvent()
    monkeypatch.setattr(_plan.TargetPlan, "copies",
                        lambda self, host_offsets=None: _plan.CopyPlans([(-1, _EnqueuingPlan(event))]))

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(api, "Snapshot", interrupted)
    with pytest.raises(KeyboardInterrupt):
        go.snapshot({"w": torch.randn(1000)}, arena=arena)
    gc.collect()
    assert arena.used_bytes > 0, "the orphaned region was reused while its copy still writes it"
    event.done = True
    assert arena.used_bytes == 0


def test_an_arena_dropped_with_frees_pending_keeps_its_memory_until_the_copies_end():
    arena = go.Arena(min_slab_bytes=4 * _MIB, pin="none")
    impl = weakref.ref(arena._impl)
    region = arena._allocate(_MIB)
    event = FakeEvent()
    region.release([event])  # freed before its copy ended (snap.free() right after snapshot())
    orphan = arena._allocate(_MIB)
    orphan._pending.append(event)  # dropped unreleased while a copy uses it
    del region, orphan, arena
    gc.collect()
    assert impl() is not None, "the arena's slabs were unpinned and unmapped while a copy still used them"
    go.Arena(min_slab_bytes=4 * _MIB, pin="none").used_bytes  # any arena's next call reaps: still in flight
    assert impl() is not None
    event.done = True
    go.Arena(min_slab_bytes=4 * _MIB, pin="none").used_bytes
    assert impl() is None


class _QueryFails(FakeEvent):
    def query(self) -> bool:
        raise RuntimeError("operation not permitted on an event last recorded in a capturing stream")

    def synchronize(self) -> None:
        raise RuntimeError("operation not permitted on an event last recorded in a capturing stream")


def test_an_event_whose_query_raises_does_not_brick_the_arena(arena):
    region = arena._allocate(_MIB)
    region.release([_QueryFails()])  # kept deferred, not raised
    assert arena.used_bytes > 0
    other = arena._allocate(_MIB)
    other.release()
    arena.stats()
    arena.trim()  # waits for deferred copies: the failing wait is not raised either
    assert arena.used_bytes > 0  # the region it guards stays reserved


def _fake_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if the current CUDA stream were capturing a graph (torch.cuda.graph)."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)


@pytest.mark.parametrize("op", ["snapshot", "restore", "offload", "reload", "swap", "stage", "wait"])
def test_every_entry_refuses_under_cuda_graph_capture(arena, monkeypatch, op):
    from gpu_offload.checkpoint import ArenaStager

    state, other = {"w": torch.randn(64)}, {"v": torch.randn(64)}
    snap = go.snapshot(state, arena=arena)
    go.offload(other, arena=arena)
    used = arena.used_bytes
    calls = {
        "snapshot": lambda: go.snapshot(state, arena=arena),
        "restore": lambda: go.restore(state, snap),
        "offload": lambda: go.offload(state, arena=arena),
        "reload": lambda: go.reload(other),
        "swap": lambda: go.swap(state, other, arena=arena),
        "stage": lambda: ArenaStager(arena).stage(state),
        "wait": lambda: snap.wait(),
    }
    _fake_capture(monkeypatch)
    with pytest.raises(go.OffloadError, match="capturing a CUDA graph"):
        calls[op]()
    monkeypatch.undo()
    assert arena.used_bytes == used and go.is_offloaded(other) and not go.is_offloaded(state)
    go.reload(other)
    snap.free()


def test_join_under_capture_never_makes_the_capturing_stream_wait(monkeypatch):
    """A captured optimizer step: the guard cannot make a capturing stream wait for a copy outside the
    graph (the wait would join the capture, or invalidate it). It passes when the copies completed and
    raises a clear error while they run (the core queries them in relaxed capture mode)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    monkeypatch.setattr(_overlap, "_pending", [])
    monkeypatch.setattr(_overlap._plan, "join", lambda events: pytest.fail("a capturing stream was made to wait"))
    event = FakeEvent()
    _overlap._pending.append(_overlap._Entry([event], []))
    params = [torch.nn.Parameter(torch.zeros(4))]
    params[0].grad = torch.ones(4)
    opt = torch.optim.SGD(params, lr=1.0)
    guard = register_optimizer_step_pre_hook(_overlap._step_pre_hook)  # as the first overlapped snapshot does
    try:
        _fake_capture(monkeypatch)
        with pytest.raises(go.OffloadError, match="under CUDA graph capture"):
            go.join()
        with pytest.raises(go.OffloadError, match="under CUDA graph capture"):
            opt.step()  # the step guard: before the step changes anything
        assert bool((params[0] == 0).all())
        event.done = True
        go.join()  # complete: nothing to wait for, and the capture can go on
        assert _overlap.pending() == 0
        opt.step()
    finally:
        guard.remove()


def test_freeing_under_capture_queries_no_event(arena, monkeypatch):
    class Counting(FakeEvent):
        queries = 0

        def query(self) -> bool:
            Counting.queries += 1
            return self.done

    region = arena._allocate(_MIB)
    event = Counting()
    _fake_capture(monkeypatch)
    region.release([event])
    arena.used_bytes
    assert Counting.queries == 0, "an event was queried in a capturing thread (that ends the capture)"
    monkeypatch.undo()
    assert arena.used_bytes > 0
    event.done = True
    assert arena.used_bytes == 0


def test_the_first_overlapped_snapshot_installs_the_step_guard(monkeypatch):
    # torch 2.13's torch.optim has no `optimizer` attribute: the guard is registered through the submodule.
    monkeypatch.setattr(_overlap, "_pending", [])
    monkeypatch.setattr(_overlap, "_hook", None)
    _overlap.defer([], [])
    assert _overlap._hook is not None
    _overlap._hook.remove()


def _record_runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """(number of storages, whether the current stream waits) of each CopyPlans.run, in order."""
    runs: list[tuple[int, bool]] = []
    real = _plan.CopyPlans.run

    def run(self: _plan.CopyPlans, to_host: bool, host_base: int, *args: Any, **kwargs: Any) -> Any:
        stream_waits = kwargs.get("stream_waits", args[1] if len(args) > 1 else True)
        runs.append((self.num_copies, stream_waits))
        return real(self, to_host, host_base, *args, **kwargs)

    monkeypatch.setattr(_plan.CopyPlans, "run", run)
    return runs


def test_overlap_copies_module_buffers_first_in_a_batch_the_stream_waits_for(arena, monkeypatch):
    """BatchNorm's running statistics and num_batches_tracked change in the forward that overlap runs beside
    the copy: they go first, in a batch of their own that later work waits for; the parameters (and an
    optimizer's state) overlap."""
    bn = torch.nn.BatchNorm1d(8)
    bn(torch.randn(4, 8))
    opt = torch.optim.Adam(bn.parameters())
    bn(torch.randn(4, 8)).sum().backward()
    opt.step()
    runs = _record_runs(monkeypatch)
    snap = go.snapshot([bn, opt], overlap=True, arena=arena)
    # 3 buffers; 2 parameters and their exp_avg, exp_avg_sq and step (6 storages)
    assert runs == [(3, True), (8, False)], runs
    expected = {f"0.{k}": v for k, v in bn.state_dict().items()}
    host = snap.wait().tensors()
    for name, value in expected.items():
        assert_bitwise_equal(host[name], value)
    del host
    snap.free()
    runs.clear()
    go.snapshot(bn, arena=arena).free()  # without overlap: one batch, waited for
    assert runs == [(5, True)]
    runs.clear()
    go.snapshot(torch.nn.Linear(4, 4), overlap=True, arena=arena).free()  # no buffers: one batch
    assert runs == [(2, False)]


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
