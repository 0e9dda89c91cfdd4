"""Cached copy plans.

For each target, which storages it has, their sizes, their places in the host region and the pointer
arrays handed to C++ are computed once (a TargetPlan) and reused while the target's tensors are the same
objects at the same addresses. A training loop that snapshots the same model every step then does, per
call, a few list operations over its tensors and one C++ call per device; any change (a parameter
replaced, a reload that moved a storage) is seen and the plan is rebuilt.

The cache holds no strong reference to tensors or storages: dropping a model drops its memory.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from ._bytes import parse_bytes
from ._errors import OffloadError
from ._ext import _C
from .storages import PLAIN_TENSOR_TYPES, Bound, Layout, bind, extent_problem, unwrap

_MAX_CACHED = 32


def device_index(device: torch.device) -> int:
    if device.type == "cpu":
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


class CopyPlans:
    """The copies for one target layout, one _C.CopyPlan per device."""

    def __init__(self, groups: list[tuple[int, Any]]) -> None:
        self.groups = groups  # (device index or -1, _C.CopyPlan)

    @property
    def num_copies(self) -> int:
        return sum(p.num_copies for _, p in self.groups)

    def run(self, to_host: bool, host_base: int, waits: Sequence[Any] = (), stream_waits: bool = True) -> list[Any]:
        """Runs every group; returns the device groups' completion events (host groups are done when this
        returns). Device groups are ordered after their current stream's pending work; the current stream
        waits for them unless stream_waits is False or a deferred_join() scope collects them instead."""
        events: list[Any] = []
        wait_list = [e for e in waits if e is not None]
        scope = _join_scope.get()
        for device, plan in self.groups:
            stream = torch.cuda.current_stream(device).cuda_stream if device >= 0 else 0
            event = plan.run(to_host, host_base, stream, wait_list, stream_waits and scope is None)
            if event is not None:
                events.append(event)
                if scope is not None and stream_waits:
                    scope.append(event)
        return events


# Events whose join into the current stream is deferred to the end of a deferred_join() scope.
_join_scope: "contextvars.ContextVar[Optional[list[Any]]]" = contextvars.ContextVar("gpu_offload_join", default=None)


def join(events: Sequence[Any]) -> None:
    """Makes each device's current stream wait (on the GPU) for the given copy events."""
    by_device: dict[int, list[Any]] = {}
    for e in events:
        if e is not None:
            by_device.setdefault(e.device, []).append(e)
    for device, evs in by_device.items():
        # An empty batch that waits for the events and that the current stream then waits for.
        _C.CopyPlan(device, [], [], []).run(True, 0, torch.cuda.current_stream(device).cuda_stream, evs, True)


@contextlib.contextmanager
def deferred_join() -> Iterator[None]:
    """Within the scope, copies do not make the current stream wait for them one by one; at its end the
    current streams wait for all of them at once. Lets a D2H and an H2D batch run together (swap)."""
    events: list[Any] = []
    token = _join_scope.set(events)
    try:
        yield
    finally:
        _join_scope.reset(token)
        join(events)


def build_copies(entries: Sequence[tuple[torch.device, int, int, int]]) -> CopyPlans:
    """Plans copies of (device, device pointer, host offset, nbytes) entries, grouped by device."""
    by_device: dict[int, tuple[list[int], list[int], list[int]]] = {}
    for device, ptr, offset, nbytes in entries:
        if nbytes == 0:
            continue
        ptrs, offsets, sizes = by_device.setdefault(device_index(device), ([], [], []))
        ptrs.append(ptr)
        offsets.append(offset)
        sizes.append(nbytes)
    if any(idx >= 0 for idx in by_device) and not _C.cuda_compiled():
        raise OffloadError("the target has CUDA tensors but gpu_offload was built without CUDA; "
                           "reinstall with nvcc available (GPU_OFFLOAD_CUDA=1)")
    gather = gather_max_bytes()
    return CopyPlans([(idx, _C.CopyPlan(idx, *arrays, gather)) for idx, arrays in sorted(by_device.items())])


def gather_max_bytes() -> int:
    """Storages up to this size go through the gather/scatter kernel instead of the copy engines (CUDA,
    pinned arena only). GPU_OFFLOAD_GATHER_MAX_BYTES; 0 (the default until it is tuned on a GPU) keeps
    every copy on the copy engines."""
    return parse_bytes(os.environ.get("GPU_OFFLOAD_GATHER_MAX_BYTES") or "0", "GPU_OFFLOAD_GATHER_MAX_BYTES")


class TargetPlan:
    """A target's layout and copy plans, valid while its tensors are the same objects at the same addresses."""

    def __init__(self, names: list[str], tensors: list[torch.Tensor], ptrs: list[int], bound: Bound) -> None:
        self.names = names
        # The cache key is the tensors' ids; when any of them dies its id may be reused, so the plan leaves
        # the cache then (the weakref callback) and a hit needs no identity check per tensor.
        key = tuple(map(id, tensors))
        self.key = key
        def forget(_: Any) -> None:
            _forget(key)

        self.refs = [weakref.ref(t, forget) for t in tensors]
        self.ptrs = ptrs
        self.layout: Layout = bound.layout
        self.keys = bound.keys
        self.storage_nbytes = [s.nbytes() for s in bound.storages]
        self.storage_ptrs = [s.data_ptr() for s in bound.storages]
        # One tensor index per storage, to reach the storage again without keeping it alive.
        first: dict[int, int] = {}
        for i, spec in enumerate(bound.layout.tensors):
            first.setdefault(spec.storage, i)
        self.first_tensor = [first[i] for i in range(len(bound.layout.storages))]
        self._copies: Optional[CopyPlans] = None
        self._remapped: dict[tuple[int, ...], CopyPlans] = {}
        self._lock = threading.Lock()

    def copies(self, host_offsets: Optional[list[int]] = None) -> CopyPlans:
        """Plans for the layout's own host offsets, or for other offsets (restoring another layout's
        snapshot); both cached."""
        specs = self.layout.storages
        if host_offsets is None or host_offsets == [s.host_offset for s in specs]:
            with self._lock:
                if self._copies is None:
                    self._copies = build_copies([(s.device, p, s.host_offset, s.nbytes)
                                                 for s, p in zip(specs, self.storage_ptrs)])
                return self._copies
        key = tuple(host_offsets)
        with self._lock:
            plans = self._remapped.get(key)
            if plans is None:
                plans = build_copies([(s.device, p, o, s.nbytes) for s, p, o in zip(specs, self.storage_ptrs, host_offsets)])
                self._remapped = {key: plans}  # keep one: a target is restored from a few layouts at most
            return plans


class Resolved:
    """A target read for one call: its plan, its tensors, and (lazily) its live storages."""

    def __init__(self, plan: TargetPlan, tensors: list[torch.Tensor], storages: Optional[list[torch.UntypedStorage]],
                 hit: bool) -> None:
        self.plan = plan
        self.tensors = tensors
        self._storages = storages
        self.hit = hit

    @property
    def layout(self) -> Layout:
        return self.plan.layout

    def storages(self) -> list[torch.UntypedStorage]:
        if self._storages is None:
            self._storages = _first_storages(self.plan, self.tensors)
        return self._storages


def _first_storages(plan: TargetPlan, plain: list[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The live storage of each planned storage, reached through the first tensor that views it."""
    return list(map(torch.Tensor.untyped_storage, [plain[i] for i in plan.first_tensor]))



def _plain(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors holding the data: wrapper subclasses (DTensor) replaced by their local shards. (A
    DTensor's own data_ptr() is 0 and its untyped_storage() describes no real memory.)"""
    if set(map(type, tensors)) <= PLAIN_TENSOR_TYPES:
        return tensors
    return [t if type(t) in PLAIN_TENSOR_TYPES else unwrap(t) for t in tensors]


_cache: "OrderedDict[tuple[int, ...], TargetPlan]" = OrderedDict()
_cache_lock = threading.Lock()
# Keys of plans one of whose tensors died (weakref callbacks, which may run inside any allocation, only
# append here; the cache itself is pruned at the next lookup, under the lock).
_dead_keys: list[tuple[int, ...]] = []


def _forget(key: tuple[int, ...]) -> None:
    _dead_keys.append(key)


def _prune() -> None:
    while _dead_keys:
        _cache.pop(_dead_keys.pop(), None)
_stats = {"hits": 0, "misses": 0}


def resolve(named: Sequence[tuple[str, torch.Tensor]], nbytes_of: Optional[dict[int, int]] = None,
            shard_info: Optional[Callable[[], Optional[str]]] = None) -> Resolved:
    """The target's plan, from the cache when its tensors are unchanged, else freshly bound.

    nbytes_of (used by reload) forces a fresh bind with storage sizes overridden by key. shard_info, called
    on a fresh bind only, gives the strategy's shard layout to record in the layout. Plans whose tensors
    reach past their storages are not cached (the caller reports them).
    """
    names, tensors = _split(named)
    try:
        plain: Optional[list[torch.Tensor]] = _plain(tensors)
        ptrs: Optional[list[int]] = list(map(torch.Tensor.data_ptr, plain))
    except Exception:  # not all tensors: bind() below says what is wrong
        plain = ptrs = None
    if nbytes_of is None and plain is not None:
        key = tuple(map(id, tensors))
        with _cache_lock:
            _prune()
            plan = _cache.get(key)
            if plan is not None:
                _cache.move_to_end(key)
        if plan is not None and plan.ptrs == ptrs and plan.names == names:
            # Same tensors at the same addresses; the storages must be the same ones with the same sizes
            # too (memory freed and re-allocated at the same address with another size is not the same).
            storages = _first_storages(plan, plain)
            if ([s._cdata for s in storages] == plan.keys
                    and list(map(torch.UntypedStorage.nbytes, storages)) == plan.storage_nbytes):
                _stats["hits"] += 1
                return Resolved(plan, plain, storages, True)
    bound = bind(named, nbytes_of)
    _stats["misses"] += 1
    plan = _new_plan(names, tensors, bound, shard_info, cache=nbytes_of is None)
    return Resolved(plan, _plain(tensors), bound.storages, False)


def remember(named: Sequence[tuple[str, torch.Tensor]], bound: Bound,
             shard_info: Optional[Callable[[], Optional[str]]] = None) -> None:
    """Caches the plan of a target whose storages were just (re)allocated (reload), so that the next call
    on it needs no fresh bind."""
    names, tensors = _split(named)
    _new_plan(names, tensors, bound, shard_info, cache=True)


def _split(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[str], list[torch.Tensor]]:
    names = getattr(named, "names", None)
    if names is not None:  # adapters.Named: already two lists
        return names, named.tensors  # type: ignore[attr-defined]
    return [n for n, _ in named], [t for _, t in named]


def _new_plan(names: list[str], tensors: list[torch.Tensor], bound: Bound,
              shard_info: Optional[Callable[[], Optional[str]]], cache: bool) -> TargetPlan:
    if shard_info is not None:
        info = shard_info()
        if info is not None:
            bound.layout = dataclasses.replace(bound.layout, shard_info=info)
    plan = TargetPlan(names, tensors, list(map(torch.Tensor.data_ptr, _plain(tensors))), bound)
    # Only live storages at real addresses, whose tensors all fit inside them, are worth remembering.
    if (cache and all(plan.storage_ptrs[i] or not s.nbytes for i, s in enumerate(bound.layout.storages))
            and all(st.nbytes() == s.nbytes for st, s in zip(bound.storages, bound.layout.storages))
            and extent_problem(bound.layout) is None):
        with _cache_lock:
            _prune()
            _cache[plan.key] = plan
            while len(_cache) > _MAX_CACHED:
                _cache.popitem(last=False)
    return plan


def cache_info() -> dict[str, int]:
    """Plans cached, and cache hits and misses since the start."""
    with _cache_lock:
        return {"num_plans": len(_cache), **_stats}


def clear_cache() -> None:
    with _cache_lock:
        _cache.clear()
