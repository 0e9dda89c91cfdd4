"""Nothing lost: verified offload, discard, what an offload or a snapshot view keeps alive, clear errors
while offloaded, and the races and interrupts of the adversarial review (issue 12)."""

from __future__ import annotations

import copy
import ctypes
import gc
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import gpu_offload as go
from conftest import assert_bitwise_equal
from gpu_offload import registry as _registry

_ROOT = Path(__file__).resolve().parent.parent


def _model(device: torch.device, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(device)


def _values(target: dict[str, torch.Tensor] | torch.nn.Module) -> dict[str, torch.Tensor]:
    items = target.state_dict().items() if isinstance(target, torch.nn.Module) else target.items()
    return {k: v.detach().clone() for k, v in items}


def _settle(device: torch.device) -> None:
    """Waits for copies in flight (on a GPU), so that regions they use can be reused."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _host_address(t: torch.Tensor) -> int:
    """Where an offloaded tensor's storage lies in the arena."""
    with _registry.lock:
        record = _registry.entries[t.untyped_storage()._cdata]
        return record.region.ptr + record.host_offset


def _run(code: str, timeout: int = 240, helper: bool = True) -> subprocess.CompletedProcess[str]:
    """Runs a race in a child process: on the code this fixes it crashed (SIGSEGV) rather than failed.
    helper=False: with the torch-aware helper switched off (GPU_OFFLOAD_TORCH_EXT=0)."""
    env = {"PYTHONPATH": f"{_ROOT}:{_ROOT / 'tests'}", "PATH": "/usr/bin:/bin"}
    if not helper:
        env["GPU_OFFLOAD_TORCH_EXT"] = "0"
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=_ROOT, env=env)


# -- verified offload --------------------------------------------------------------------------------------
def test_reload_verify_catches_a_flipped_host_byte_and_leaves_everything_as_it_was(device, arena):
    state = {"w": torch.randn(1000, device=device), "b": torch.randn(10, device=device)}
    expected = _values(state)
    go.offload(state, arena=arena, checksum=True)
    _settle(device)  # the host copy is complete before it is damaged
    byte = ctypes.c_uint8.from_address(_host_address(state["w"]) + 123)
    byte.value ^= 0x10
    with pytest.raises(go.OffloadError, match=r"corrupt.*storage 0 \(w,"):
        go.reload(state, verify=True)
    assert go.is_offloaded(state)  # nothing was written: still offloaded, host copy as it was
    assert all(t.untyped_storage().nbytes() == 0 for t in state.values())
    byte.value ^= 0x10  # the user repairs it (or decides otherwise)
    go.reload(state, verify=True)
    for k, v in expected.items():
        assert_bitwise_equal(state[k], v)
    _settle(device)
    assert arena.used_bytes == 0


def test_reload_verify_needs_an_offload_with_checksums(device, arena):
    state = {"w": torch.randn(100, device=device)}
    go.offload(state, arena=arena)
    with pytest.raises(go.OffloadError, match=r"offload\(\.\.\., checksum=True\)"):
        go.reload(state, verify=True)
    assert go.is_offloaded(state)
    go.reload(state)


def test_offload_checksums_are_the_snapshot_checksums(device, arena):
    state = {"w": torch.randn(1000, device=device), "v": torch.arange(7, device=device)}
    snap = go.snapshot(state, arena=arena, checksum=True)
    go.offload(state, arena=arena, checksum=True)
    with _registry.lock:
        records = [_registry.entries[t.untyped_storage()._cdata] for t in state.values()]
    assert [r.checksums.result()[r.index] for r in records] == snap.checksums
    go.reload(state, verify=True)
    snap.free()


# -- discard ---------------------------------------------------------------------------------------------
def test_discard_of_a_list_target_and_of_a_part_of_it(device, arena):
    a, b, c = ({"x": torch.randn(100, device=device)} for _ in range(3))
    expected_c = _values(c)
    go.offload([a, b, c], arena=arena)
    go.discard(a)  # a part of the list
    assert not go.is_offloaded(a) and go.is_offloaded([b, c])
    assert a["x"].untyped_storage().nbytes() == 0  # stays empty
    with pytest.raises(go.OffloadError, match="nothing in the target is offloaded"):
        go.reload(a)
    with pytest.raises(go.OffloadError, match="cannot discard: nothing"):
        go.discard(a)
    assert go.offloaded_bytes() == 800
    go.discard([b])  # a list target
    assert go.offloaded_bytes() == 400
    go.reload(c)
    assert_bitwise_equal(c["x"], expected_c["x"])
    _settle(device)
    assert go.offloaded_bytes() == 0 and arena.used_bytes == 0


def test_discard_of_what_is_not_offloaded_is_an_error(arena):
    with pytest.raises(go.OffloadError, match="cannot discard"):
        go.discard({"x": torch.zeros(3)})


# -- what an offload keeps alive -------------------------------------------------------------------------
def test_a_dropped_offloaded_model_returns_its_bytes(device, arena):
    model = _model(device)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 16, device=device)).sum().backward()
    opt.step()
    go.offload([model, opt], arena=arena)
    assert go.offloaded_bytes() > 0 and arena.used_bytes > 0
    del model, opt
    gc.collect()
    _settle(device)
    assert go.offloaded_bytes() == 0
    assert arena.used_bytes == 0


def test_a_parameter_replaced_while_offloaded_leaves_the_registry(device, arena):
    model = _model(device)
    go.offload(model, arena=arena)
    before = go.offloaded_bytes()
    model[0].weight = torch.nn.Parameter(torch.zeros(32, 16, device=device))
    gc.collect()
    assert go.offloaded_bytes() == before - 32 * 16 * 4
    go.discard(model)
    _settle(device)
    assert go.offloaded_bytes() == 0 and arena.used_bytes == 0


# -- views from Snapshot.tensors() -----------------------------------------------------------------------
def test_views_outlive_free_and_never_show_another_snapshots_bytes(arena):
    snap = go.snapshot({"w": torch.full((4096,), 1.0)}, arena=arena)
    view = snap.tensors()["w"]
    snap.free()
    arena.trim()
    other = go.snapshot({"w": torch.full((4096,), 2.0)}, arena=arena)  # would reuse the freed space
    assert bool((view == 1.0).all())
    assert arena.used_bytes > other.layout.host_bytes  # both alive
    del view
    other.free()
    assert arena.used_bytes == 0


def test_views_after_free_and_trim_do_not_crash():
    result = _run("""
        import torch, gpu_offload as go
        arena = go.Arena(min_slab_bytes=1 << 20)
        for _ in range(20):
            snap = go.snapshot({"w": torch.full((1 << 20,), 3.0)}, arena=arena)
            view = snap.tensors()["w"]
            snap.free(); arena.trim()
            assert float(view.sum()) == 3.0 * (1 << 20)
        print("ok")
    """)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def test_a_shallow_copy_of_a_snapshot_has_a_user_of_its_own(device, arena):
    state = {"w": torch.arange(4096.0, device=device), "b": torch.arange(7, device=device)}
    snap = go.snapshot(state, arena=arena).wait()
    twin = copy.copy(snap)
    snap.free()  # the twin still holds the host copy: the space is not reused under it
    other = go.snapshot({"w": torch.full((4096,), -1.0, device=device)}, arena=arena).wait()
    assert arena.used_bytes >= twin.layout.host_bytes + other.layout.host_bytes
    for name, t in twin.tensors().items():
        assert_bitwise_equal(t, state[name])
    del t  # a view holds the memory too
    with pytest.raises(go.OffloadError, match="freed"):
        snap.tensors()
    copy.copy(twin).free()  # a copy freed at once takes nothing from the twin
    twin.tensors()
    twin.free()
    other.free()
    _settle(device)
    assert arena.used_bytes == 0
    with pytest.raises(go.OffloadError, match="freed"):
        copy.copy(twin)
    with pytest.raises(go.OffloadError, match="deep-copied"):
        copy.deepcopy(go.snapshot(state, arena=arena))
    gc.collect()
    _settle(device)
    assert arena.used_bytes == 0


# -- using an offloaded module ---------------------------------------------------------------------------
def test_calling_an_offloaded_module_names_it_and_says_to_reload(device, arena):
    model = _model(device)
    x = torch.randn(2, 16, device=device)
    want = model(x)
    assert not model._forward_pre_hooks  # no cost when nothing is offloaded
    go.offload(model, arena=arena)
    with pytest.raises(go.OffloadError, match=r"cannot run Sequential.*offloaded.*gpu_offload\.reload\(\)"):
        model(x)
    go.reload(model)
    assert not model._forward_pre_hooks
    assert torch.equal(model(x), want)
    go.offload([model], arena=arena)
    go.discard([model])
    assert not model._forward_pre_hooks


def test_the_guard_leaves_a_module_reloaded_through_its_tensors(arena):
    model = _model(torch.device("cpu"))
    go.offload(model, arena=arena)
    go.reload(dict(model.named_parameters()))  # not through the module: the guard goes at the next call
    model(torch.randn(2, 16))
    assert not model._forward_pre_hooks


# -- autograd --------------------------------------------------------------------------------------------
def test_restore_between_forward_and_backward_makes_backward_raise(device, arena):
    model = _model(device)
    snap = go.snapshot(model, arena=arena)
    loss = model(torch.randn(2, 16, device=device)).sum()
    go.restore(model, snap)  # an in-place write of the weights the forward saved, as a copy_ would be
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    snap.free()


# -- include_grads is recorded, not guessed from names ---------------------------------------------------
def test_a_buffer_named_grad_does_not_break_restore_after_backward(device, arena):
    model = _model(device)
    acc = torch.nn.Module()
    acc.register_buffer("grad", torch.zeros(3, device=device))
    model.add_module("acc", acc)  # "acc.grad"
    snap = go.snapshot(model, arena=arena)
    assert not snap.include_grads
    model[0](torch.randn(2, 16, device=device)).sum().backward()
    go.restore(model, snap)
    with_grads = go.snapshot(model, arena=arena, include_grads=True)
    assert with_grads.include_grads and "0.weight.grad" in with_grads.names
    snap.free()
    with_grads.free()


def test_include_grads_survives_a_file(device, arena, tmp_path):
    pytest.importorskip("safetensors")
    model = _model(device)
    acc = torch.nn.Module()
    acc.register_buffer("grad", torch.zeros(3, device=device))
    model.add_module("acc", acc)  # "acc.grad"
    model[0](torch.randn(2, 16, device=device)).sum().backward()
    for include_grads in (False, True):
        go.save(go.snapshot(model, arena=arena, include_grads=include_grads), tmp_path / "s.snap")
        loaded = go.load(tmp_path / "s.snap", arena=arena)
        assert loaded.include_grads is include_grads
        go.restore(model, loaded)  # with grads on the model: only a recorded False makes this a weights-only restore
        loaded.free()


# -- races (CPU path) ------------------------------------------------------------------------------------
@pytest.mark.parametrize("helper", [True, False], ids=["helper", "python"])
def test_snapshot_while_another_thread_offloads_does_not_crash(helper):
    result = _run(helper=helper, code="""
        import threading, torch, gpu_offload as go
        state = {f"w{i}": torch.randn(1 << 20) for i in range(8)}
        stop = threading.Event()
        def churn():
            while not stop.is_set():
                go.offload(state); go.reload(state)
        t = threading.Thread(target=churn); t.start()
        ok = refused = 0
        try:
            for _ in range(300):
                try:
                    go.snapshot(state).free(); ok += 1
                except go.OffloadError:
                    refused += 1
        finally:
            stop.set(); t.join()
        print("ok", ok, refused)
    """)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def test_free_and_trim_from_another_thread_during_restore_do_not_crash():
    result = _run("""
        import random, threading, time, torch, gpu_offload as go
        arena = go.Arena(min_slab_bytes=1 << 20)
        state = {f"w{i}": torch.randn(4 << 20) for i in range(4)}
        rng = random.Random(0)
        for _ in range(100):
            snap = go.snapshot(state, arena=arena)
            delay = rng.uniform(0, 0.004)
            def kill():
                time.sleep(delay); snap.free(); arena.trim()
            t = threading.Thread(target=kill); t.start()
            try:
                go.restore(state, snap)
            except go.OffloadError:
                pass  # freed before the restore began
            t.join()
        assert arena.used_bytes == 0, arena.used_bytes
        print("ok")
    """)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def test_swap_beside_offload_and_reload_in_another_thread(arena):
    a = {f"a{i}": torch.randn(1000) for i in range(50)}
    b = {f"b{i}": torch.randn(1000) for i in range(50)}
    c = {f"c{i}": torch.randn(1000) for i in range(50)}
    import threading

    errors: list[BaseException] = []
    stop = threading.Event()

    def churn() -> None:
        try:
            while not stop.is_set():
                go.offload(c, arena=arena)
                go.reload(c)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    go.offload(b, arena=arena)
    t = threading.Thread(target=churn)
    t.start()
    try:
        for _ in range(200):
            go.swap(a, b, arena=arena)
            go.swap(b, a, arena=arena)
    finally:
        stop.set()
        t.join()
    assert not errors, errors
    go.reload(b)
    assert go.offloaded_bytes() == 0 and arena.used_bytes == 0


# -- interrupts ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("helper", [True, False], ids=["helper", "python"])
def test_interrupts_at_random_points_leak_no_arena_region(helper):
    result = _run(helper=helper, code="""
        import gc, random, signal, torch, gpu_offload as go
        class Alarm(Exception):
            pass
        def boom(*_):
            raise Alarm()
        signal.signal(signal.SIGALRM, boom)
        arena = go.Arena(min_slab_bytes=1 << 20)
        state = {f"w{i}": torch.randn(1 << 16) for i in range(16)}
        rng = random.Random(0)
        hits = 0
        for i in range(600):
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(0, 0.002))  # one shot
                if i % 3 == 1:
                    go.snapshot(state, arena=arena).free()
                elif i % 3 == 2:
                    with go.snapshot(state, arena=arena) as snap:
                        go.restore(state, snap)
                else:
                    go.offload(state, arena=arena)
                    go.reload(state)
                    arena.trim()
                signal.setitimer(signal.ITIMER_REAL, 0)
            except Alarm:
                hits += 1
            if go.is_offloaded(state):  # an offload that completed before the alarm
                go.reload(state)
            snap = None  # a snapshot whose __exit__ the alarm interrupted is still alive: drop it
        if go.is_offloaded(state):
            go.reload(state)
        gc.collect()
        assert arena.used_bytes == 0, (arena.used_bytes, hits)
        print("ok", hits)
    """)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def _interrupt_in_finalizers(k: int, fn: Any) -> int:
    """Runs fn() with a KeyboardInterrupt raised at the k-th point (call, C return, return) of the code that
    gpu_offload's finalizers (`__del__`) run, where a signal handler may run and raise too: the finalizer
    stops there and its exception is only reported. Returns the number of points seen."""
    package = str(Path(go.__file__).resolve().parent)
    seen = [0]

    def in_finalizer(frame: Any) -> bool:
        while frame is not None:
            if frame.f_code.co_name == "__del__" and frame.f_code.co_filename.startswith(package):
                return True
            frame = frame.f_back
        return False

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_return", "return") and in_finalizer(frame):
            seen[0] += 1
            if seen[0] == k:
                raise KeyboardInterrupt

    hook, sys.unraisablehook = sys.unraisablehook, lambda _: None  # what CPython does: print and go on
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        sys.unraisablehook = hook
    return seen[0]


def test_an_interrupt_inside_a_finalizer_loses_no_arena_memory():
    """A signal can land inside a finalizer (a snapshot, a lease on its region, a region dropped unreleased)
    at any point; CPython then abandons the finalizer. The memory must still come back at the arena's next
    call: a region collected unreleased is found by a weak reference's callback (C code), not by a
    `__del__` of its own that such an interrupt could cut short."""
    arena = go.Arena(pin="none")
    state = {"w": torch.randn(4096), "b": torch.randn(16)}
    gc.collect()
    gc.freeze()
    try:
        _interrupt_every_finalizer_point(arena, state)
    finally:
        gc.unfreeze()


def _interrupt_every_finalizer_point(arena: go.Arena, state: dict[str, torch.Tensor]) -> None:
    k = 1
    while True:
        snap = go.snapshot(state, arena=arena)
        lease = snap._use()  # a copy's user of the region, never released
        orphan = arena._allocate(4096)  # a region nothing released

        def drop() -> None:
            nonlocal snap, lease, orphan
            snap = lease = orphan = None  # type: ignore[assignment]
            gc.collect()  # (what existed before the test is frozen: only the new objects are scanned)

        points = _interrupt_in_finalizers(k, drop)
        assert arena.used_bytes == 0, (k, points, arena.stats())
        if k > points:
            break
        k += 1
    assert k > 3  # the finalizers ran code that could be interrupted
