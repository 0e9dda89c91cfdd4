"""The public operations' bookkeeping on the simulated driver: an interrupt as a batch's enqueue returns, an
arena dropped with frees pending, CUDA graph capture, and module buffers under snapshot(overlap=True).

The targets are CPU modules and dicts whose copies run on simulated device 0: every storage gets a
simulated twin holding a pattern, and plan.build_copies plans copies of the twins (the rest of api.py,
plan.py and arena.py runs as it does on a GPU). A gate on an engine stream holds a copy back for as long as
the test needs; copies held that long show any missing wait as wrong bytes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any, Iterator

import pytest
import torch

import gpu_offload as go
from gpu_offload import plan
from gpu_offload import overlap as _overlap
from gpu_offload._ext import _C

from conftest import pattern, sim


class Twins:
    """Each storage of a target gets a simulated twin on device 0 holding a pattern; plan.build_copies plans
    copies of the twins instead of the CPU storages."""

    def __init__(self) -> None:
        self.by_ptr: dict[int, int] = {}
        self.seed = 1

    def __call__(self, target: Any) -> dict[str, int]:
        """Twins the target's storages; returns the twin's address of each tensor, by name."""
        out: dict[str, int] = {}
        for name, t in go.adapters.named_tensors(target):
            st = t.untyped_storage()
            if st.data_ptr() not in self.by_ptr:
                self.by_ptr[st.data_ptr()] = sim.mem_alloc(0, st.nbytes())
                sim.write(self.by_ptr[st.data_ptr()], pattern(st.nbytes(), self.seed))
                self.seed += 17
            out[name] = self.by_ptr[st.data_ptr()]
        return out

    def build(self, entries: Any) -> plan.CopyPlans:
        live = [(self.by_ptr[ptr], offset, n) for _, ptr, offset, n in entries if n]
        if not live:
            return plan.CopyPlans([])
        ptrs, offsets, sizes = map(list, zip(*live))
        return plan.CopyPlans([(0, _C.CopyPlan(0, ptrs, offsets, sizes, 0))])


@pytest.fixture
def arena() -> go.Arena:
    return go.Arena(min_slab_bytes=8 << 20, pin="register")


@pytest.fixture
def twin(monkeypatch: pytest.MonkeyPatch, user_streams: dict[int, int]) -> Iterator[Twins]:
    twins = Twins()
    monkeypatch.setattr(plan, "build_copies", twins.build)
    # A cached plan builds its copies from its own columns, not through build_copies: the same twins.
    monkeypatch.setattr(plan.TargetPlan, "_build", lambda self, host_offsets: twins.build(
        [(s.device, p, o, s.nbytes) for s, p, o in zip(self.layout.storages, self.storage_ptrs, host_offsets)]))
    monkeypatch.setattr(_overlap, "_pending", [])
    plan.clear_cache()
    _C.engine_streams(0)
    yield twins
    plan.clear_cache()


def read(ptr: int, tensor: torch.Tensor) -> bytes:
    return sim.read(ptr, tensor.untyped_storage().nbytes())


class Interrupted:
    """A device group whose batch is enqueued and running when CPython raises the interrupt it held during
    the C call, as the call returns (dropping what it returned). The real simulated plan runs: with
    run_into, the binding itself has put the real event in the caller's lists by then."""

    def __init__(self, real: Any, record: bool = True) -> None:
        self.real, self.record = real, record
        self.num_copies = real.num_copies

    def run(self, *args: Any) -> Any:
        self.real.run(*args)
        raise KeyboardInterrupt

    def run_into(self, sinks: Any, *args: Any) -> None:
        if self.record:
            self.real.run_into(sinks, *args)
        else:
            self.real.run(*args)  # the event is dropped
        raise KeyboardInterrupt


def interrupt_copies(monkeypatch: pytest.MonkeyPatch, record: bool = True) -> None:
    real = plan.TargetPlan.copies
    monkeypatch.setattr(plan.TargetPlan, "copies", lambda self, host_offsets=None: plan.CopyPlans(
        [(d, Interrupted(p, record)) for d, p in real(self, host_offsets).groups]))


class Held:
    """A gate on a simulated stream, released by release() or at the end of the with-block at the latest
    (a gate left closed would hang the simulator's shutdown)."""

    def __init__(self, stream: int) -> None:
        self._gate = sim.gate(stream)
        self._lock = threading.Lock()
        self.released = False

    def release(self) -> None:
        with self._lock:
            if not self.released:
                self.released = True
                sim.release(self._gate)

    def __enter__(self) -> "Held":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def d2h() -> int:
    return _C.engine_streams(0)[0]


def h2d() -> int:
    return _C.engine_streams(0)[1]


def test_run_into_appends_the_real_event_to_every_list_before_returning(user_streams, arena):
    p = sim.mem_alloc(0, 4096)
    r = arena._allocate(4096)
    mine: list[Any] = []
    regions: list[Any] = []
    with Held(d2h()):
        assert _C.CopyPlan(0, [p], [0], [4096], 0).run_into((mine, regions), True, r.ptr, plan.current_stream(0),
                                                            [], True) is None
        assert len(mine) == 1 and regions == mine and not mine[0].query()
    mine[0].synchronize()
    r.release()


@pytest.mark.parametrize("op", ["snapshot", "offload"])
def test_an_interrupted_enqueue_keeps_the_region_from_a_cpu_snapshot_until_the_copy_has_written_it(
        twin, monkeypatch, arena, op):
    state = {"w": torch.zeros(1 << 16, dtype=torch.uint8)}
    twin(state)
    interrupt_copies(monkeypatch)
    with Held(d2h()):
        with pytest.raises(KeyboardInterrupt):
            getattr(go, op)(state, arena=arena)
        assert arena.used_bytes > 0, "the region went back while the interrupted copy still writes it"
        monkeypatch.undo()
        # A CPU snapshot in the same arena, now: it must not get the region the held copy writes into.
        cpu = go.snapshot({"c": torch.full((1 << 16,), 7, dtype=torch.uint8)}, arena=arena)
    sim.synchronize()
    assert bool((cpu.tensors()["c"] == 7).all()), "the late copy overwrote another snapshot"
    assert not go.is_offloaded(state)
    cpu.free()
    assert arena.used_bytes == 0


def test_an_interrupted_restore_keeps_a_freed_snapshot_until_its_copy_has_read_it(twin, monkeypatch, arena):
    state = {"w": torch.zeros(1 << 16, dtype=torch.uint8)}
    ptr = twin(state)["w"]
    expected = read(ptr, state["w"])
    snap = go.snapshot(state, arena=arena).wait()
    sim.write(ptr, bytes(len(expected)))
    interrupt_copies(monkeypatch)
    with Held(h2d()):
        with pytest.raises(KeyboardInterrupt):
            go.restore(state, snap)
        snap.free()
        assert arena.used_bytes > 0, "a freed snapshot's region went back while a restore still reads it"
        monkeypatch.undo()
        cpu = go.snapshot({"c": torch.full((1 << 16,), 7, dtype=torch.uint8)}, arena=arena)
    sim.synchronize()
    assert read(ptr, state["w"]) == expected, "the restore read another snapshot's bytes"
    cpu.free()
    assert arena.used_bytes == 0


def test_a_batch_interrupted_without_its_event_is_waited_for_before_the_error(twin, monkeypatch, arena):
    state = {"w": torch.zeros(1 << 16, dtype=torch.uint8)}
    twin(state)
    interrupt_copies(monkeypatch, record=False)
    with Held(d2h()) as held:
        timer = threading.Timer(0.3, held.release)
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                go.snapshot(state, arena=arena)
            # The error came only once the engine streams had run what was enqueued (after the release).
            assert held.released, "the error reached the caller while the lost batch could still run"
        finally:
            timer.cancel()
    assert arena.used_bytes == 0


_DROPPED_ARENA = r"""
import gc, os, sys
from gpu_offload import plan
from gpu_offload._ext import _C
import gpu_offload as go
sim = _C._sim
assert _C.cuda_available()  # the (simulated) driver is loaded at its first use
stream = sim.stream_create(0)
plan.current_stream = lambda device: stream
p = sim.mem_alloc(0, 1 << 20)
a = go.Arena(min_slab_bytes=4 << 20, pin="register")
r = a._allocate(1 << 20)
ptr = r.ptr
held = sim.gate(_C.engine_streams(0)[0])
events = plan.CopyPlans([(0, _C.CopyPlan(0, [p], [0], [1 << 20], 0))]).run(True, ptr, stream_waits=False)
r.release(events)  # snap.free() right after snapshot(): the copy still writes the region
del r, a
gc.collect()
if not sim.host_mapped(ptr, 1 << 20):
    print("the dropped arena unpinned its slab under the held copy")
    os._exit(1)  # releasing now would let the copy write into unmapped memory
sim.release(held)
sim.synchronize()
for e in events:
    e.synchronize()
go.Arena(min_slab_bytes=4 << 20, pin="register").used_bytes  # the next call releases the dropped arena
print("mapped after:", sim.host_mapped(ptr, 1 << 20))
print("ok")
"""


def test_an_arena_dropped_with_a_copy_in_flight_keeps_its_slab_pinned_until_the_copy_ends():
    # In a process of its own: on the old code the copy would write into unmapped memory.
    proc = subprocess.run([sys.executable, "-c", _DROPPED_ARENA], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, GPU_OFFLOAD_SIM="1"))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
    assert "mapped after: False" in proc.stdout  # and released once the copy had ended


@pytest.fixture
def capture_on_sim(monkeypatch: pytest.MonkeyPatch, user_streams: dict[int, int]) -> Iterator[int]:
    """The caller's stream on device 0, and gpu_offload's capture check reading the simulator's capture
    status of it (torch's check sees no simulated stream)."""
    stream = plan.current_stream(0)
    try:
        from gpu_offload import _capture
    except ImportError:  # the code before capture awareness
        pass
    else:
        monkeypatch.setattr(_capture, "capturing", lambda: sim.capture_status(stream) != 0)
    yield stream
    if sim.capture_status(stream) != 0:
        sim.end_capture(stream)


def test_join_under_capture_refuses_a_copy_in_flight_and_leaves_the_capture_valid(capture_on_sim, arena, monkeypatch):
    stream = capture_on_sim
    monkeypatch.setattr(_overlap, "_pending", [])
    p = sim.mem_alloc(0, 1 << 20)
    r = arena._allocate(1 << 20)
    with Held(d2h()):
        events = plan.CopyPlans([(0, _C.CopyPlan(0, [p], [0], [1 << 20], 0))]).run(True, r.ptr, stream_waits=False)
        _overlap.defer(events)
        sim.begin_capture(stream)  # global mode, as torch.cuda.graph
        with pytest.raises(go.OffloadError, match="under CUDA graph capture"):
            go.join()
        with pytest.raises(go.OffloadError, match="capturing a CUDA graph"):
            go.snapshot({"w": torch.zeros(16)}, arena=arena)
        r.release(events)  # freeing under capture
        assert sim.capture_status(stream) == 1, "the capture was invalidated"
    events[0].synchronize()
    go.join()  # still capturing; the copy is complete: passes
    assert sim.capture_status(stream) == 1 and _overlap.pending() == 0
    sim.end_capture(stream)
    assert arena.used_bytes == 0  # reaped once the capture was over


def test_overlap_copies_buffers_before_the_forward_changes_them(twin, arena):
    """snapshot(bn, overlap=True), then a forward that writes the running statistics in place on the
    caller's stream: with the copy held, the buffers in the snapshot must be those of the call, while the
    caller's stream did not wait for the parameters."""
    bn = torch.nn.BatchNorm1d(4096)
    ptrs = twin(bn)
    expected = {name: read(ptrs[name], t) for name, t in bn.state_dict(keep_vars=True).items()}
    stream = plan.current_stream(0)
    with Held(d2h()):
        snap = go.snapshot(bn, overlap=True, arena=arena)
        # The forward, as the GPU runs it: running_mean written in place on the caller's stream.
        sim.enqueue_fill(0, stream, ptrs["running_mean"], 0xAB, bn.running_mean.untyped_storage().nbytes())
    host = snap.wait().tensors()
    sim.synchronize()
    assert read(ptrs["running_mean"], bn.running_mean) == b"\xab" * bn.running_mean.untyped_storage().nbytes()
    for name, value in expected.items():
        assert host[name].numpy().tobytes() == value, f"{name}: changed by the forward before it was copied"
    del host
    snap.free()
