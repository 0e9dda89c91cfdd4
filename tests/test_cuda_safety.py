"""The GPU path's safety (issue 9, review 3): each cuda-marked test reproduces one way the engine could hand
out memory a copy still uses, capture the wrong data, need device memory when the GPU is full, create a
stray context, break a CUDA graph capture or lose a copy to an interrupt. The bookkeeping behind them that
needs no GPU is tested here on the CPU too (and on the simulated driver, tests/sim).

The GPU tests hold a copy back with a gate on the stream it waits for or runs on (cuda_gates.py: a wait on
a pinned word that the test releases, no clock rate assumed), then do what a user's code would do
meanwhile; a missing guard shows up as the sentinel in the data that comes back.
"""

from __future__ import annotations

import copy
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
from cuda_gates import engine_stream, hold, ran, recorded, settle, warm
from gpu_offload import adapters
from gpu_offload import overlap as _overlap
from gpu_offload import plan as _plan
from gpu_offload._ext import _C

_MIB = 1 << 20
SENTINEL = 12345.0
cuda = pytest.mark.cuda


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
    monkeypatch.setattr(_overlap, "_stream_lasts", lambda device: True)  # torch's own streams
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


def test_overlap_joins_an_external_stream_every_time(monkeypatch):
    """An external stream (ExternalStream over another library's) may be destroyed and its handle reused by
    a new one: a join on it is never taken as done for later joins on the same handle."""
    joined: list[list[Any]] = []
    monkeypatch.setattr(_overlap, "_current_stream", lambda device: 0x7F00)
    monkeypatch.setattr(_overlap, "_stream_lasts", lambda device: False)
    monkeypatch.setattr(_overlap._plan, "join", lambda events: joined.append(list(events)))
    monkeypatch.setattr(_overlap, "_pending", [])
    monkeypatch.setattr(_overlap, "_hook", object())
    event = FakeEvent(0)
    _overlap.defer([event])
    _overlap.join()
    _overlap.join()  # the same handle, perhaps a new stream now: it waits again
    assert joined == [[event], [event]]


def test_only_torchs_own_streams_count_as_lasting(monkeypatch):
    class Stream:
        def __init__(self, stream_id: int) -> None:
            self.stream_id = stream_id

    for stream_id, lasts in ((0, True), ((3 << 1) | 1, True), (0x7F0000001230, False)):
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None, s=Stream(stream_id): s)
        assert _overlap._stream_lasts(0) is lasts, stream_id


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
# Each holds a copy back with a gate on the stream it waits for or runs on (cuda_gates.py), does meanwhile
# what a user's code would do, and releases it only after: a missing guard shows up as the sentinel (or
# another snapshot's bytes) in the data that comes back. Nothing depends on a clock rate.


def _ready(arena: go.Arena, num_bytes: int = 0) -> None:
    """Before any gate: the tests' kernels loaded, the engine's streams made and `num_bytes` of the arena
    pinned (nothing that could wait for a held stream happens under the gate)."""
    warm()
    go.snapshot({"w": torch.ones(1024, device="cuda")}, arena=arena).wait().free()
    if num_bytes:
        arena.reserve(num_bytes)
    torch.cuda.synchronize()


def _helper_recorded() -> bool:
    from gpu_offload import torch_ext

    return torch_ext.ext is not None


@cuda
@pytest.mark.parametrize("cached", [False, True], ids=["first-call", "cached-plan"])
def test_1_offload_under_a_side_stream_keeps_the_block_from_the_allocating_stream(arena, cached):
    """The model lives on the default stream; offload runs under a side stream. The allocator hands a
    freed block back to the stream that allocated it, which does not wait for the copy. Cached: the
    offload of a cached plan, whose check holds the storages (the helper records them on the copy stream
    in one pass over those)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    _ready(arena, 64 * _MIB)
    model = {"w": torch.randn(_floats(64), device="cuda")}  # allocated on the default stream
    expected = model["w"].clone()
    if cached:  # the reload allocates on the default stream again, and leaves the plan cached
        go.offload(model, arena=arena, empty_cache=False)
        go.reload(model)
        assert _plan.cached(adapters.named_tensors(model, include_grads=False)) is not None
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with hold(side) as gate:
        with torch.cuda.stream(side):
            go.offload(model, arena=arena, empty_cache=False)  # its copy waits for the held side stream
        # Back on the default stream, which waits for nothing: a block of the same size, filled at once.
        junk = torch.empty(_floats(64), device="cuda").fill_(SENTINEL)
        ran("the sentinel fill on the default stream")
        gate.release()
    go.reload(model)
    torch.cuda.synchronize()
    assert_bitwise_equal(model["w"], expected)
    del junk


@cuda
@pytest.mark.parametrize("cached", [False, True], ids=["first-call", "cached-plan"])
def test_2_overlapped_snapshot_keeps_its_sources_until_the_copy_has_read_them(arena, cached, monkeypatch):
    """Cached: a cached plan's check holds the storages, and that hold is what the bookkeeping keeps."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    _ready(arena, 64 * _MIB)
    w = torch.randn(_floats(64), device="cuda")
    expected = w.cpu()
    target = {"w": w}
    if cached:
        go.snapshot(target, overlap=True, arena=arena).wait().free()
        go.join()
    kept: list[str] = []
    defer = _overlap.defer
    monkeypatch.setattr(_overlap, "defer", lambda events, sources=(): (kept.append(type(sources).__name__),
                                                                         defer(events, sources)))
    torch.cuda.synchronize()
    with hold(engine_stream(0, to_host=True)) as gate:
        snap = go.snapshot(target, overlap=True, arena=arena)  # held: it has read nothing yet
        del w, target  # the only references: the block must not go to the next allocation before the copy read it
        junk = torch.empty(_floats(64), device="cuda").fill_(SENTINEL)
        ran("the sentinel fill")
        gate.release()
    snap.wait()
    assert_bitwise_equal(snap.tensors()["w"], expected)
    snap.free()
    del junk
    torch.cuda.synchronize()
    go.join()
    assert _overlap.pending() == 0  # complete: forgotten, its source released
    assert kept == ["HeldStorages" if cached and _helper_recorded() else "list"]


@cuda
def test_3_failing_swap_waits_for_the_reload_before_offloading_again():
    """offload([model, opt]) shares one region; swap(out, model) reloads the model, then the arena cap
    rejects `out`, and the fallback offloads the model again: it must read the reloaded data, not the
    sentinel the cached blocks held before the (held back) host-to-device copy arrived."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    warm()
    n = _floats(32)
    model = {"a": torch.randn(n, device="cuda"), "b": torch.randn(n, device="cuda")}
    opt = {"m": torch.randn(n, device="cuda")}
    out = {f"o{i}": torch.randn(n, device="cuda") for i in range(3)}
    expected = {k: v.clone() for k, v in {**model, **opt}.items()}
    # 96 MiB region for model+opt; the cap leaves room for the model again (64) but not for `out` (96).
    arena = go.Arena(max_bytes=176 * _MIB, min_slab_bytes=2 * _MIB)
    go.offload([model, opt], arena=arena)
    arena.reserve(64 * _MIB)  # the model's second region, pinned now (not under the gate)
    junk = [torch.empty(n, device="cuda").fill_(SENTINEL) for _ in range(2)]
    del junk  # cached blocks of the model's size, holding the sentinel: what the reload gets
    torch.cuda.synchronize()
    with hold(engine_stream(0, to_host=False)) as gate:  # the reload's copies wait; the offload's would not
        with pytest.raises(go.OffloadError):
            go.swap(out, model, arena=arena)
        assert go.is_offloaded(model) and go.is_offloaded(opt) and not go.is_offloaded(out)
        gate.release()
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
    _ready(arena, 64 * _MIB)
    w = torch.randn(_floats(64), device="cuda")
    expected = w.cpu()
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    written: dict[str, Any] = {}

    def step(stream: torch.cuda.Stream, write: bool) -> None:
        with torch.cuda.stream(stream):
            go.join()
            if write:
                w.fill_(SENTINEL)  # an in-place update after its own join
                written["event"] = recorded(stream)

    with hold(engine_stream(0, to_host=True)) as gate:
        snap = go.snapshot({"w": w}, overlap=True, arena=arena)
        for stream, write in ((a, False), (b, True)):
            t = threading.Thread(target=step, args=(stream, write))
            t.start()
            t.join()
        assert not settle(written["event"]), "the second stream wrote the weights before the held copy read them"
        gate.release()
    snap.wait()
    assert_bitwise_equal(snap.tensors()["w"], expected)
    snap.free()
    torch.cuda.synchronize()


@cuda
@pytest.mark.parametrize("op", ["snapshot", "offload"])
def test_5_failure_on_a_second_device_frees_the_region_only_after_the_first(arena, monkeypatch, op):
    """A plan with a second group on a device that does not exist: device 0's batch is enqueued (and held
    back), then the second fails. The region must stay taken until device 0's copy has finished."""
    _ready(arena, 64 * _MIB)
    state = {"w": torch.randn(_floats(64), device="cuda")}
    expected = state["w"].clone()
    real = _plan.TargetPlan.copies
    missing = torch.cuda.device_count()

    def copies(self: Any, host_offsets: Any = None) -> _plan.CopyPlans:
        plans = real(self, host_offsets)
        return _plan.CopyPlans(plans.groups + [(missing, _C.CopyPlan(missing, [4096], [0], [16]))])

    monkeypatch.setattr(_plan.TargetPlan, "copies", copies)
    torch.cuda.synchronize()
    with hold(engine_stream(0, to_host=True)) as gate:
        with pytest.raises(Exception):
            getattr(go, op)(state, arena=arena)
        assert arena.used_bytes > 0  # device 0's copy is still held back and still uses the region
        gate.release()
    torch.cuda.synchronize()
    assert arena.used_bytes == 0
    assert not go.is_offloaded(state)
    assert_bitwise_equal(state["w"], expected)


_TESTS = os.path.dirname(os.path.abspath(__file__))

_PARTIAL_BATCH = r"""
import sys, torch, gpu_offload as go
sys.path.insert(0, sys.argv[1])
from cuda_gates import hold, warm
from gpu_offload._ext import _C
warm()
arena = go.Arena(min_slab_bytes=4 << 20)
region = arena._allocate(2 << 20)
small = torch.arange(256, dtype=torch.uint8, device="cuda")
# Allocated last, alone in its segment (no expandable segments: the caller's environment is cleared of
# PYTORCH_CUDA_ALLOC_CONF), so that nothing is mapped right after it.
big = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
stream = torch.cuda.Stream()
torch.cuda.synchronize()
# The small storage goes through the gather kernel; the large copy starts 4 KiB before the end of a device
# allocation and runs 1 MiB, past it, so the copy engines refuse it after the kernel was enqueued. (Not a
# bogus address: under unified addressing the driver takes one it does not know for pageable host memory
# and reads it on the host, which killed the process on the H200.)
past_end = big.data_ptr() + big.numel() - 4096
plan = _C.CopyPlan(0, [small.data_ptr(), past_end], [0, 1 << 20], [256, 1 << 20], 4096)
assert plan.num_kernel_copies == 1
gate = hold(stream, timeout_s=60)  # the batch (its kernel) waits for this
gate.open_after(1.0)  # from another thread: the error path below waits for the kernel until then
try:
    plan.run(True, region.ptr, stream.cuda_stream, [], True)
except Exception as exc:
    print("raised:", type(exc).__name__, exc)
else:
    gate.release()
    print("the bogus copy was not refused at enqueue time: cannot test here")
    sys.exit(3)
# No synchronize: what was enqueued must have finished before the error reached the caller (who frees
# the region on an error), so the gate had to be opened first.
released = gate.released
host = torch.frombuffer(region.buffer(None), dtype=torch.uint8, count=256).clone()
ok = released and torch.equal(host, torch.arange(256, dtype=torch.uint8))
print("released before the error:", released, "enqueued part finished before the error:", ok)
gate.release()
sys.exit(0 if ok else 1)
"""


@cuda
def test_5_a_partly_enqueued_batch_has_finished_when_the_error_is_raised():
    # In a subprocess: a refused copy must not leave the test session's CUDA context in doubt.
    proc = subprocess.run([sys.executable, "-c", _PARTIAL_BATCH, _TESTS], capture_output=True, text=True,
                          timeout=180, env={**{k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"},
                                            "GPU_OFFLOAD_GATHER_MAX_BYTES": "4096"})
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _fill_device() -> list[torch.Tensor]:
    """Takes (nearly) every free byte of the current GPU through torch (which leaves up to a segment)."""
    blocks: list[torch.Tensor] = []
    for size in (1 << 30, 64 << 20, 2 << 20):
        while True:
            try:
                blocks.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                break
    return blocks


def _fill_rest_raw(lib: Any) -> list[int]:
    """Takes what torch left with driver allocations (cuMemAlloc), halving down to 4 KiB."""
    alloc = lib.cuMemAlloc_v2
    alloc.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    alloc.restype = ctypes.c_int
    ptrs: list[int] = []
    size = 16 << 20
    while size >= 4096:
        ptr = ctypes.c_uint64()
        if alloc(ctypes.byref(ptr), size) == 0:
            ptrs.append(ptr.value)
        else:
            size //= 2
    return ptrs


def _free_raw(lib: Any, ptrs: list[int]) -> None:
    free = lib.cuMemFree_v2
    free.argtypes = [ctypes.c_uint64]
    for p in ptrs:
        free(p)


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
    not be allocated on the device (they were: cudaMallocAsync and cudaMalloc). The device is filled to
    its last page, so that any allocation of theirs fails."""
    lib = _libcuda()
    monkeypatch.setenv("GPU_OFFLOAD_GATHER_MAX_BYTES", str(1 << 20))
    sizes = [17, 4096, 65537, 1 << 20, 3 << 20]
    state = {f"t{i}": torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda") for i, n in enumerate(sizes)}
    expected = {k: v.cpu() for k, v in state.items()}
    # Warm: streams, arena slab, both directions' chunk tables, the checksum scratch and every kernel
    # used below, so that nothing is first loaded or pinned while the GPU is full.
    warm_snap = go.snapshot(state, arena=arena, checksum=True).verify()
    for v in state.values():
        v.zero_()
    go.restore(state, warm_snap, verify=True)
    warm_snap.free()
    torch.cuda.synchronize()
    _trim_default_mem_pool()  # memory a stream-ordered allocation kept would hide the old code's allocation
    free_before = torch.cuda.mem_get_info()[0]
    fill = _fill_device()
    raw: list[int] = []
    try:
        raw = _fill_rest_raw(lib)
        left = torch.cuda.mem_get_info()[0]
        # Not even 4 KiB more can be allocated now; what the driver still counts as free is a few pages at
        # most (torch alone left up to a 20 MiB segment, enough for the old code's KiB-sized allocations).
        assert left < 8 * _MIB, f"could not fill the device: {left} bytes still free"
        snap = go.snapshot(state, arena=arena, checksum=True)
        snap.verify()
        for k in state:
            assert_bitwise_equal(snap.tensors()[k], expected[k])
        for v in state.values():
            v.zero_()
        go.restore(state, snap, verify=True)  # scatter kernel, then the checksum kernel on the device
        torch.cuda.synchronize()
        snap.free()
    finally:
        _free_raw(lib, raw)
        del fill
        torch.cuda.empty_cache()
    for k in state:
        assert_bitwise_equal(state[k], expected[k])
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


_NO_CONTEXT_BEFORE_CUDA = r"""
import ctypes, json
import torch, gpu_offload as go
from gpu_offload.checkpoint import ArenaStager
lib = ctypes.CDLL("libcuda.so.1")
assert lib.cuInit(0) == 0

def active(d):
    flags, on = ctypes.c_uint(), ctypes.c_int()
    assert lib.cuDevicePrimaryCtxGetState(d, ctypes.byref(flags), ctypes.byref(on)) == 0
    return bool(on.value)

report = {"at_start": active(0)}
arena = go.Arena(min_slab_bytes=4 << 20)
arena.reserve(1 << 20)  # "reserve the arena at start-up"
report["after_reserve"] = active(0)
snap = go.snapshot({"w": torch.arange(1000.0)}, arena=arena)
report["cpu_snapshot_equal"] = torch.equal(snap.tensors()["w"], torch.arange(1000.0))
snap.free()
report["after_cpu_snapshot"] = active(0)
with ArenaStager(arena) as stager:
    staged = stager.stage({"w": torch.arange(10.0)})
    report["staged_equal"] = torch.equal(staged["w"], torch.arange(10.0))
    del staged
report["after_stage"] = active(0)
# Now the first CUDA tensor: the context is made, and the memory pinned before is usable for its copies.
w = torch.randn(1 << 20, device="cuda:0")
snap = go.snapshot({"w": w}, arena=arena).wait()
report["cuda_snapshot_equal"] = torch.equal(snap.tensors()["w"], w.cpu())
report["pin_mode"] = arena.pin_mode
snap.free()
report["after_cuda"] = active(0)
print(json.dumps(report))
"""


@cuda
def test_7_no_context_on_gpu_0_before_the_first_cuda_tensor():
    """In a fresh process: reserving an arena, CPU snapshots and CPU stages create no CUDA context (each
    costs ~500 MB on GPU 0 in every rank). Discriminating on one GPU too."""
    import json

    _libcuda()
    proc = subprocess.run([sys.executable, "-c", _NO_CONTEXT_BEFORE_CUDA], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if report["at_start"]:
        pytest.skip(f"GPU 0's primary context was active before gpu_offload did anything: {report}")
    assert report["cpu_snapshot_equal"] and report["staged_equal"] and report["cuda_snapshot_equal"], report
    assert not report["after_reserve"], f"reserving the arena created GPU 0's context: {report}"
    assert not report["after_cpu_snapshot"], f"a CPU snapshot created GPU 0's context: {report}"
    assert not report["after_stage"], f"a CPU stage created GPU 0's context: {report}"
    assert report["after_cuda"], report


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
    # Defensive: nvidia-smi may be absent, fail, or print [N/A] (MIG, some vGPUs): then unknown (None).
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    mine = []
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0].isdigit() and int(fields[0]) == os.getpid():
            if not fields[1].isdigit():
                return None
            mine.append(int(fields[1]))
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
    no context may appear on GPU 0; where nvidia-smi reports it, the process's GPU memory must not grow by
    a context's size (~500 MB). (On one GPU, test_7_no_context_on_gpu_0_before_the_first_cuda_tensor is the
    check that discriminates.)"""
    import json

    _libcuda()
    proc = subprocess.run([sys.executable, "-c", _FRESH_THREAD], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not report["errors"] and report["equal"], report
    if report["device"] > 0:
        assert not report["gpu0_context"], f"a context was created on GPU 0: {report}"
    if report["used_before_mib"] is not None and report["used_after_mib"] is not None:
        assert report["used_after_mib"] - report["used_before_mib"] < 256, report


# -- GPU: review 3 (interrupts, dropped arenas, graph capture, buffers under overlap) ---------------------
class _Interrupted:
    """A device group whose batch is enqueued and running when CPython raises the interrupt it held while
    the C call ran, as the call returns (dropping what it returned). The real plan runs first."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.num_copies = real.num_copies

    def run(self, *args: Any) -> Any:
        self.real.run(*args)
        raise KeyboardInterrupt

    def run_into(self, sinks: Any, *args: Any) -> None:
        self.real.run_into(sinks, *args)
        raise KeyboardInterrupt


def _interrupt_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _plan.TargetPlan.copies
    monkeypatch.setattr(_plan.TargetPlan, "copies", lambda self, host_offsets=None: _plan.CopyPlans(
        [(d, _Interrupted(p)) for d, p in real(self, host_offsets).groups]))


@cuda
@pytest.mark.parametrize("op", ["snapshot", "offload"])
def test_8_an_interrupted_enqueue_keeps_the_region_until_the_copy_has_written_it(arena, monkeypatch, op):
    """Ctrl-C as the enqueue returns: the device-to-host copy runs (held here), and its region must not go
    to the next snapshot (a CPU one, written at once by the host) before the copy has written it."""
    n = _floats(64)
    _ready(arena, 2 * 64 * _MIB)  # room for the interrupted region and the CPU snapshot, pinned now
    state = {"w": torch.randn(n, device="cuda")}
    expected = state["w"].clone()
    torch.cuda.synchronize()
    _interrupt_copies(monkeypatch)
    with hold(engine_stream(0, to_host=True)) as gate:
        with pytest.raises(KeyboardInterrupt):
            getattr(go, op)(state, arena=arena)
        assert arena.used_bytes > 0, "the region went back while the interrupted copy still writes it"
        monkeypatch.undo()
        cpu = go.snapshot({"c": torch.full((n,), 7.0)}, arena=arena)  # copied by the host, now
        gate.release()
    torch.cuda.synchronize()
    assert bool((cpu.tensors()["c"] == 7.0).all()), "the interrupted copy wrote into another snapshot"
    assert not go.is_offloaded(state)
    assert_bitwise_equal(state["w"], expected)
    cpu.free()
    assert arena.used_bytes == 0


@cuda
def test_8_an_interrupted_restore_keeps_a_freed_snapshot_until_its_copy_has_read_it(arena, monkeypatch):
    n = _floats(64)
    _ready(arena, 2 * 64 * _MIB)
    w = torch.randn(n, device="cuda")
    expected = w.clone()
    snap = go.snapshot({"w": w}, arena=arena).wait()
    w.zero_()
    torch.cuda.synchronize()
    _interrupt_copies(monkeypatch)
    with hold(engine_stream(0, to_host=False)) as gate:
        with pytest.raises(KeyboardInterrupt):
            go.restore({"w": w}, snap)
        snap.free()
        assert arena.used_bytes > 0, "a freed snapshot's region went back while a restore still reads it"
        monkeypatch.undo()
        cpu = go.snapshot({"c": torch.full((n,), 7.0)}, arena=arena)
        gate.release()
    torch.cuda.synchronize()
    assert_bitwise_equal(w, expected)  # the restore read the snapshot, not the CPU snapshot's sevens
    cpu.free()
    assert arena.used_bytes == 0


_DROPPED_ARENA = r"""
import ctypes, gc, json, sys
import torch, gpu_offload as go
sys.path.insert(0, sys.argv[1])
from cuda_gates import engine_stream, hold, warm
lib = ctypes.CDLL("libcuda.so.1")

def pinned(ptr):
    kind = ctypes.c_uint()  # CU_POINTER_ATTRIBUTE_MEMORY_TYPE: fails for memory the driver does not know
    return lib.cuPointerGetAttribute(ctypes.byref(kind), 2, ctypes.c_uint64(ptr)) == 0

warm()
n = 64 << 20
w = torch.randn(n // 4, device="cuda")
expected = w.cpu()
a = go.Arena(min_slab_bytes=n, pin="register")
go.snapshot({"x": torch.ones(16, device="cuda")}, arena=a).wait().free()
a.reserve(n)
torch.cuda.synchronize()
report = {}
gate = hold(engine_stream(0, True), timeout_s=30)
s = go.snapshot({"w": w}, arena=a)  # its copy is held
ptr = s._live().ptr
report["pinned_before"] = pinned(ptr)
s.free()  # freed before its copy ended (snap.free() right after snapshot())
del s, a
gc.collect()
report["pinned_after_drop"] = pinned(ptr)  # the copy has not even started
report["watchdog"] = gate.by_watchdog  # the drop waited for the held copy
gate.open()
torch.cuda.synchronize()
report["usable"] = float((torch.ones(8, device="cuda") * 2).sum().item()) == 16.0
go.Arena(min_slab_bytes=4 << 20).used_bytes  # any arena's next call releases the dropped one
report["pinned_after_reap"] = pinned(ptr)
print(json.dumps(report))
"""


@cuda
def test_8_an_arena_dropped_with_a_copy_in_flight_keeps_its_slab_pinned_until_the_copy_ends():
    """An arena (an ArenaStager's, a local one) collected while a freed region's copy still writes it:
    unpinning and unmapping the slab then corrupts memory or faults the device. In a process of its own."""
    import json

    _libcuda()
    proc = subprocess.run([sys.executable, "-c", _DROPPED_ARENA, _TESTS], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["pinned_before"], report
    assert not report["watchdog"], f"dropping the arena waited for the held copy: {report}"
    assert report["pinned_after_drop"], f"the dropped arena unpinned its slab under a copy: {report}"
    assert report["usable"], report
    assert not report["pinned_after_reap"], f"the dropped arena's slab was never released: {report}"


def _capture_entries(arena: go.Arena) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, torch.Tensor],
                                               go.Snapshot]:
    from gpu_offload.checkpoint import ArenaStager

    state = {"w": torch.randn(4096, device="cuda")}
    other = {"v": torch.randn(4096, device="cuda")}
    snap = go.snapshot(state, arena=arena).wait()
    go.offload(other, arena=arena)
    stager = ArenaStager(arena)
    calls = {
        "snapshot": lambda: go.snapshot(state, arena=arena),
        "restore": lambda: go.restore(state, snap),
        "offload": lambda: go.offload(state, arena=arena),
        "reload": lambda: go.reload(other),
        "swap": lambda: go.swap(state, other, arena=arena),
        "stage": lambda: stager.stage(state),
        "wait": lambda: snap.wait(),
        "done": lambda: snap.done(),
    }
    return calls, state, other, snap


@cuda
@pytest.mark.parametrize("op", ["snapshot", "restore", "offload", "reload", "swap", "stage", "wait", "done"])
def test_9_every_entry_refuses_under_cuda_graph_capture_and_the_capture_stays_valid(arena, op):
    _ready(arena)
    calls, state, other, snap = _capture_entries(arena)
    expected = {k: v.clone() for k, v in state.items()}
    y = torch.zeros(16, device="cuda")
    torch.cuda.synchronize()
    used = arena.used_bytes
    g = torch.cuda.CUDAGraph()
    # torch.cuda.graph ends the capture on the way out: an invalidated capture raises a CUDA error there
    # instead of ours.
    with pytest.raises(go.OffloadError, match="capturing a CUDA graph"):
        with torch.cuda.graph(g):
            y.add_(1.0)
            calls[op]()
    g.replay()
    torch.cuda.synchronize()
    assert bool((y == 1.0).all()), "the captured graph does not replay"
    # Nothing moved, and the arena and the engine work as before.
    assert arena.used_bytes == used and go.is_offloaded(other) and not go.is_offloaded(state)
    go.reload(other)
    for v in state.values():
        v.zero_()
    go.restore(state, snap)
    torch.cuda.synchronize()
    for k in state:
        assert_bitwise_equal(state[k], expected[k])
    snap.free()


def _capturable_adam() -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    params = [torch.nn.Parameter(torch.randn(1 << 20, device="cuda")) for _ in range(2)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.Adam(params, lr=0.1, capturable=True)
    side = torch.cuda.Stream()  # warm up outside the default stream, as a capture needs
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    return params, opt


@cuda
def test_9_a_captured_optimizer_step_refuses_an_overlapped_copy_in_flight_and_captures_once_it_ended(arena):
    """The step guard (gpu_offload.join) of a captured optimizer step: a capturing stream cannot wait for a
    copy outside the graph. While the copy runs (held) it refuses clearly and the capture stays valid; once
    it has ended, the step is captured and replays like an eager one."""
    _ready(arena, 16 * _MIB)
    params, opt = _capturable_adam()
    before = [p.detach().clone() for p in params]
    side = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with hold(engine_stream(0, to_host=True)) as gate:
        snap = go.snapshot(params, overlap=True, arena=arena)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            g.capture_begin()  # no device-wide synchronize here (torch.cuda.graph's entry has one)
            try:
                with pytest.raises(go.OffloadError, match="under CUDA graph capture"):
                    opt.step()
            finally:
                g.capture_end()  # raises if the capture was invalidated
        gate.release()
    torch.cuda.current_stream().wait_stream(side)
    for host, value in zip(snap.wait().tensors().values(), before):
        assert_bitwise_equal(host, value.cpu())
    go.join()
    torch.cuda.synchronize()
    # The reference: the same step, eagerly, on copies.
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for r, p in zip(ref_params, params):
        r.grad = p.grad.clone()
    ref = torch.optim.Adam(ref_params, lr=0.1, capturable=True)
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))  # its own state: load_state_dict does not copy
    ref.step()
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        opt.step()
    g2.replay()
    torch.cuda.synchronize()
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), r.detach())
    snap.free()


@cuda
def test_10_an_overlapped_snapshot_of_batchnorm_is_the_state_before_the_forward(arena):
    """snapshot(bn, overlap=True) then the forward it is meant to overlap: the forward writes the running
    statistics and num_batches_tracked in place. With the copy held, the snapshot must still hold the
    values of the call: the forward waits for the buffers' copy (the parameters' copy it may overlap)."""
    _ready(arena, 16 * _MIB)
    bn = torch.nn.BatchNorm1d(1 << 18).cuda().train()
    x = torch.randn(8, 1 << 18, device="cuda")
    x5 = x + 5.0
    bn(x)  # its kernels loaded; statistics that differ from the defaults
    torch.cuda.synchronize()
    expected = {k: v.detach().cpu().clone() for k, v in bn.state_dict().items()}
    with hold(engine_stream(0, to_host=True)) as gate:
        snap = go.snapshot(bn, overlap=True, arena=arena)
        bn(x5)  # the overlapped forward: running_mean, running_var, num_batches_tracked written in place
        assert not settle(recorded()), "the forward ran before the module buffers had been copied"
        gate.release()
    host = snap.wait().tensors()
    for name, value in expected.items():
        assert_bitwise_equal(host[name], value)
    torch.cuda.synchronize()
    assert not torch.equal(bn.running_mean.cpu(), expected["running_mean"])  # the forward did change it
    del host
    snap.free()


def test_gather_sweep_option_parses_byte_lists():
    import argparse

    from gpu_offload import cli

    assert cli._byte_list("0,65536, 262144,1048576") == (0, 65536, 262144, 1048576)
    assert cli._byte_list("0,64KiB,256KiB,1MiB") == (0, 65536, 262144, 1048576)
    for bad in ("64 apples", "-1", "1,x"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli._byte_list(bad)
