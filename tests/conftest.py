"""Shared fixtures: every engine test body runs on the CPU and, where a GPU answers, on CUDA."""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch

import gpu_offload as go

_MIB = 1 << 20


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
