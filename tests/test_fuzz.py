"""Bad input, fuzzed: random layouts (dtypes, 0-size, non-contiguous and overlapping views, storages shared at
offsets and across dtypes, meta and sparse tensors, mixed devices, parameters that require grad, tensors
replaced between snapshot and restore). Each case either round-trips bitwise or raises a clear
OffloadError before anything changed (target bytes, arena accounting, offload registry)."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import gpu_offload as go
from conftest import _cuda_ok, random_tensor

# Every test runs with the torch-aware helper and with the pure-Python path (conftest.checks).
pytestmark = pytest.mark.usefixtures("checks")

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn]
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
INVALID = ("meta", "sparse_coo", "sparse_csr", "not_a_tensor")

FUZZ = settings(max_examples=int(os.environ.get("GPU_OFFLOAD_FUZZ_EXAMPLES", "40")), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

_DEVICES = ["cpu"] + (["cuda"] if _cuda_ok() else [])


@st.composite
def views(draw: st.DrawFn, base: torch.Tensor) -> torch.Tensor:
    """A view of a 1-D base: whole, a slice, strided, transposed 2-D, expanded (stride 0), overlapping
    windows (as_strided), or the same bytes as another dtype."""
    n = base.numel()
    kind = draw(st.sampled_from(["whole", "slice", "step", "transposed", "expanded", "overlapping", "bytes"]))
    event(f"view: {kind}")
    if kind == "slice" or (n == 0 and kind != "bytes"):
        a = draw(st.integers(0, n))
        return base[a:draw(st.integers(a, n))]
    if kind == "step":
        return base[draw(st.integers(0, n - 1))::draw(st.integers(1, 7))]
    if kind == "transposed":
        rows = draw(st.integers(1, max(1, n // 2)))
        cols = n // rows
        return base[: rows * cols].view(rows, cols).t() if cols else base[:0]
    if kind == "expanded":
        i = draw(st.integers(0, n - 1))
        return base[i:i + 1].expand(draw(st.integers(0, 9)))
    if kind == "overlapping":
        width = draw(st.integers(1, n))
        count = draw(st.integers(1, n - width + 1))
        offset = draw(st.integers(0, n - width - count + 1))
        return base.as_strided((count, width), (1, 1), offset)
    if kind == "bytes":
        return base.view(torch.uint8)
    return base


@st.composite
def targets(draw: st.DrawFn, device: str) -> dict[str, Any]:
    """A state dict of random storages and views on `device` (with, on a GPU, some CPU tensors mixed in)."""
    state: dict[str, Any] = {}
    for s in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(DTYPES))
        dev = draw(st.sampled_from(["cpu", device])) if device != "cpu" else "cpu"
        base = random_tensor((draw(st.integers(0, 200)),), dtype, torch.device(dev), seed=draw(st.integers(0, 9999)))
        if dtype in FLOATS and draw(st.booleans()):
            base = torch.nn.Parameter(base, requires_grad=True)
            if draw(st.booleans()):
                base.grad = torch.ones_like(base)
        for v in range(draw(st.integers(1, 3))):
            state[f"s{s}.v{v}"] = base if v == 0 else draw(views(base.detach()))
    if draw(st.booleans()):  # a nested mapping: names get its prefix
        state["nested"] = {"x": random_tensor((draw(st.integers(0, 50)),), torch.float32, torch.device(device))}
    return state


def _storages(state: Any) -> list[torch.UntypedStorage]:
    from gpu_offload.adapters import named_tensors

    seen: dict[int, torch.UntypedStorage] = {}
    for _, t in named_tensors(state):
        s = t.untyped_storage()
        seen.setdefault(s._cdata, s)
    return list(seen.values())


def _raw(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over a whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _bytes(state: Any) -> list[torch.Tensor]:
    return [_raw(s).cpu().clone() for s in _storages(state)]


def _clobber(state: Any) -> None:
    for s in _storages(state):
        _raw(s).fill_(0xA5)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values as bytes, for any strides (size-1 dims with odd strides included)."""
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())
    return dense.reshape(-1).view(torch.uint8)


def _assert_bytes(state: Any, expected: list[torch.Tensor]) -> None:
    got = _bytes(state)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", _DEVICES)
@FUZZ
@given(data=st.data())
def test_random_layouts_round_trip_bitwise(device, data):
    state = data.draw(targets(device))
    arena = go.Arena(min_slab_bytes=1 << 20)
    expected = _bytes(state)
    total = sum(e.numel() for e in expected)
    snap = go.snapshot(state, arena=arena, checksum=True)
    snap.verify()
    assert snap.nbytes == total
    _clobber(state)
    go.restore(state, snap, verify=True)
    _assert_bytes(state, expected)
    # Through a file and back.
    with tempfile.TemporaryDirectory() as tmp:
        go.save(snap, os.path.join(tmp, "s.snap"))
        loaded = go.load(os.path.join(tmp, "s.snap"), arena=arena)
    assert loaded.checksums == snap.checksums
    _clobber(state)
    go.restore(state, loaded, verify=True)
    _assert_bytes(state, expected)
    loaded.free()
    snap.free()
    # Offload and reload (a target with no bytes at all has nothing to offload: a clear error).
    if total == 0:
        with pytest.raises(go.OffloadError, match="nothing to offload"):
            go.offload(state, arena=arena)
    else:
        go.offload(state, arena=arena, include_grads=True)
        assert go.is_offloaded(state)
        assert all(s.nbytes() == 0 for s in _storages(state))
        go.reload(state)
        _assert_bytes(state, expected)
    assert arena.used_bytes == 0 and go.offloaded_bytes() == 0


def _invalid(kind: str, device: str) -> Any:
    if kind == "meta":
        return torch.empty(3, 4, device="meta")
    if kind == "sparse_coo":
        return torch.eye(4, device=device).to_sparse()
    if kind == "sparse_csr":
        return torch.eye(4, device=device).to_sparse_csr()
    return object()


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("device", _DEVICES)
@FUZZ
@given(data=st.data())
def test_unsupported_tensors_are_refused_before_anything_changes(device, data):
    state = data.draw(targets(device))
    kind = data.draw(st.sampled_from(INVALID))
    name = data.draw(st.sampled_from(["aaa", "zzz", "nested.bad"]))
    if name == "nested.bad":
        state["nested"] = {**state.get("nested", {}), "bad": _invalid(kind, device)}
    else:
        state[name] = _invalid(kind, device)
    arena = go.Arena(min_slab_bytes=1 << 20)
    good = go.snapshot({k: v for k, v in state.items() if k not in ("aaa", "zzz", "nested")}, arena=arena)
    used = arena.used_bytes
    expected = _bytes({k: v for k, v in state.items() if k not in ("aaa", "zzz", "nested")})
    for op in (lambda: go.snapshot(state, arena=arena, checksum=True), lambda: go.offload(state, arena=arena),
               lambda: go.restore(state, good, verify=False)):
        with pytest.raises(go.OffloadError, match="meta|strided|sparse|unsupported|expected a tensor"):
            op()
        assert arena.used_bytes == used and go.offloaded_bytes() == 0
        _assert_bytes({k: v for k, v in state.items() if k not in ("aaa", "zzz", "nested")}, expected)
    good.free()


@pytest.mark.parametrize("device", _DEVICES)
@FUZZ
@given(data=st.data())
def test_tensors_replaced_between_snapshot_and_restore(device, data):
    state = data.draw(targets(device))
    arena = go.Arena(min_slab_bytes=1 << 20)
    snap = go.snapshot(state, arena=arena, checksum=True)
    values = {k: v for k, v in snap.tensors().items()}
    flat = [k for k in state if k != "nested"]
    victim = data.draw(st.sampled_from(flat))
    old = state[victim]
    how = data.draw(st.sampled_from(["same", "fresh_like", "other_shape", "other_dtype", "param"]))
    if how == "fresh_like":  # same shape and dtype, its own storage (may break sharing with other views)
        state[victim] = torch.zeros_like(old.detach())
    elif how == "other_shape":
        state[victim] = torch.zeros(old.numel() + 1, dtype=old.dtype, device=old.device)
    elif how == "other_dtype":
        state[victim] = torch.zeros(old.shape, dtype=torch.float64 if old.dtype != torch.float64 else torch.int64,
                                    device=old.device)
    elif how == "param" and old.dtype in FLOATS:
        state[victim] = torch.nn.Parameter(torch.zeros_like(old.detach()))
    before = _bytes(state)
    used = arena.used_bytes
    try:
        go.restore(state, snap, verify=True)
    except go.LayoutMismatchError as exc:
        event(f"replaced ({how}): refused")
        assert victim in str(exc) or "share" in str(exc)
        _assert_bytes(state, before)  # nothing copied
    else:
        event(f"replaced ({how}): restored")
        from gpu_offload.adapters import named_tensors

        for name, t in named_tensors(state):
            got, want = t.detach(), values[name]
            assert got.shape == want.shape and got.dtype == want.dtype
            assert torch.equal(_flat_bytes(got), _flat_bytes(want)), name
    assert arena.used_bytes == used
    snap.free()
    values = want = None  # the views taken above keep the memory alive until they are gone
    assert arena.used_bytes == 0
