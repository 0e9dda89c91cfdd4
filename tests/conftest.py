"""Shared fixtures: every engine test body runs on the CPU and, where a GPU answers, on CUDA."""

from __future__ import annotations

import contextlib
import dis
import importlib.util
import os
import sys
from typing import Any, Callable, Iterator

import pytest
import torch

import gpu_offload as go
from gpu_offload import torch_ext

_MIB = 1 << 20

# The gated GPU tests (cuda_gates.py) hold one stream while others must run: as many hardware work queues as
# the device has, so that fewer streams share the held one's. Read when the CUDA context is created.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

# tests/sim runs on the simulated driver, in a process of its own (test_sim_driver.py starts it).
collect_ignore = [] if os.environ.get("GPU_OFFLOAD_SIM") else ["sim"]


NO_CUDA = "no CUDA device (or gpu_offload built without CUDA)"


def _cuda_ok() -> bool:
    return go.cuda_available() and torch.cuda.is_available()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> torch.device:
    if request.param == "cuda" and not _cuda_ok():
        pytest.skip(NO_CUDA)
    return torch.device(request.param)


@pytest.fixture
def arena() -> go.Arena:
    """A fresh arena per test with small slabs, so bookkeeping is visible and tests stay light."""
    return go.Arena(min_slab_bytes=4 * _MIB)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_ok():
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if "cuda" in item.keywords and "device" not in getattr(item, "fixturenames", ()):
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """A CUDA test skipped for want of a GPU is reported from one place, so that `-ra` folds them all into one
    line with their count (`SKIPPED [69] tests/conftest.py: cuda-marked tests: no CUDA device ...`) instead
    of a line per test; any other skip keeps its own line and reason."""
    report = yield
    if report.skipped and isinstance(report.longrepr, tuple) and len(report.longrepr) == 3 \
            and str(report.longrepr[2]).endswith(NO_CUDA) and "cuda" in item.keywords:
        report.longrepr = (__file__, None, f"cuda-marked tests: {NO_CUDA}")
    return report


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, for bitwise comparison of any dtype (NaN payloads included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    assert torch.equal(bits(a).cpu(), bits(b).cpu())


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.Tensor:
    """Random bit patterns of any dtype (bool gets 0/1)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if dtype == torch.bool:
        raw = torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8)
        return raw.view(torch.bool).reshape(shape).to(device)
    raw = torch.randint(0, 256, (n * itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape).to(device)


@contextlib.contextmanager
def node_budget(directory: Any, max_bytes: int) -> Iterator[None]:
    """Gives this process a node host-memory budget (its ledger in `directory`) for the block, then the
    environment's again. What the block pins under it must be given back (trim) before it ends."""
    from gpu_offload import arena as _arena
    from gpu_offload._ext import _C

    _arena._configure_node()
    before, before_dir = _arena.node_budget_from_env()
    _C.node_ledger_configure(str(directory), max_bytes)
    try:
        yield
    finally:
        _C.node_ledger_configure(before_dir, before or 0)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # `checks`' modes: a test module that sets CHECKS_WALK = True also runs its tests with the module walks
    # ("walk") and with every check in parts on threads ("parts").
    if "checks" in metafunc.fixturenames:
        modes = ["helper", "python"] + (["walk", "parts"] if getattr(metafunc.module, "CHECKS_WALK", False) else [])
        metafunc.parametrize("checks", modes, indirect=True)


@pytest.fixture
def checks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Runs a test with the engine's per-call work done by the torch-aware helper (gpu_offload._torch_ext:
    target records, module traversals, batched resizes and watches), and again with the pure-Python path
    it takes where the helper is not loaded (GPU_OFFLOAD_TORCH_EXT=0). "walk" (test modules that ask for it):
    the helper without its recorded module traversals, as on a Python whose dicts lack version tags (3.13 and
    later), where a plain module and a torch optimizer are walked in C++ each call (walk_module, walk_optimizer).
    "parts": the helper with each record's check split into three parts, two on threads of their own, however
    few the tensors (a large target's check is split so; a test's targets are small)."""
    from gpu_offload import adapters, plan, registry, storages
    from gpu_offload.adapters import fsdp

    if request.param in ("helper", "walk", "parts") and torch_ext.ext is None:
        pytest.skip(f"gpu_offload._torch_ext {torch_ext.status()}")
    if request.param == "walk":
        if not hasattr(torch_ext.ext, "walk_module"):
            pytest.skip("this helper has no walk_module")
        monkeypatch.setattr(torch_ext.ext, "MODULE_TREE", False)
        if hasattr(torch_ext.ext, "walk_optimizer"):
            monkeypatch.setattr(torch_ext.ext, "OPTIMIZER_TREE", False)
    if request.param == "python":
        for module in (plan, registry, adapters, storages, fsdp):
            monkeypatch.setattr(module, "_ext", None)
    parts = None
    if request.param == "parts":
        parts = getattr(torch_ext.ext.TargetRecord, "set_check_parts", None)
        if parts is None:
            pytest.skip("this helper checks in one part")
        _, per_thread = torch_ext.ext.TargetRecord.check_parts()
        parts(3, 1)
    plan.clear_cache()
    try:
        yield request.param
    finally:
        if parts is not None:
            parts(0, per_thread)
        plan.clear_cache()


@pytest.fixture
def expect_cuda_build() -> bool | None:
    value = os.environ.get("GPU_OFFLOAD_EXPECT_CUDA_BUILD")
    return None if value is None else value == "1"


_BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def load_script(name: str) -> Any:
    """A script of benchmarks/ (e.g. "soak"), imported as a module of its own (the folder is no package)."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", os.path.join(_BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def inject_failure(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, k: int, exc: type[BaseException],
                   when: Callable[..., bool] = lambda *a, **kw: True) -> dict[str, int]:
    """Makes the k-th call of owner.name (among those `when` selects) raise exc before doing anything."""
    original = getattr(owner, name)
    calls = {"n": 0}

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if when(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == k:
                raise exc(f"injected into call {k} of {name}")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


# -- an interrupt at every point ------------------------------------------------------------------------------
_PACKAGE_DIR = os.path.dirname(os.path.abspath(go.__file__)) + os.sep
_CACHE = dis.opmap.get("CACHE", -1)
_CALLS = {dis.opmap[n] for n in ("CALL", "CALL_FUNCTION_EX", "CALL_KW", "CALL_FUNCTION", "CALL_METHOD",
                                 "CALL_FUNCTION_KW") if n in dis.opmap}


last_point: list[str] = []  # where the last interrupt_at raised, for messages


class Interrupted(KeyboardInterrupt):
    """The KeyboardInterrupt that interrupt_at raises (a subclass, so that a test tells it from a real one)."""


def _in_a_call(frame: Any) -> bool:
    """Whether the frame is at a call instruction (the instruction a callee returns to), not at one that calls
    Python code from C with no check of pending signals after it (a `with` entering, a property read)."""
    code, i = frame.f_code.co_code, frame.f_lasti
    while i > 0 and code[i] == _CACHE:  # inline caches after the instruction
        i -= 2
    return 0 <= i < len(code) and code[i] in _CALLS


def interrupt_at(k: int, fn: Callable[[], Any], where: str = _PACKAGE_DIR) -> bool:
    """Runs fn() with a KeyboardInterrupt raised at the k-th point of the code in files under `where`
    (default: gpu_offload's own) where CPython runs signal handlers: on entry to one of its functions, right
    after a C function it calls returns (the result dropped, as a signal landing there drops it), and right
    after a function it calls returns to its call instruction. (Not in finalizers or what they call: their
    exceptions never reach the caller, and what an interrupt there loses is the finalizer's to guard.)
    Returns True when the interrupt was raised, False when fn finished first. In this thread only.
    """
    return _profiled(k, fn, where) >= k


def count_points(fn: Callable[[], Any], where: str = _PACKAGE_DIR) -> int:
    """The points of one uninterrupted run of fn() (see interrupt_at)."""
    return _profiled(0, fn, where)


def _profiled(k: int, fn: Callable[[], Any], where: str) -> int:
    seen = [0]

    def ours(frame: Any) -> bool:
        return frame is not None and frame.f_code.co_filename.startswith(where)

    def in_finalizer(frame: Any) -> bool:
        while frame is not None:
            if frame.f_code.co_name == "__del__":
                return True
            frame = frame.f_back
        return False

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event not in ("call", "c_return", "return") or in_finalizer(frame):
            return
        if event == "return":
            point = ours(frame.f_back) and _in_a_call(frame.f_back)
        else:
            point = ours(frame)
        if point:
            seen[0] += 1
            if seen[0] == k:
                what = getattr(arg, "__qualname__", "") if event == "c_return" else frame.f_code.co_qualname
                at = frame.f_back if event == "return" else frame
                last_point[:] = [f"{event} {what} at {os.path.basename(at.f_code.co_filename)}:{at.f_lineno}"]
                raise Interrupted(f"interrupt at point {k}")  # the profiler unsets itself on an exception

    sys.setprofile(profile)
    try:
        fn()
    except Interrupted:
        pass
    finally:
        sys.setprofile(None)
    return seen[0]  # an interrupt raised but not escaped (a weakref callback's is printed and dropped) counts too


def every_interrupt(fn: Callable[[], Any], check: Callable[[int], None], where: str = _PACKAGE_DIR) -> int:
    """Interrupts fn() at each of its points in turn (interrupt_at with k = 1, 2, ...), calling check(k) after
    each run; returns the number of points. One uninterrupted run first (imports, cached plans), so that
    every run takes the same path; check() must leave things as they were before the run."""
    fn()
    points = count_points(fn, where)
    check(0)
    for k in range(1, points + 1):
        interrupt_at(k, fn, where)
        check(k)
    return points


def inject_resize_failure(monkeypatch: pytest.MonkeyPatch, k: int, exc: type[BaseException],
                          when: Callable[[int], bool] = lambda size: True) -> dict[str, int]:
    """Makes the k-th storage resize (among those whose new size `when` selects) raise exc before it is
    done, whichever way the engine resizes: one storage per call (UntypedStorage.resize_) or many in one
    C++ call (the torch-aware helper's TargetRecord.resize_live; the storages before the k-th are resized
    then, as when its loop fails there)."""
    calls = inject_failure(monkeypatch, torch.UntypedStorage, "resize_", k, exc, when=lambda self, size: when(size))
    if torch_ext.ext is not None:
        patched_resize = torch.UntypedStorage.resize_  # counts and raises

        def resize_live(record: Any, tensors: list[torch.Tensor], release: bool, refuse: bool = False,
                        held: Any = None, begin: int = 0, end: int = -1) -> None:
            # (held: reached through the tensors here instead; begin, end: a part, as the helper's)
            messages = record.refusals if refuse else None
            live = record.live()
            try:
                for k, (first, nbytes) in list(enumerate(live))[begin:len(live) if end < 0 else end]:
                    storage = tensors[first].untyped_storage()
                    if messages and not release:  # lifted before it grows, as the helper's pass does
                        torch_ext.allow_access([storage])
                    patched_resize(storage, 0 if release else nbytes)
                    if messages and release:
                        torch_ext.refuse_access([storage], messages[k])
            finally:
                record.refresh(tensors)  # the record follows its storages, as resize_live's own loop does

        monkeypatch.setattr(torch_ext.ext.TargetRecord, "resize_live", resize_live)
    return calls
