"""Faults: exceptions and KeyboardInterrupt injected in the middle of a batch, device out of memory during
reload, pinning more than the machine can spare, and threads working on different models at once."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest
import torch

import gpu_offload as go
import conftest
from conftest import (assert_bitwise_equal, every_interrupt, inject_failure, inject_resize_failure, load_script, node_budget,
                      random_tensor)
from gpu_offload import integrity as _integrity
from gpu_offload import plan as _plan
from gpu_offload import registry as _registry
from gpu_offload._ext import _C

# Every test runs with the torch-aware helper and with the pure-Python path (conftest.checks).
pytestmark = pytest.mark.usefixtures("checks")


def _state(device: torch.device) -> dict[str, torch.Tensor]:
    base = random_tensor((500,), torch.float32, device, seed=1)
    return {
        "a": random_tensor((40, 7), torch.float16, device, seed=2),
        "base": base,
        "view": base[100:150],  # shares base's storage
        "b": random_tensor((33,), torch.int32, device, seed=3),
        "c": random_tensor((3, 5), torch.bfloat16, device, seed=4),
    }


_NUM_STORAGES = 4  # a, base (with view), b, c


def _copy(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
    """Values and storage sizes to compare with later."""
    return {n: (t.clone(), t.untyped_storage().nbytes()) for n, t in state.items()}


def _assert_live_and_equal(state: dict[str, torch.Tensor], expected: dict[str, tuple[torch.Tensor, int]]) -> None:
    assert not go.is_offloaded(state)
    for k in state:
        assert state[k].untyped_storage().nbytes() == expected[k][1]
        assert_bitwise_equal(state[k], expected[k][0])
    assert state["view"].untyped_storage()._cdata == state["base"].untyped_storage()._cdata


def _assert_offloaded(state: dict[str, torch.Tensor]) -> None:
    assert go.is_offloaded(state)
    assert all(t.untyped_storage().nbytes() == 0 for t in state.values())


# -- offload ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("k", range(1, _NUM_STORAGES + 1))
def test_offload_interrupted_while_releasing_storages_leaves_the_target_untouched(device, arena, monkeypatch, k, exc):
    state = _state(device)
    expected = _copy(state)
    used, offloaded = arena.used_bytes, go.offloaded_bytes()
    calls = inject_resize_failure(monkeypatch, k, exc, when=lambda size: size == 0)
    with pytest.raises(exc, match="injected"):
        go.offload(state, arena=arena)
    monkeypatch.undo()
    assert calls["n"] == k
    _assert_live_and_equal(state, expected)
    assert (arena.used_bytes, go.offloaded_bytes()) == (used, offloaded)
    go.offload(state, arena=arena)  # and it works afterwards
    go.reload(state)
    _assert_live_and_equal(state, expected)
    assert arena.used_bytes == used


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_offload_interrupted_in_the_copy_leaves_the_target_untouched(device, arena, monkeypatch, exc):
    state = _state(device)
    expected = _copy(state)
    inject_failure(monkeypatch, _plan.CopyPlans, "run", 1, exc)
    with pytest.raises(exc, match="injected"):
        go.offload(state, arena=arena)
    monkeypatch.undo()
    _assert_live_and_equal(state, expected)
    assert arena.used_bytes == 0 and go.offloaded_bytes() == 0


# -- reload -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("exc", [KeyboardInterrupt, MemoryError])
@pytest.mark.parametrize("k", range(1, _NUM_STORAGES + 1))
def test_reload_interrupted_while_allocating_keeps_the_target_offloaded(device, arena, monkeypatch, k, exc):
    state = _state(device)
    expected = _copy(state)
    go.offload(state, arena=arena)
    used, offloaded = arena.used_bytes, go.offloaded_bytes()
    inject_resize_failure(monkeypatch, k, exc, when=lambda size: size > 0)
    # An allocation failure becomes a clear OffloadError; an interrupt stays what it is.
    with pytest.raises(go.OffloadError if exc is MemoryError else exc, match="injected"):
        go.reload(state)
    monkeypatch.undo()
    _assert_offloaded(state)
    assert (arena.used_bytes, go.offloaded_bytes()) == (used, offloaded)
    go.reload(state)
    _assert_live_and_equal(state, expected)
    assert arena.used_bytes == 0 and go.offloaded_bytes() == 0


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("k", [1, 2])
def test_reload_interrupted_between_copies_keeps_everything_offloaded(device, arena, monkeypatch, k, exc):
    # Two targets offloaded separately: two regions, so reload([one, two]) runs two copy batches.
    one, two = _state(device), {"x": random_tensor((77,), torch.float64, device, seed=9)}
    expected_one = _copy(one)
    expected_two = {n: t.clone() for n, t in two.items()}
    go.offload(one, arena=arena)
    go.offload(two, arena=arena)
    used, offloaded = arena.used_bytes, go.offloaded_bytes()
    inject_failure(monkeypatch, _plan.CopyPlans, "run", k, exc)
    with pytest.raises(exc, match="injected"):
        go.reload([one, two])
    monkeypatch.undo()
    _assert_offloaded(one)
    _assert_offloaded(two)
    assert (arena.used_bytes, go.offloaded_bytes()) == (used, offloaded)
    go.reload([one, two])
    _assert_live_and_equal(one, expected_one)
    assert_bitwise_equal(two["x"], expected_two["x"])
    assert arena.used_bytes == 0 and go.offloaded_bytes() == 0


# -- snapshot and restore -----------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["copy", "checksum"])
def test_snapshot_interrupted_gives_its_space_back(device, arena, monkeypatch, where):
    state = _state(device)
    expected = _copy(state)
    go.snapshot(state, arena=arena).free()  # the arena has its slab: capacity must not change either
    capacity = arena.capacity_bytes
    if where == "copy":
        inject_failure(monkeypatch, _plan.CopyPlans, "run", 1, KeyboardInterrupt)
    else:
        inject_failure(monkeypatch, _integrity, "compute", 1, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        go.snapshot(state, arena=arena, checksum=True)
    monkeypatch.undo()
    _assert_live_and_equal(state, expected)
    assert (arena.used_bytes, arena.capacity_bytes) == (0, capacity)


def test_restore_interrupted_before_its_copy_leaves_the_target_untouched(device, arena, monkeypatch):
    state = _state(device)
    snap = go.snapshot(state, arena=arena, checksum=True)
    for n in ("a", "base", "b", "c"):  # every storage (view lies inside base)
        state[n].reshape(-1).view(torch.uint8).fill_(7)
    before = {n: t.clone() for n, t in state.items()}
    used = arena.used_bytes
    inject_failure(monkeypatch, _plan.CopyPlans, "run", 1, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        go.restore(state, snap, verify=True)
    monkeypatch.undo()
    for n in state:
        assert_bitwise_equal(state[n], before[n])
    assert arena.used_bytes == used
    go.restore(state, snap, verify=True)
    snap.free()


# -- resources ----------------------------------------------------------------------------------------------
def test_pinning_beyond_available_memory_is_refused_up_front(device, tmp_path):
    available = _C.available_host_memory()
    assert available > 0
    arena = go.Arena()
    state = _state(device)
    expected = _copy(state)
    with pytest.raises(go.OffloadError, match=r"refusing to pin .* available"):
        arena.reserve(available + (64 << 30))
    assert (arena.capacity_bytes, arena.used_bytes) == (0, 0)
    # A snapshot's or an offload's slab meets the same checks before anything is copied (a first slab is
    # the region's own size, so the node's budget stands in for a machine too small for it).
    with node_budget(tmp_path, 1):
        for op in (lambda: go.snapshot(state, arena=arena), lambda: go.offload(state, arena=arena),
                   lambda: arena.reserve(16)):
            with pytest.raises(go.OffloadError, match=r"node host-memory budget exceeded"):
                op()
            _assert_live_and_equal(state, expected)
            assert (arena.capacity_bytes, arena.used_bytes) == (0, 0)


_MEMLOCK_CHILD = textwrap.dedent("""
    import resource, sys, torch, gpu_offload as go
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 << 10, 64 << 10))  # ulimit -l 64
    w = torch.arange(8 << 20, dtype=torch.float32, device="cuda")
    for pin in ("register", "hostalloc"):
        arena = go.Arena(min_slab_bytes=64 << 20, pin=pin)
        try:
            snap = go.snapshot({"w": w}, arena=arena, checksum=True)
            snap.verify()
            ok = torch.equal(snap.tensors()["w"], w.cpu())
            print(pin, "pinned" if ok else "WRONG", arena.pin_mode)
        except go.OffloadError as exc:
            print(pin, "refused", str(exc).splitlines()[0])
""")


@pytest.mark.cuda
def test_pinning_under_a_low_memlock_limit_is_refused_or_works():
    # The driver pins through its own path (not mlock), so ulimit -l may not apply: either way the
    # result is a clear OffloadError or a correct snapshot, never a crash.
    out = subprocess.run([sys.executable, "-c", _MEMLOCK_CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2 and all(line.split()[1] in ("pinned", "refused") for line in lines), out.stdout


@pytest.mark.cuda
def test_reload_on_a_full_gpu_fails_clearly_and_a_retry_after_freeing_works():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()  # 128 MiB
    expected = [p.detach().cpu().clone() for p in model.parameters()]
    arena = go.Arena(min_slab_bytes=256 << 20)
    go.offload(model, arena=arena)
    used = arena.used_bytes
    filler: list[torch.Tensor] = []
    try:
        chunk = 1 << 30
        while chunk >= (1 << 20):  # fill the device, down to the last MiB
            try:
                filler.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                chunk //= 2
        with pytest.raises(go.OffloadError, match="still offloaded with its data intact"):
            go.reload(model)
        assert go.is_offloaded(model) and arena.used_bytes == used
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    finally:
        filler.clear()
        torch.cuda.empty_cache()
    go.reload(model)
    for p, e in zip(model.parameters(), expected):
        assert_bitwise_equal(p.cpu(), e)
    assert arena.used_bytes == 0


# -- threads ------------------------------------------------------------------------------------------------
def test_two_threads_on_different_models_stay_bitwise_right(device):
    # The short version of benchmarks/stress_threads.py (minutes there, seconds here).
    stress = load_script("stress_threads")
    # Rounds counted, not timed: each thread runs at least 4 (3 restores, 2 offloads) however busy the machine.
    report = stress.stress(3.0, device=str(device), threads=2, width=128, depth=4, min_steps=4)
    assert not report.get("errors"), report.get("errors")
    assert report["wrong"] == 0
    for i in range(2):
        assert report[f"thread{i}"]["restores"] >= 4 and report[f"thread{i}"]["offloads"] >= 2, report
    assert report["arena_used_bytes_after"] == 0 and report["offloaded_bytes_after"] == 0


# -- locks: an interrupt anywhere, and fork -------------------------------------------------------------------
def _free_for_another_thread(lock: Any) -> bool:
    taken: list[bool] = []

    def take() -> None:
        if lock.acquire(timeout=10):
            taken.append(True)
            lock.release()

    thread = threading.Thread(target=take)
    thread.start()
    thread.join()
    return taken == [True]


def _take_registry_lock() -> None:
    with _registry.lock:
        pass


def test_an_interrupt_anywhere_in_taking_or_leaving_the_registry_lock_leaves_it_free(arena):
    # A storage that died while offloaded: taking the lock first drops its entry (prune).
    def dead_entry() -> None:
        go.offload({"x": torch.ones(64)}, arena=arena)

    def check(k: int) -> None:
        assert _free_for_another_thread(_registry.lock), f"interrupt {k} ({conftest.last_point}) left the lock held"
        dead_entry()

    dead_entry()
    points = every_interrupt(_take_registry_lock, check)
    assert points >= 3  # entering, the acquisition's return, the prune
    gc.collect()
    _take_registry_lock()
    assert go.offloaded_bytes() == 0 and arena.used_bytes == 0


_FORK_CHILD = textwrap.dedent("""
    import os, signal, sys, threading, torch, gpu_offload as go
    from gpu_offload import arena as _arena, overlap as _overlap, plan as _plan, registry as _registry

    arena = go.Arena(pin="none", min_slab_bytes=1 << 20)
    snap = go.snapshot({"x": torch.arange(16.0)}, arena=arena)
    go.default_arena()
    locks = [_registry.lock, arena._lock, _arena._default_lock, _overlap._lock, _plan._cache_lock, snap._lock]
    held, done = threading.Event(), threading.Event()

    def hold():
        for lock in locks:
            lock.__enter__()
        held.set()
        done.wait()
        for lock in reversed(locks):
            lock.__exit__(None, None, None)

    thread = threading.Thread(target=hold)
    thread.start()
    assert held.wait(60)
    pid = os.fork()
    if pid == 0:
        try:
            state = {"w": torch.arange(32.0)}
            again = go.snapshot(state, arena=arena)
            go.restore(state, snap if False else again)
            go.offload(state, arena=arena)
            assert go.is_offloaded(state)
            go.reload(state)
            assert torch.equal(state["w"], torch.arange(32.0))
            assert torch.equal(snap.tensors()["x"], torch.arange(16.0))
            go.snapshot(state).free()  # the default arena
            os._exit(0)
        except BaseException as exc:
            print("child:", repr(exc), file=sys.stderr, flush=True)
            os._exit(3)
    for _ in range(600):  # a child blocked on a lock still held is killed after a minute
        waited, status = os.waitpid(pid, os.WNOHANG)
        if waited:
            break
        threading.Event().wait(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        print("child blocked")
        status = -1
    done.set()
    thread.join()
    print("child status", status)
    sys.exit(0 if status == 0 else 1)
""")


def test_a_forked_child_is_not_blocked_by_locks_another_thread_held_at_the_fork():
    out = subprocess.run([sys.executable, "-c", _FORK_CHILD], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout, out.stderr)
