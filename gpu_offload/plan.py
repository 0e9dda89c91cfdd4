"""Cached copy plans.

For each target, which storages it has, their sizes, their places in the host region and the pointer
arrays handed to C++ are computed once (a TargetPlan) and reused while the target's tensors are the same
objects at the same addresses. A training loop that snapshots the same model every step then does, per
call, a few list operations over its tensors and one C++ call per device; any change (a parameter
replaced, a reload that moved a storage) is seen and the plan is rebuilt.

The cache holds no strong reference to tensors or storages: dropping a model drops its memory.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import itertools
import logging
import operator
import time
import weakref
from collections import OrderedDict
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from . import _fork, torch_ext
from ._errors import OffloadError
from ._ext import _C
from .arena import _env_int
from .storages import (PLAIN_TENSOR_TYPES, Bound, Layout, bind_lists, device_index, extent_problem, index_device,
                       regrowable, unwrap)
from .storages import split_named as _split

_MAX_CACHED = 32
_ext: Any = torch_ext.ext  # the torch-aware helper, or None (pure-Python checks)
logger = logging.getLogger("gpu_offload")


def current_stream(device: int) -> int:
    """The handle of `device`'s current stream, which the copies are ordered after (tests on the simulated
    driver point this at a simulated stream: the one place plan.py asks torch for a stream)."""
    return torch.cuda.current_stream(device).cuda_stream


class CopyPlans:
    """The copies for one target layout, one _C.CopyPlan per device."""

    def __init__(self, groups: list[tuple[int, Any]]) -> None:
        self.groups = groups  # (device index or -1, _C.CopyPlan)

    @property
    def num_copies(self) -> int:
        return sum(p.num_copies for _, p in self.groups)

    def run(self, to_host: bool, host_base: int, waits: Sequence[Any] = (), stream_waits: bool = True,
            record: Sequence[list[Any]] = ()) -> list[Any]:
        """Runs every group; returns the device groups' completion events (host groups are done when this
        returns). Device groups are ordered after their current stream's pending work; the current stream
        waits for them unless stream_waits is False or a deferred_join() scope collects them instead.

        record: lists (a region's pending events) that each event is appended to inside the C call that
        enqueues its batch, so that no interrupt can fall between a running copy and its record. When a
        device group fails or is interrupted without leaving an event, its engine streams are synchronized
        before the error propagates: whatever it enqueued has finished when the caller frees the region."""
        events: list[Any] = []
        wait_list = [e for e in waits if e is not None]
        scope = _join_scope.get()
        sinks = (events, *record) if scope is None or not stream_waits else (events, scope, *record)
        try:
            for device, plan in self.groups:
                count = len(events)
                stream = current_stream(device) if device >= 0 else 0
                try:
                    plan.run_into(sinks, to_host, host_base, stream, wait_list, stream_waits and scope is None)
                except BaseException:
                    if device >= 0 and len(events) == count:
                        _settle(device, to_host)  # nothing recorded: nothing of it may still run
                    raise
            return events
        except BaseException as exc:
            # A later device failed: the earlier devices' copies are running. Their events travel with the
            # error, so that the caller frees the region only after them (see enqueued()).
            if events:
                setattr(exc, _ENQUEUED, events)
            raise


def _settle(device: int, to_host: bool) -> None:
    try:
        synchronize_engine(device, to_host)
    except Exception as exc:  # the original error matters more; copy_batch has waited for its own batch
        logger.warning("could not synchronize the engine streams of device %d after a failed batch: %s", device, exc)


def synchronize_engine(device: int, to_host: bool) -> None:
    """Blocks until everything enqueued on the engine's streams of one direction on `device` (copy engine and
    gather kernel) has finished: the belt for a batch whose event was lost."""
    _C.engine_synchronize(device, to_host)


_ENQUEUED = "_gpu_offload_enqueued"


def enqueued(exc: BaseException) -> list[Any]:
    """The events of copies a failed CopyPlans.run had already enqueued on other devices (free the host
    region only once they have completed)."""
    return list(getattr(exc, _ENQUEUED, ()))


# The engine's copy streams as torch streams, per device: (D2H, H2D). Created once, on first use.
_copy_streams: dict[int, tuple[Any, Any]] = {}


def copy_stream(device: int, to_host: bool) -> Any:
    """The engine's copy-engine stream on `device` for one direction, as a torch.cuda.ExternalStream."""
    pair = _copy_streams.get(device)
    if pair is None:
        d2h, h2d = _C.engine_streams(device)[:2]
        pair = _copy_streams.setdefault(device, (torch.cuda.ExternalStream(d2h, device=device),
                                                 torch.cuda.ExternalStream(h2d, device=device)))
    return pair[0 if to_host else 1]


def mark_in_use(tensors: Sequence[torch.Tensor], to_host: bool) -> None:
    """Tells torch's caching allocator that copies of one direction, enqueued before this call, may still
    read (to_host) or write the storages of these CUDA tensors: a storage released after this is handed
    out again only once those copies have finished, whichever stream it was allocated on.

    The allocator otherwise hands a freed block straight back to the stream that allocated it, which may
    run ahead of the copy (offload under a side stream). One stream covers a batch's gather kernel too:
    the batch's copy-engine stream joins the kernel's stream before the batch completes."""
    for t in tensors:
        if t.is_cuda:
            t.record_stream(copy_stream(t.device.index, to_host))


def mark_live_in_use(resolved: "Resolved", to_host: bool) -> None:
    """mark_in_use() of a resolved target's live CUDA storages: one C++ pass where the helper recorded the
    target (over the storages `resolved.held` holds, where it holds them), else a record_stream per storage
    through one tensor viewing it. (Python's record_stream costs microseconds a call: for 65536 storages,
    more than the copy of their bytes.)"""
    cuda = [d.index for d in resolved.layout.devices if d.type == "cuda"]
    if not cuda:
        return
    record = resolved.plan.record
    if record is not None:
        streams = {}
        for index in cuda:
            stream = copy_stream(index, to_host)
            streams[index] = (stream.stream_id, stream.device_index, stream.device_type)
        record.record_streams_live(resolved.tensors, resolved.held, streams)
        return
    first, (_, nbytes, devices, _) = resolved.plan.first_tensor, resolved.layout.storage_columns
    mark_in_use([resolved.tensors[first[i]] for i, (n, d) in enumerate(zip(nbytes, devices)) if n and d >= 0],
                to_host)


def storage_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A byte tensor over a whole storage (what record_stream needs), without copying."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


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
        _C.CopyPlan(device, [], [], []).run(True, 0, current_stream(device), evs, True)


@contextlib.contextmanager
def deferred_join() -> Iterator[list[Any]]:
    """Within the scope, copies do not make the current stream wait for them one by one; at its end the
    current streams wait for all of them at once. Lets a D2H and an H2D batch run together (swap).

    Yields the list of events collected so far: join_now(events) makes the current streams wait for them
    before the scope ends (before anything reads what those copies write)."""
    events: list[Any] = []
    token = _join_scope.set(events)
    try:
        yield events
    finally:
        _join_scope.reset(token)
        join(events)


def join_now(events: list[Any]) -> None:
    """Within a deferred_join() scope: makes the current streams wait now for the events collected so far."""
    pending, events[:] = list(events), []
    join(pending)


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


# The H200's calibration (../shared/calibration/batchcopy-2026-11-30-h200.txt, the same 64 KiB-chunk kernel
# into mapped pinned memory): 65536 x 4 KiB D2H 52.5 GB/s through the kernel against 11.2 with one
# cudaMemcpyBatchAsync, 8192 x 64 KiB 52.5 against 42.1; LLM layouts 52.6 against 55.1 (large tensors
# belong to the copy engines). A copy engine pays about 0.4 us a copy there, 7% of a 256 KiB copy's time
# and 25% of a 64 KiB one's: the kernel takes what is at most 64 KiB until `gpu-offload bench
# --gather-sweep` on the H200 says where the two cross (benchmarks/gpu_check.sh sweeps it).
DEFAULT_GATHER_MAX_BYTES = 64 << 10


# A reload allocates its storages (torch's caching allocator: on a GPU after empty_cache(), cudaMalloc) and
# copies into them. In one step the link idles while the host allocates: on the H200 a reload of qwen1.5b
# took 73.2 ms where its restore took 65.8. In parts, the copies of one part run while the next is allocated:
# the first part this many bytes, each next one twice the last, at most RELOAD_MAX_PARTS (the last takes
# the rest). Not on the CPU, where a copy ends before the next part is allocated (tests turn it on there).
RELOAD_FIRST_PART_BYTES = 64 << 20
RELOAD_MAX_PARTS = 8
RELOAD_IN_PARTS_ON_CPU = False


def gather_max_bytes() -> int:
    """Storages up to this size go through the gather/scatter kernel instead of the copy engines (CUDA,
    pinned and mapped arena only): GPU_OFFLOAD_GATHER_MAX_BYTES, 64 KiB when unset; 0 keeps every copy on
    the copy engines."""
    value = _env_int("GPU_OFFLOAD_GATHER_MAX_BYTES")
    return DEFAULT_GATHER_MAX_BYTES if value is None else max(0, value)


_index_ints: list[int] = []


def _indices(n: int) -> list[int]:
    """[0, 1, 2, ...], at least n of them: the same int objects for every plan's index lists, so that a first
    call on a target of 65536 storages makes no int per storage for them (about 2 ms there). Grown, never
    changed in place (a list another thread is reading stays as it was)."""
    global _index_ints
    ints = _index_ints
    if len(ints) < n:
        ints = _index_ints = list(range(max(n, 2 * len(ints))))
    return ints  # (this call's own: another thread may have set a shorter one since)


class TargetPlan:
    """A target's layout and copy plans, valid while its tensors are the same objects at the same addresses.

    Checked on every call by `valid()`: with the torch-aware helper, one C++ pass over the tensors against
    a TargetRecord (the same objects, TensorImpls, storages, views, storage memory and sizes); without it,
    the per-tensor Python checks below."""

    def __init__(self, names: list[str], tensors: list[torch.Tensor], bound: Bound,
                 plain: Optional[list[torch.Tensor]] = None, like: Optional["TargetPlan"] = None) -> None:
        """like: a plan of the same layout (_rebound(): new tensor objects laid out the same way), whose
        per-storage lists made from the layout alone are shared instead of made again."""
        self.names = names
        self.layout: Layout = bound.layout
        # The storages' keys; None: the record's, read when first asked for (see keys).
        self._keys: Optional[list[int]] = bound.keys_read
        _, layout_nbytes, devices, self.host_offsets = bound.layout.storage_columns
        # The helper's record of plain targets (exact Tensor/Parameter): it checks identity itself, so the
        # cache key needs only the count and the two ends. The C++ bind made one as it read the target.
        self.record: Any = None
        self._storage_ptrs: Optional[list[int]] = None
        plain = plain if plain is not None else _plain(tensors)
        # (A record is of the plain tensors: a DTensor's local shard, whose own storage holds its data.)
        if bound.record is not None and plain and bound.record.num_tensors == len(plain):
            self.record = bound.record
            self.storage_nbytes = layout_nbytes  # (what it read)
        else:
            if self._keys is None:
                self._keys = bound.keys
            self.storage_nbytes = [s.nbytes() for s in bound.storages]
            self._storage_ptrs = data_ptrs(bound.storages)
            if _ext is not None and plain:
                record = _ext.record(plain)
                # (It reads what bind() read, or the plan is not one to record.)
                if (record is not None and record.keys() == self.keys
                        and record.storage_nbytes() == self.storage_nbytes == layout_nbytes):
                    self.record = record
        self.ptrs: Optional[list[int]] = None
        if self.record is not None:
            self.key: tuple[Any, ...] = ("record", len(plain), id(plain[0]), id(plain[-1]))
        else:
            # The cache key is the tensors' ids; when any of them dies its id may be reused, so the plan
            # leaves the cache then (the weakref callback) and a hit needs no identity check per tensor.
            self.key = tuple(map(id, plain))
            self.ptrs = data_ptrs(plain)
        key, me = self.key, weakref.ref(self)
        fired: list[bool] = []

        def forget(_: Any) -> None:
            # Once per plan, not once per tensor: pruning hashes the key, a tuple as long as the target.
            if not fired:
                fired.append(True)
                _forget(key, me)

        # With a record, identity is checked in C++: weak references to the first storage and to the last
        # tensor's drop the plan of a dead target promptly (a plan whose other tensors died is merely never
        # valid; the last ones are a target's gradients, new tensors after each backward), and the tensors
        # carry none (torch.utils.swap_tensors refuses tensors that have one).
        if self.record is not None:
            first = bound.storage(0)
            self.refs = [weakref.ref(first, forget)]
            last = plain[-1].untyped_storage()
            if last._cdata != first._cdata:
                self.refs.append(weakref.ref(last, forget))
        else:
            self.refs = [weakref.ref(t, forget) for t in plain]
        self._views: Optional[_ViewCheck] = None  # made at the first hit
        # One tensor index per storage, to reach the storage again without keeping it alive.
        if bound.first_tensor is not None:
            self.first_tensor = bound.first_tensor
        elif self.record is not None:
            self.first_tensor = self.record.first_tensor()
        else:
            first: dict[int, int] = {}
            for i, storage in enumerate(bound.layout.tensor_columns()[0]):
                first.setdefault(storage, i)
            self.first_tensor = [first[i] for i in range(bound.layout.num_storages)]
        # The storages that hold memory (an offload releases these), and the copies' device groups.
        same = like is not None and like.layout is bound.layout  # (what depends on the layout alone is shared)
        if same:
            self.live, self._groups = like.live, like._groups
        else:
            self.live = list(itertools.compress(_indices(len(layout_nbytes)), layout_nbytes))
            if len(bound.layout.devices) == 1:  # (the layout's own, counted once and kept)
                groups = {devices[0]: self.live} if self.live else {}
            else:
                groups = {}
                for i in self.live:
                    groups.setdefault(devices[i], []).append(i)
            whole = len(groups) == 1 and len(self.live) == len(layout_nbytes)
            self._groups = [(d, None if whole else idx) for d, idx in sorted(groups.items())]
        self._sizes = layout_nbytes
        # In memory only (never saved): each DTensor's spec (mesh, placements, global shape), so that a
        # snapshot's host copies can be wrapped again as DTensors for torch.distributed.checkpoint. Read at
        # the first snapshot through the plan (dtensor_specs()): an offload never needs them.
        self._dtensor_specs: Optional[dict[str, Any]] = {} if plain is tensors else None
        # The wrappers' own identities (the checks are of their local tensors): a plan of DTensors is valid only
        # for those very DTensors (their specs are the plan's), and a plan of plain tensors only for them.
        self.wrapper_ids: Any = None if plain is tensors else _ids(tensors)
        self._copies: Optional[CopyPlans] = None
        self._rebase_from: Optional[CopyPlans] = None
        self._remapped: dict[tuple[int, ...], CopyPlans] = {}
        self._split: dict[tuple[int, ...], tuple[CopyPlans, CopyPlans]] = {}
        # reload_parts()'s answer (keyed by what it depends on), and each part's copies as last built.
        self._parts: Optional[tuple[tuple[int, int], Optional[list[tuple[int, int]]]]] = None
        self._part_copies: dict[tuple[int, int, int], Any] = {}
        self._lock = _fork.new_lock()
        self._live_columns: Optional[tuple[list[int], list[int], list[Any], list[int], list[str]]] = None
        # The last plan none of whose storages is one of this plan's live ones (see apart_from).
        self._apart_from: Optional["weakref.ref[TargetPlan]"] = None
        # Their sizes, devices, host offsets and names alone, and the refusal messages made for them by kind
        # (the layout's: shared by plans of one layout, see _rebound).
        self._live_layout: Optional[tuple[list[int], list[Any], list[int], list[str]]] = (
            like._live_layout if same else None)
        self._layout_messages: dict[str, list[str]] = like._layout_messages if same else {}
        # The registry's OffloadedSet while an offload through this plan has released its storages (reload
        # then goes through it), and the registry generation this plan was last found clear of (api).
        self._offloaded: Any = None
        self.clear_of: int = -1
        # Its live storages were released by an offload through it (refresh()): only offload's own
        # bookkeeping (reload, is_offloaded, refusing an offloaded target) may use it then.
        self.released = False
        # The messages its live storages refuse access with while offloaded (made at the first offload).
        self.refusals: Optional[list[str]] = None
        # A plan of gradients: the registry set of an offload(grads="drop") that released them through it,
        # until the reload that grows them again (api).
        self.dropped: Any = None
        # Made by _rebound() for new tensor objects on the storages of the plan it took the layout of.
        self.alias = False

    def dtensor_specs(self, wrapped: list[torch.Tensor]) -> dict[str, Any]:
        """Each DTensor's spec by name, read once (`wrapped`: the plan's tensors as the target gives them, the very
        wrappers it is valid for)."""
        specs = self._dtensor_specs
        if specs is None:
            # (The helper reads the slots in one pass: 0.6 us a DTensor in Python, the first snapshot's largest
            # Python pass over an FSDP2 model.)
            found = (_ext.wrapper_slots(self.names, wrapped, "_spec")
                     if _ext is not None and type(self.names) is list and type(wrapped) is list else None)
            if found is None:
                found = {n: t._spec for n, t in zip(self.names, wrapped)
                         if type(t) not in PLAIN_TENSOR_TYPES and hasattr(t, "_spec")}
            specs = self._dtensor_specs = found
        return specs

    def live_columns(self) -> tuple[list[int], list[int], list[Any], list[int], list[str]]:
        """Keys, sizes, devices, host offsets and names of the storages that hold memory (made once; shared,
        never to be changed)."""
        if self._live_columns is None:
            names, nbytes, devices, hosts = self.layout.storage_columns
            live, keys = self.live, self.keys
            if len(live) == len(nbytes):  # (every storage holds memory: the columns as they are)
                pick: Callable[[list[Any]], Any] = lambda xs: xs
            else:
                pick = operator.itemgetter(*live) if len(live) > 1 else (lambda xs: tuple(xs[i] for i in live))
            if self._live_layout is None:
                self._live_layout = (list(pick(nbytes)), _devices_of(pick(devices)), list(pick(hosts)),
                                     list(pick(names)))
            self._live_columns = (list(pick(keys)), *self._live_layout)
        return self._live_columns

    def messages(self, kind: str, make: Callable[[list[str]], list[str]]) -> list[str]:
        """The refusal messages of one kind for the live storages, make(names) of their names, made once for
        all plans of this layout (a target's next gradients find them made). Shared: never to be changed."""
        found = self._layout_messages.get(kind)
        if found is None:
            found = self._layout_messages[kind] = make(self.live_columns()[4])
        return found

    def all_resizable(self, resolved: "Resolved") -> Optional[str]:
        """None when every storage holding memory is resizable, else the name of the first that is not."""
        if self.record is not None and self.record.all_resizable:
            return None
        storages = resolved.storages()
        for i in self.live:
            if not regrowable(storages[i]):
                return self.layout.storage_columns[0][i]
        return None

    def valid(self, names: list[str], tensors: list[torch.Tensor], bump: bool = False) -> bool:
        """Whether the target read now is still this plan's: the same names, the same tensor objects, each
        on the same storage viewing it the same way, each storage at the same address with the same size
        (memory freed and re-allocated at the same address with another size is not the same).

        bump: where it is, every tensor's version is then bumped (increment_version), in the check's own
        pass where the helper recorded the plan. `tensors`: the plain ones (_plain's), as plans are of them."""
        if not self._same_names(names):
            return False
        if self.record is not None:
            return bool(self.record.check(tensors, bump))
        plain = tensors  # (the cache key, found by lookup(), was these tensors' ids)
        if self.ptrs != data_ptrs(plain):
            return False
        if not self.same_views(plain):
            return False
        storages = _first_storages(self, plain)
        ok = ([s._cdata for s in storages] == self.keys
              and list(map(torch.UntypedStorage.nbytes, storages)) == self.storage_nbytes)
        if ok and bump:
            increment_version(plain)
        return ok

    def valid_held(self, names: list[str], tensors: list[torch.Tensor]) -> Any:
        """valid() of a recorded plan, answered with the live storages it checked held (a HeldStorages, for
        the resize and watch of an offload or reload: they then need not reach them again), or None where
        valid() would be false."""
        return self.record.check_held(tensors) if self._same_names(names) else None

    def _same_names(self, names: list[str]) -> bool:
        return self.names is names or self.names == names

    def apart_from(self, other: "TargetPlan") -> bool:
        """Whether no live storage of this plan is one of `other`'s. Both plans' keys are fixed for their lives,
        so the answer is kept for the last `other` found apart: an offload(grads="drop") asks it of the
        gradients' plan and the state's every cycle, a set of one key per storage made each time."""
        ref = self._apart_from
        if ref is not None and ref() is other:
            return True
        apart = set(other.keys).isdisjoint(self.live_columns()[0])
        if apart:
            self._apart_from = weakref.ref(other)
        return apart

    @property
    def keys(self) -> list[int]:
        """Each storage's key (its StorageImpl's address), in the layout's storage order."""
        if self._keys is None:
            self._keys = self.record.keys()
        return self._keys

    @property
    def storage_ptrs(self) -> list[int]:
        """Each storage's data pointer (read again from the record after a resize)."""
        ptrs = self._storage_ptrs
        if ptrs is None:
            ptrs = self._storage_ptrs = self.record.storage_data_ptrs()
        return ptrs

    @property
    def offloaded(self) -> Any:
        """The registry's OffloadedSet of the offload through this plan, while it is alive (a weak
        reference: the registry owns it, and a set it dropped takes its region with it)."""
        ref = self._offloaded
        return ref() if ref is not None else None

    @offloaded.setter
    def offloaded(self, value: Any) -> None:
        self._offloaded = weakref.ref(value) if value is not None else None

    @property
    def resizes_in_one_pass(self) -> bool:
        """Whether resize() is one C++ pass (the helper recorded the target, every storage a CPU or CUDA one)."""
        # (A record admits only CPU and CUDA tensors, and a storage's device never changes.)
        return self.record is not None

    def watch(self, resolved: "Resolved") -> Any:
        """A StorageWatch over the live storages (the helper's, from the record), or None."""
        if self.record is None:
            return None
        return self.record.watch_live(resolved.tensors, resolved.held)

    def refresh(self, tensors: list[torch.Tensor], released: bool) -> None:
        """Re-reads the storages' addresses and sizes after the caller resized them (offload: `released`,
        reload), so the plan stays valid for the target as it is now. The copy plans follow the new
        addresses."""
        self.released = released
        if self.record is not None:
            if not self.record.refresh(tensors):
                raise OffloadError("internal error: refreshing a plan with tensors that are not its own")
            self._storage_ptrs = None  # (storage_nbytes: only the Python check reads it)
        else:
            plain = _plain(tensors)
            self.ptrs = data_ptrs(plain)
            storages = _first_storages(self, plain)
            self._storage_ptrs = data_ptrs(storages)
            self.storage_nbytes = list(map(torch.UntypedStorage.nbytes, storages))
        self._forget_copies()

    def _forget_copies(self) -> None:
        with self._lock:
            if self._copies is not None:
                self._rebase_from = self._copies  # (the same copies at the storages' new addresses, next)
            self._copies = None
            self._remapped = {}
            self._split = {}

    def same_views(self, plain: list[torch.Tensor]) -> bool:
        """Whether every tensor still views its storage as the layout says (shape, stride, dtype).

        t_(), `.data = .view(dtype)` or `.data = .data[:5]` keep the tensor, its address and its storage but
        not its view. (The offset needs no check of its own: with the same storage at the same address, the
        same data_ptr and the same dtype it cannot differ.)
        """
        views = self._views
        if views is None:
            if not _views_match(self.layout, plain):
                return False
            self._views = views = _ViewCheck(plain)
            return True
        return views.check(plain) or _views_match(self.layout, plain)

    def copies(self, host_offsets: Optional[list[int]] = None) -> CopyPlans:
        """Plans for the layout's own host offsets, or for other offsets (restoring another layout's
        snapshot); both cached."""
        if host_offsets is None or host_offsets is self.host_offsets or host_offsets == self.host_offsets:
            with self._lock:
                if self._copies is None:
                    self._copies = self._rebased() or self._build(self.host_offsets)
                return self._copies
        key = tuple(host_offsets)
        with self._lock:
            plans = self._remapped.get(key)
            if plans is None:
                plans = self._build(host_offsets)
                self._remapped = {key: plans}  # keep one: a target is restored from a few layouts at most
            return plans

    def overlap_copies(self, waited: tuple[int, ...]) -> tuple[CopyPlans, Optional[CopyPlans]]:
        """For snapshot(overlap=True): the plans of the storages later work may run beside, and of those
        (by index: module buffers a forward writes in place) that later work must wait for; None when
        there are none. Both cached."""
        if not waited:
            return self.copies(), None
        with self._lock:
            split = self._split.get(waited)
            if split is None:
                specs, chosen = self.layout.storages, set(waited)
                entries = [(s.device, p, s.host_offset, s.nbytes) for s, p in zip(specs, self.storage_ptrs)]
                split = (build_copies([e for i, e in enumerate(entries) if i not in chosen]),
                         build_copies([entries[i] for i in waited]))
                self._split = {waited: split}  # one: the buffers of a target do not change from call to call
            return split

    def reload_parts(self) -> Optional[list[tuple[int, int]]]:
        """The parts a reload through this plan allocates and enqueues one after the other, as ranges
        [begin, end) of the live storages, or None for one step. Only a recorded plan of one CUDA device
        (RELOAD_IN_PARTS_ON_CPU: of the CPU too) whose live bytes are more than twice RELOAD_FIRST_PART_BYTES.
        See RELOAD_FIRST_PART_BYTES."""
        first = RELOAD_FIRST_PART_BYTES
        if (self.record is None or len(self._groups) != 1
                or (self._groups[0][0] < 0 and not RELOAD_IN_PARTS_ON_CPU)):
            return None
        key = (first, RELOAD_MAX_PARTS)
        cached = self._parts
        if cached is not None and cached[0] == key:
            return cached[1]
        sizes, live = self._sizes, self.live
        parts: Optional[list[tuple[int, int]]] = None
        if sum(sizes[i] for i in live) > 2 * first:
            parts, begin, filled, want = [], 0, 0, first
            for k, i in enumerate(live):
                filled += sizes[i]
                if filled >= want and len(parts) < RELOAD_MAX_PARTS - 1 and k + 1 < len(live):
                    parts.append((begin, k + 1))
                    begin, filled, want = k + 1, 0, want * 2
            parts.append((begin, len(live)))
            if len(parts) == 1:
                parts = None
        self._parts = (key, parts)
        return parts

    def part_copies(self, begin: int, end: int) -> CopyPlans:
        """The copies of the live storages [begin, end) (a part of reload_parts()) at their addresses now;
        each part's plan is kept and only its device addresses are replaced at the next reload."""
        device = self._groups[0][0]
        live = self.live
        a, b = live[begin], live[end - 1] + 1  # (the storages between are not live: they copy nothing)
        ptrs = self.record.storage_data_ptrs_bytes()[8 * a:8 * b]
        gather = gather_max_bytes() if device >= 0 else 0
        key = (a, b, gather)
        with self._lock:
            base = self._part_copies.get(key)
        if base is not None:
            return CopyPlans([(device, base.with_device_ptrs(ptrs))])
        made = _C.CopyPlan(device, ptrs, self.host_offsets[a:b], self._sizes[a:b], gather)
        with self._lock:
            self._part_copies[key] = made
        return CopyPlans([(device, made)])

    def _rebased(self) -> Optional[CopyPlans]:
        """The plans last built for the layout's own offsets, at the storages' new addresses (after a resize:
        only the pointers change), or None. For a recorded target of one device whose storages all hold
        memory: the addresses go from the record to the plan as one buffer, not a Python int each."""
        old, self._rebase_from = self._rebase_from, None
        if (old is None or self.record is None or len(old.groups) != 1 or self._groups[0][1] is not None
                or old.groups[0][1].gather_max_bytes != (gather_max_bytes() if self._groups[0][0] >= 0 else 0)):
            return None
        device, copy_plan = old.groups[0]
        return CopyPlans([(device, copy_plan.with_device_ptrs(self.record.storage_data_ptrs_bytes()))])

    def _build(self, host_offsets: list[int]) -> CopyPlans:
        # From the per-storage lists, without a tuple per storage (a target of one device whose storages
        # all hold memory passes them as they are).
        if any(d >= 0 for d, _ in self._groups) and not _C.cuda_compiled():
            raise OffloadError("the target has CUDA tensors but gpu_offload was built without CUDA; "
                               "reinstall with nvcc available (GPU_OFFLOAD_CUDA=1)")
        gather = gather_max_bytes()
        sizes, groups = self._sizes, []
        for device, idx in self._groups:
            if idx is None:
                # A record's addresses as one buffer (current: the record follows its storages' resizes).
                ptrs = self.record.storage_data_ptrs_bytes() if self.record is not None else self.storage_ptrs
                groups.append((device, _C.CopyPlan(device, ptrs, host_offsets, sizes, gather)))
            else:
                ptrs = self.storage_ptrs
                groups.append((device, _C.CopyPlan(device, [ptrs[i] for i in idx], [host_offsets[i] for i in idx],
                                                   [sizes[i] for i in idx], gather)))
        return CopyPlans(groups)


class Resolved:
    """A target read for one call: its plan, its tensors, and (lazily) its live storages."""

    def __init__(self, plan: TargetPlan, tensors: list[torch.Tensor], storages: Optional[list[torch.UntypedStorage]],
                 hit: bool, held: Any = None, bumped: bool = False,
                 wrapped: Optional[list[torch.Tensor]] = None) -> None:
        self.plan = plan
        self.tensors = tensors  # (plain: a DTensor's local tensor)
        self.wrapped = wrapped if wrapped is not None else tensors  # (as the target gives them)
        self._storages = storages
        self.hit = hit
        # The live storages as the check found them, held for this call's resize and watch (resolve(hold=True)
        # of a recorded target), or None.
        self.held = held
        # Whether the check bumped every tensor's version (resolve(bump_if=...) of a plan it accepted).
        self.bumped = bumped

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


def data_ptrs(items: Sequence[Any]) -> list[int]:
    """data_ptr() of each tensor or storage; 0 for one whose storage refuses access (offloaded: it holds no
    memory, and a null pointer is what it would give without the refusal)."""
    if _ext is not None and type(items) is list:  # (one C++ pass: no exception per offloaded item)
        found = _ext.data_ptrs_or_zero(items)
        if found is not None:
            return found
    try:
        return [x.data_ptr() for x in items]
    except RuntimeError:
        if not torch_ext.access_guard_available():
            raise
    out = []
    for x in items:
        try:
            out.append(x.data_ptr())
        except RuntimeError:
            if not torch_ext.access_refused(x):
                raise
            out.append(0)
    return out


def _plain(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors holding the data: wrapper subclasses (DTensor) replaced by their local shards (one C++
    pass where the helper is loaded); the list itself where all are plain. (A DTensor's own data_ptr() is 0
    and its untyped_storage() describes no real memory.)"""
    if _ext is not None and type(tensors) is list:
        found = _ext.local_tensors(tensors)
        if found is not None:
            return found
    if set(map(type, tensors)) <= PLAIN_TENSOR_TYPES:
        return tensors
    return [t if type(t) in PLAIN_TENSOR_TYPES else unwrap(t) for t in tensors]


def _devices_of(indices: Sequence[int]) -> list[torch.device]:
    """index_device() of each index, each distinct index converted once (a target has one or a few)."""
    distinct = set(indices)
    if len(distinct) == 1:
        return [index_device(next(iter(distinct)))] * len(indices)
    return list(map(index_device, indices))


def _ids(tensors: list[torch.Tensor]) -> Any:
    """The objects' identities, comparable with ==: in one C++ pass where the helper is loaded."""
    return _ext.object_ids(tensors) if _ext is not None and type(tensors) is list else tuple(map(id, tensors))


def _same_wrappers(plan: "TargetPlan", tensors: list[torch.Tensor], plain: list[torch.Tensor]) -> bool:
    """Whether the tensors wrap their local ones as the plan's did: none of them (plain ones), or the very
    wrapper objects it was made of."""
    if plan.wrapper_ids is None:
        return plain is tensors
    return plain is not tensors and _ids(tensors) == plan.wrapper_ids


_shape_of = operator.attrgetter("shape")  # the attribute is cheaper than the size() call
_dtype_of = operator.attrgetter("dtype")


def _views_match(layout: Layout, plain: list[torch.Tensor]) -> bool:
    """Shapes, dtypes and strides of the tensors against the layout's (about 0.35 us per tensor)."""
    _, _, shapes, strides, dtypes = layout.tensor_columns()
    return (list(map(_shape_of, plain)) == shapes
            and list(map(_dtype_of, plain)) == dtypes
            and list(map(torch.Tensor.stride, plain)) == strides
            # `.data = t.conj()`: the same view but a conjugate (or negative) bit, which bind() refuses.
            # (The C++ guard sees the bits as part of the dispatch keys.)
            and not any(map(torch.Tensor.is_conj, plain)) and not any(map(torch.Tensor.is_neg, plain)))


try:  # torch.compile's guard on tensors: the same check in C++, about 3 times faster
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except Exception:  # pragma: no cover - another torch
    _TensorGuards = None


def _make_guards(plain: list[torch.Tensor]) -> Any:
    return _TensorGuards(*plain, tensor_check_names=[str(i) for i in range(len(plain))],
                         dynamic_dims_sizes=[list(t.shape) for t in plain],
                         dynamic_dims_strides=[list(t.stride()) for t in plain])


def _guards_self_test() -> bool:
    """Whether this torch's TensorGuards (a private API) takes these arguments and sees the changes that
    matter here; run once, at import (outside any mode a caller may be in). Otherwise the plain check
    above is used alone."""
    if _TensorGuards is None:
        return False
    try:
        a, b = torch.zeros(2, 3), torch.zeros(6)
        guards = _make_guards([a, b])
        ok = bool(guards.check(a, b))
        a.t_()
        ok = ok and not guards.check(a, b)
        a.t_()
        b.data = b.data.view(torch.int32)
        ok = ok and not guards.check(a, b)
        b.data = b.data.view(torch.float32)[:5]
        return ok and not guards.check(a, b)
    except Exception:
        return False


_guards_ok = _guards_self_test()


class _ViewCheck:
    """The views of a plan's tensors as they were at its first hit. check() may answer False where nothing
    changed (the guard also sees requires_grad and the thread's dispatch state); the caller then falls back
    to _views_match. It never answers True after a change of shape, stride or dtype."""

    __slots__ = ("_guards",)

    def __init__(self, plain: list[torch.Tensor]) -> None:
        self._guards = None
        if plain and _guards_ok:
            try:
                self._guards = _make_guards(plain)
            except Exception:
                self._guards = None

    def check(self, plain: list[torch.Tensor]) -> bool:
        if self._guards is None:
            return False
        try:
            return bool(self._guards.check(*plain))
        except Exception:
            return False


_cache: "OrderedDict[tuple[Any, ...], TargetPlan]" = OrderedDict()
_cache_lock = _fork.new_lock()
# Keys of plans one of whose tensors died (weakref callbacks, which may run inside any allocation, only
# append here; the cache itself is pruned at the next lookup, under the lock).
_dead_keys: list[tuple[tuple[Any, ...], "weakref.ref[TargetPlan]"]] = []


def _forget(key: tuple[Any, ...], plan: "weakref.ref[TargetPlan]") -> None:
    _dead_keys.append((key, plan))


def _prune() -> None:
    # Only the plan whose tensor died: its key (ids) may already be another plan's, of new tensors at the
    # dead ones' ids, when the callback runs late (a collected cycle).
    while _dead_keys:
        key, ref = _dead_keys.pop()
        plan = ref()
        if plan is not None and _cache.get(key) is plan:
            _cache.pop(key, None)
            if plan.record is not None:
                _retired.append(plan)  # (its layout may serve the target's next tensors: _rebound())


# The last few recorded plans pruned because a tensor of theirs died (a target's gradients after the next
# backward, the detached tensors of a state_dict() after the call): never valid again, kept only for their
# layouts, which _rebound() gives to new tensors laid out the same way under the same names.
_retired: "collections.deque[TargetPlan]" = collections.deque(maxlen=4)


_stats = {"hits": 0, "misses": 0, "rebound": 0}


def resolve(named: Sequence[tuple[str, torch.Tensor]], nbytes_of: Optional[dict[int, int]] = None,
            shard_info: Optional[Callable[[], Optional[str]]] = None, hold: bool = False,
            bump_if: Optional[Callable[[TargetPlan], bool]] = None) -> Resolved:
    """The target's plan, from the cache when its tensors are unchanged, else freshly bound.

    nbytes_of (used by reload) forces a fresh bind with storage sizes overridden by key. shard_info, called
    on a fresh bind only, gives the strategy's shard layout to record in the layout. Plans whose tensors
    reach past their storages are not cached (the caller reports them). hold: a cache hit of a recorded
    target holds its live storages for the call's resize (Resolved.held). bump_if: asked of a cached plan
    before its check; True: the check also bumps every tensor's version once all passed (Resolved.bumped;
    not with hold), for a caller that writes them all unless it fails before (so it asks only where it
    cannot fail then).
    """
    names, tensors = _split(named)
    plain = None
    if nbytes_of is None:
        plan, held, bumped, plain = _lookup(names, tensors, hold, bump_if=bump_if)
        # A plan an offload released is used only to say so (it is registered through it); otherwise the
        # storages were emptied some other way (discard) and a fresh bind says what is wrong.
        if plan is not None and (not plan.released or plan.offloaded is not None):
            return Resolved(plan, plain, None, True, held, bumped, wrapped=tensors)
    if plain is None:
        plain = _plain(tensors)
    start = time.perf_counter()
    _stats["misses"] += 1
    if nbytes_of is None:
        plan = _rebound(names, tensors, plain, shard_info)
        if plan is not None:
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("plan: a new or changed target of %d tensors recorded in %.3f ms, laid out as a cached "
                             "plan's under the same names (its layout reused; the next call on it is cached)",
                             len(tensors), (time.perf_counter() - start) * 1e3)
            return Resolved(plan, plain, None, False, wrapped=tensors)
    # (Bound as their local tensors: the layout is the same, and the helper's bind records plain tensors only.)
    bound = bind_lists(names, plain, nbytes_of, distinct=getattr(named, "distinct", False))
    plan = _new_plan(names, tensors, bound, shard_info, cache=nbytes_of is None, plain=plain)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("plan: %s target of %d tensors, %d storages read in %.3f ms (the next call on it is cached)",
                     "a new or changed" if nbytes_of is None else "an offloaded", len(tensors),
                     bound.layout.num_storages, (time.perf_counter() - start) * 1e3)
    return Resolved(plan, plain, bound.storages_read, False, wrapped=tensors)


def lookup(names: list[str], tensors: list[torch.Tensor]) -> Optional[TargetPlan]:
    """The cached plan that is still valid for these tensors under these names, or None (a cache hit is
    counted)."""
    return _lookup(names, tensors, False)[0]


def _lookup(names: list[str], tensors: list[torch.Tensor], hold: bool,
            accept: Optional[Callable[[TargetPlan], bool]] = None,
            bump_if: Optional[Callable[[TargetPlan], bool]] = None
            ) -> tuple[Optional[TargetPlan], Any, bool, Optional[list[torch.Tensor]]]:
    """lookup(), with the live storages its check held where `hold` (else None), whether it bumped the
    tensors' versions (a plan `bump_if` accepts, resolve()'s) and _plain(tensors) where it made it (else
    None; plans are of the local tensors); a plan that `accept` refuses is not checked (None)."""
    tried = None
    if _ext is not None and tensors:
        # First with the tensors as given: a recorded plan of plain tensors checks each object and its exact
        # type against the recorded ones, which were plain, so a hit proves _plain(tensors) is `tensors` and
        # its pass (0.4 ms for 65536 tensors) is not made. A plan of wrappers, a miss: the pass, then again.
        with _cache_lock:
            _prune()
            tried = _cache.get(("record", len(tensors), id(tensors[0]), id(tensors[-1])))
        if tried is not None and tried.wrapper_ids is None:
            plan, held, bump = _checked(tried, names, tensors, tensors, hold, accept, bump_if)
            if plan is not None:
                return plan, held, bump, tensors
    wrapped = tensors
    tensors = _plain(tensors)
    candidates = []
    if _ext is not None and tensors:
        candidates.append(("record", len(tensors), id(tensors[0]), id(tensors[-1])))
    with _cache_lock:
        _prune()
        plan = _cache.get(candidates[0]) if candidates else None
        # Keyed by their tensors' ids: the plans the helper did not record. With none cached, a miss makes
        # no key as long as the target.
        by_ids = plan is None and any(k[:1] != ("record",) for k in _cache)
    if by_ids:
        try:
            key = tuple(map(id, tensors))
        except TypeError:
            return None, None, False, tensors
        with _cache_lock:
            plan = _cache.get(key)
    if plan is None or (plan is tried and tensors is wrapped):  # (that one was checked with these above)
        return None, None, False, tensors
    return (*_checked(plan, names, wrapped, tensors, hold, accept, bump_if), tensors)


def _checked(plan: TargetPlan, names: list[str], wrapped: list[torch.Tensor], tensors: list[torch.Tensor], hold: bool,
             accept: Optional[Callable[[TargetPlan], bool]],
             bump_if: Optional[Callable[[TargetPlan], bool]]) -> tuple[Optional[TargetPlan], Any, bool]:
    """_lookup()'s check of a plan found for the tensors (`wrapped` as given, `tensors` their plain ones):
    (plan, held, bumped) where it is still valid (a hit counted), else (None, None, False)."""
    if (accept is not None and not accept(plan)) or not _same_wrappers(plan, wrapped, tensors):
        return None, None, False
    held = None
    bump = not hold and bump_if is not None and bump_if(plan)
    try:
        if hold and plan.record is not None:
            held = plan.valid_held(names, tensors)
            ok = held is not None
        else:
            ok = plan.valid(names, tensors, bump)
    except Exception:  # not all tensors: bind() says what is wrong
        return None, None, False
    if not ok:
        return None, None, False
    with _cache_lock:
        if _cache.get(plan.key) is plan:
            _cache.move_to_end(plan.key)
    _stats["hits"] += 1
    return plan, held, bump


def cached(named: Sequence[tuple[str, torch.Tensor]], hold: bool = False,
           accept: Optional[Callable[[TargetPlan], bool]] = None) -> Optional[Resolved]:
    """The target's cached plan if it is still valid, else None; never binds. hold: as resolve()'s.
    accept: asked of the plan found before its check (which reads every tensor); False answers None."""
    names, tensors = _split(named)
    plan, held, _, plain = _lookup(names, tensors, hold, accept)
    if plan is None:
        return None
    return Resolved(plan, plain, None, True, held, wrapped=tensors)


def resize(resolved: Resolved, release: bool, refusals: Optional[list[str]] = None,
           part: Optional[tuple[int, int]] = None) -> bool:
    """`untyped_storage().resize_(n)` of a resolved target's live storages (those that hold memory in its
    layout), in order: to 0 (release) or back to their layout sizes; the plan then follows the target as
    it is (refresh()). One C++ call for all of them where the helper recorded the target and every storage is
    a CPU or CUDA one (a CUDA storage through its own allocator, torch's caching allocator: see the helper's
    resize_empty), else one call each. Stops at the first failure with the earlier
    ones resized (callers undo by size).

    With `refusals` (one message per live storage) and the helper's pass, each storage also refuses access
    once released, or has its refusal lifted before it grows, in the same pass; returns whether it did (if
    not, the caller refuses or allows).

    part: only the live storages [begin, end) (one of reload_parts(), in order; the helper's pass only)."""
    plan = resolved.plan
    if plan.resizes_in_one_pass:
        refuse = refusals is not None and torch_ext.access_guard_available()
        if refuse and not plan.record.has_refusals:
            plan.record.set_refusals(refusals)
        # Reaches the storages through the tensors, checks they are still the recorded ones, and keeps the
        # record up to date as it goes (so the plan needs no refresh()).
        if part is None:
            plan.record.resize_live(resolved.tensors, release, refuse, resolved.held)
        else:
            plan.record.resize_live(resolved.tensors, release, refuse, resolved.held, *part)
        plan.released, plan._storage_ptrs = release, None
        plan._forget_copies()
        return refuse
    if part is not None:
        raise ValueError("a resize in parts needs the torch-aware helper's record of the target")
    storages, specs = resolved.storages(), plan.layout.storages
    for i in plan.live:
        storages[i].resize_(0 if release else specs[i].nbytes)
    plan.refresh(resolved.tensors, released=release)
    return False


def recording() -> bool:
    """Whether plans are recorded by the torch-aware helper (one C++ pass per check, resize, watch)."""
    return _ext is not None


def zero_live(resolved: Resolved) -> None:
    """Zeroes a resolved target's live storages, whole (on a GPU in stream order): the CPU ones in one C++
    pass and the CUDA ones in one torch._foreach_zero_ where each one's first tensor views all of it, else
    one zero_() per storage."""
    plan = resolved.plan
    if plan.record is not None:
        cuda = plan.record.zero_live(resolved.tensors, resolved.held)
        if cuda is not None:
            if cuda:
                torch._foreach_zero_(cuda)
            return
    storages = resolved.storages()
    for i in plan.live:
        storage_view(storages[i]).zero_()


def increment_version(tensors: list[torch.Tensor]) -> None:
    """torch.autograd.graph.increment_version(tensors), in one C++ pass where the helper is loaded."""
    if _ext is not None and type(tensors) is list:
        _ext.bump_versions(tensors)
    else:
        torch.autograd.graph.increment_version(tensors)


def _rebound(names: list[str], tensors: list[torch.Tensor], plain: list[torch.Tensor],
             shard_info: Optional[Callable[[], Optional[str]]]) -> Optional[TargetPlan]:
    """A plan for tensors that no cached plan is valid for, made from the layout of a recorded plan (cached or
    retired) under the same names whose tensors laid their storages out the same way, or None (bind them).

    A training loop's gradients are new tensors after every backward, and a state_dict()'s are new detached
    ones at every call: the target is new, its layout is not. The new tensors are recorded (one C++ pass) and
    the record compared with the other plan's (the same storage grouping, views, dtypes, sizes and devices);
    what bind() would check beyond that (distinct names, tensors within their storages) the other plan's
    layout passed under the same names. The shard layout is asked again."""
    if _ext is None or not plain:
        return None
    n = len(names)
    with _cache_lock:
        _prune()
        candidates = [p for p in itertools.chain(reversed(_cache.values()), reversed(_retired))
                      if p.record is not None and len(p.names) == n]  # (a record is of all its plan's tensors)
    like = next((p for p in candidates if p.names is names), None)
    if like is None:  # (names read again: equal lists, made anew)
        like = next((p for p in candidates if p.names == names), None)
    if like is None:
        return None
    record = _ext.record(plain)
    if record is None or not record.same_layout(like.record) or not record.all_sized_have_memory():
        return None
    layout = like.layout
    if shard_info is not None:
        info = shard_info()
        if info != layout.shard_info:
            layout = layout.with_shard_info(info)
    bound = Bound(layout, None, None, record=record, tensors=plain, first_tensor=like.first_tensor)
    plan = TargetPlan(names, tensors, bound, plain, like=like)
    _stats["rebound"] += 1
    # New tensor objects on the very storages of the other plan: a state_dict()'s detached tensors, of the
    # module (whose own plan that is) or of the last state_dict() (whose tensors are dead now). The plan of
    # the last one is replaced in the cache, which would otherwise fill with plans that are never valid
    # again, each as large as the target; the module's own plan, and one in use by an offload or a drop, stay.
    plan.alias = record.same_storages(like.record)
    replaces = like.alias and plan.alias and like.offloaded is None and like.dropped is None and not like.released
    with _cache_lock:
        if replaces and _cache.get(like.key) is like:
            del _cache[like.key]
    _cache_plan(plan)
    return plan


def remember(named: Sequence[tuple[str, torch.Tensor]], bound: Bound,
             shard_info: Optional[Callable[[], Optional[str]]] = None) -> None:
    """Caches the plan of a target whose storages were just (re)allocated (reload), so that the next call
    on it needs no fresh bind."""
    names, tensors = _split(named)
    _new_plan(names, tensors, bound, shard_info, cache=True)


def _new_plan(names: list[str], tensors: list[torch.Tensor], bound: Bound,
              shard_info: Optional[Callable[[], Optional[str]]], cache: bool,
              plain: Optional[list[torch.Tensor]] = None) -> TargetPlan:
    if shard_info is not None:
        info = shard_info()
        if info is not None:
            bound.layout = bound.layout.with_shard_info(info)
    plan = TargetPlan(names, tensors, bound, plain)
    # Only live storages at real addresses, whose tensors all fit inside them, are worth remembering. (A
    # record read the sizes it holds; the Python bind may have had them overridden.)
    layout_nbytes = bound.layout.storage_columns[1]
    # (A record answers in one C++ pass what the pointers say, making no Python int per storage.)
    at_addresses = (plan.record.all_sized_have_memory() if plan.record is not None
                    else all(itertools.compress(plan.storage_ptrs, layout_nbytes)))
    if (cache and at_addresses
            and (plan.record is not None or list(map(torch.UntypedStorage.nbytes, bound.storages)) == layout_nbytes)
            and extent_problem(bound.layout) is None):
        _cache_plan(plan)
    return plan


def _cache_plan(plan: TargetPlan) -> None:
    with _cache_lock:
        _prune()
        _cache[plan.key] = plan
        while len(_cache) > _MAX_CACHED:
            _cache.popitem(last=False)


def cache_info() -> dict[str, int]:
    """Plans cached, and cache hits and misses since the start (of the misses, `rebound`: served a cached
    plan's layout, see _rebound)."""
    with _cache_lock:
        return {"num_plans": len(_cache), **_stats}


def clear_cache() -> None:
    with _cache_lock:
        _cache.clear()
        _retired.clear()
