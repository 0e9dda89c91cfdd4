"""Shared fixtures: every engine test body runs on the CPU and, where a GPU answers, on CUDA."""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch

import gpu_offload as go
from gpu_offload import torch_ext

_MIB = 1 << 20


def _cuda_ok() -> bool:
    return go.cuda_available() and torch.cuda.is_available()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> torch.device:
    if request.param == "cuda" and not _cuda_ok():
        pytest.skip("no CUDA device (or gpu_offload built without CUDA)")
    return torch.device(request.param)


@pytest.fixture
def arena() -> go.Arena:
    """A fresh arena per test with small slabs, so bookkeeping is visible and tests stay light."""
    return go.Arena(min_slab_bytes=4 * _MIB)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_ok():
        return
    skip = pytest.mark.skip(reason="no CUDA device (or gpu_offload built without CUDA)")
    for item in items:
        if "cuda" in item.keywords and "device" not in getattr(item, "fixturenames", ()):
            item.add_marker(skip)


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


@pytest.fixture(params=["helper", "python"])
def checks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Runs a test with the engine's per-call work done by the torch-aware helper (gpu_offload._torch_ext:
    target records, module traversals, batched resizes and watches), and again with the pure-Python path
    it takes where the helper is not loaded (GPU_OFFLOAD_TORCH_EXT=0)."""
    from gpu_offload import adapters, plan, registry

    if request.param == "helper" and torch_ext.ext is None:
        pytest.skip(f"gpu_offload._torch_ext {torch_ext.status()}")
    if request.param == "python":
        for module in (plan, registry, adapters):
            monkeypatch.setattr(module, "_ext", None)
    plan.clear_cache()
    yield request.param
    plan.clear_cache()


@pytest.fixture
def expect_cuda_build() -> bool | None:
    value = os.environ.get("GPU_OFFLOAD_EXPECT_CUDA_BUILD")
    return None if value is None else value == "1"


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


def inject_resize_failure(monkeypatch: pytest.MonkeyPatch, k: int, exc: type[BaseException],
                          when: Callable[[int], bool] = lambda size: True) -> dict[str, int]:
    """Makes the k-th storage resize (among those whose new size `when` selects) raise exc before it is
    done, whichever way the engine resizes: one storage per call (UntypedStorage.resize_) or many in one
    C++ call (the torch-aware helper's TargetRecord.resize_live; the storages before the k-th are resized
    then, as when its loop fails there)."""
    calls = inject_failure(monkeypatch, torch.UntypedStorage, "resize_", k, exc, when=lambda self, size: when(size))
    if torch_ext.ext is not None:
        patched_resize = torch.UntypedStorage.resize_  # counts and raises

        def resize_live(record: Any, tensors: list[torch.Tensor], release: bool) -> None:
            try:
                for first, nbytes in record.live():
                    patched_resize(tensors[first].untyped_storage(), 0 if release else nbytes)
            finally:
                record.refresh(tensors)  # the record follows its storages, as resize_live's own loop does

        monkeypatch.setattr(torch_ext.ext.TargetRecord, "resize_live", resize_live)
    return calls
